//! Multi-process tests of buffers in shareable host memory (`oxccl::SharedBuffer`, what
//! `ncclMemAlloc` returns), which the host arena reads where they lie:
//!
//! * `many_ranks_read_shared_buffers_correctly`: 10 and 16 ranks (a call maps up to 2(n-1)
//!   peer allocations, more than the peer-mapping cache keeps between calls), out of place and
//!   in place, every rank's buffers shared or a mix of shared and unshared ranks, new buffers at
//!   every call: every result matches an f64 reference;
//! * `a_stranger_cannot_truncate_a_ranks_shared_buffer`: while the ranks all-reduce in a loop,
//!   a process that is not a member (a child of the test, same user) opens a rank's buffer
//!   through `/proc/<pid>/fd/<n>` and calls `ftruncate`: the call fails (the file is sealed) and
//!   every rank completes with correct results.

mod common;

use common::allreduce::check_case_in;
use common::planless::{join, shm_env};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

/// [`shm_env`] with the arena forced on (whatever the machine's CPU count).
fn env() -> Vec<(&'static str, String)> {
    shm_env(&[("OXCCL_ARENA", "1"), ("OXCCL_DEBUG", "INFO")])
}

#[test]
fn child_many() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    let mut seed = 100;
    for in_place in [false, true] {
        // Every rank's buffers shared, then a mix: every fourth rank copies, the others share
        // one or both buffers.
        for mixed in [false, true] {
            for (t, op, count) in [(DataType::Float32, ReduceOp::Sum, 4099), (DataType::Int32, ReduceOp::Max, 333)] {
                seed += 1;
                let shared = match (mixed, rank % 4) {
                    (false, _) => [true, true],
                    (true, 0) => [false, false],
                    (true, 1) => [true, false],
                    (true, 2) => [false, true],
                    (true, _) => [true, true],
                };
                check_case_in(&comm, t, op, count, in_place, seed, shared).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn many_ranks_read_shared_buffers_correctly() {
    if common::child_role().is_some() {
        return;
    }
    for n in [10, 16] {
        let res = common::run_ranks("child_many", n, &env(), Duration::from_secs(300));
        common::assert_all_ok(&res);
        for (r, (_, log)) in res.iter().enumerate() {
            assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
            assert!(log.contains("are read where they lie"), "{n} ranks: rank {r} read no buffer in place:\n{log}");
        }
    }
}

/// Runs `truncate -s <size> <path>` (a process of the same user that is no member) and
/// returns its exit status and error text.
fn stranger_truncates(path: &str, size: &str) -> (bool, String) {
    let out = std::process::Command::new("truncate").args(["-s", size, path]).output().expect("run truncate");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).trim().to_string())
}

#[test]
fn child_truncated() {
    let Some(comm) = join() else { return };
    let (rank, n) = (comm.rank(), comm.size());
    let count = 4099;
    let (t, op) = (DataType::Float32, ReduceOp::Sum);
    let send = oxccl::SharedBuffer::new(count * 4).expect("shareable memory");
    let recv = oxccl::SharedBuffer::new(count * 4).expect("shareable memory");
    let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, 77, false, false)).collect();
    let mut bytes = vec![0u8; count * 4];
    oxccl::reduce::from_f64(t, &vals, &mut bytes);
    // SAFETY: `send` holds count * 4 bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), send.as_ptr(), bytes.len()) };
    let desc = oxccl::transport::shm::hostmem::find(send.as_ptr(), 1).expect("a shared buffer");
    for k in 0..40 {
        if rank == 1 && k == 10 {
            // Between calls, while the peers keep this buffer mapped: a stranger opens it
            // through /proc and shrinks it, then the owner tries, then the stranger grows it.
            let path = format!("/proc/{}/fd/{}", std::process::id(), desc.fd);
            for size in ["0", "+1M"] {
                let (ok, text) = stranger_truncates(&path, size);
                assert!(!ok, "a stranger changed the size of a rank's buffer ({size})");
                eprintln!("STRANGER size={size} refused: {text}");
            }
            // SAFETY: plain system call on this process's memfd.
            let r = unsafe { libc::ftruncate(desc.fd as i32, 0) };
            let e = std::io::Error::last_os_error();
            assert!(r != 0 && e.raw_os_error() == Some(libc::EPERM), "the owner shrank its shared buffer: {e}");
            eprintln!("OWNER refused: {e}");
        }
        // SAFETY: both buffers hold count elements and do not overlap.
        unsafe { comm.all_reduce_raw(send.as_ptr(), recv.as_ptr(), count, t, op) }.expect("all-reduce");
        // SAFETY: `recv` holds count * 4 initialised bytes.
        let out = unsafe { std::slice::from_raw_parts(recv.as_ptr(), count * 4) };
        let got = oxccl::reduce::to_f64(t, out);
        for (i, g) in got.iter().enumerate() {
            let (want, tol) = common::allreduce::reference(t, op, n, i, 77);
            assert!((g - want).abs() <= tol, "rank {rank} call {k}: element {i} is {g}, want {want}");
        }
    }
    eprintln!("DONE rank={rank} n={n}");
}

#[test]
fn a_stranger_cannot_truncate_a_ranks_shared_buffer() {
    if common::child_role().is_some() {
        return;
    }
    let n = 3;
    let res = common::run_ranks("child_truncated", n, &env(), Duration::from_secs(120));
    common::assert_all_ok(&res);
    for (r, (_, log)) in res.iter().enumerate() {
        assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
        assert!(log.contains("are read where they lie"), "rank {r} read no buffer in place:\n{log}");
    }
    let log = &res[1].1;
    assert!(log.contains("STRANGER size=0 refused") && log.contains("Operation not permitted"), "{log}");
    assert!(log.contains("STRANGER size=+1M refused") && log.contains("OWNER refused"), "{log}");
}
