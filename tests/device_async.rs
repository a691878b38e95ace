//! A device all-reduce's enqueue never waits for a peer, on the CUDA stand-in (or the real
//! driver, `OXCCL_DEVICE_TESTS_REAL=1`).
//!
//! Two rank processes with device buffers, after one call together (the first device call of a
//! communicator sets its device mode up, collectively). For each call, rank 1 calls `ncclAllReduce` only
//! after it has seen that rank 0's `ncclAllReduce` returned (rank 0 creates a marker file right
//! after the return, before synchronising its stream), then waits another 300 ms: an enqueue
//! that waited for its peer on the host would never return (the peer waits for the marker, for
//! at most 20 s, then fails the run). Sizes 8 B (small flow), 64 KiB (staged), 4 MiB and
//! 32 MiB (direct flow; 32 MiB is the regions' area size); each size on a fresh allocation, the
//! same buffers again (the mappings cached), and another fresh allocation (out of place),
//! int32 and float32 sums exact against the reference. Rank 0 prints how long each call took to
//! return and how long until its stream finished (the measurement, not asserted). A second
//! test runs a call of more rounds than the ring of published rounds holds.

mod common;

use common::allreduce::reference;
use common::standin::{join, standin_env, upload, DevMem};
use cudarc::driver::{result, sys};
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const SIZES: [usize; 4] = [8, 64 << 10, 4 << 20, 32 << 20];
/// How late rank 1 calls after it saw rank 0's return.
const LATE: Duration = Duration::from_millis(300);

fn marker(id: &str, k: usize) -> PathBuf {
    std::env::temp_dir().join(format!("oxccl-async-{}-{k}", &id[..16.min(id.len())]))
}

fn input(t: DataType, rank: usize, count: usize, seed: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, seed, false, false)).collect();
    let mut out = vec![0u8; count * t.size()];
    oxccl::reduce::from_f64(t, &vals, &mut out);
    out
}

/// One call, ordered against the peer through the marker `k`; checked.
#[allow(clippy::too_many_arguments)]
fn call(comm: ncclComm_t, rank: usize, id: &str, k: usize, send: u64, recv: u64, bytes: usize, stream: sys::CUstream) {
    let t = if k % 2 == 0 { DataType::Int32 } else { DataType::Float32 };
    let count = bytes / t.size();
    let seed = 3 + k;
    upload(send, &input(t, rank, count, seed), stream);
    let m = marker(id, k);
    if rank == 1 {
        let start = Instant::now();
        while !m.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "rank 1: rank 0's call {k} ({bytes} bytes) never returned"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(LATE);
    }
    let start = Instant::now();
    let r = ncclAllReduce(send as *const _, recv as *mut _, count, t as i32, ReduceOp::Sum as i32, comm, stream.cast());
    let returned = start.elapsed();
    assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: call {k}");
    if rank == 0 {
        std::fs::write(&m, b"returned").expect("marker");
    }
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    let finished = start.elapsed();
    if rank == 0 {
        let _ = std::fs::remove_file(&m);
        eprintln!(
            "rank 0: call {k}: {bytes} bytes {}: returned after {:.3} ms, stream done after {:.1} ms (peer {} ms late)",
            t.name(),
            returned.as_secs_f64() * 1e3,
            finished.as_secs_f64() * 1e3,
            LATE.as_millis()
        );
    }
    let mut got = vec![0u8; count * t.size()];
    // SAFETY: `recv` holds count elements; the stream is synchronised.
    unsafe { result::memcpy_dtoh_sync(&mut got, recv) }.unwrap();
    for (i, g) in oxccl::reduce::to_f64(t, &got).iter().enumerate() {
        let (want, tol) = reference(t, ReduceOp::Sum, 2, i, seed);
        assert!(
            (g - want).abs() <= tol,
            "rank {rank}: call {k} ({bytes} bytes {}): element {i} is {g}, want {want}",
            t.name()
        );
    }
}

fn rank_main(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    // The communicator's first device call sets its device mode up, collectively (as NCCL's
    // first call connects its peers): both ranks make it together.
    let warm = DevMem::new(64);
    let r = ncclAllReduce(warm.0 as *const _, warm.0 as *mut _, 16, DataType::Int32 as i32, 0, comm, streams[0].cast());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(streams[0]) }.unwrap();
    let mut k = 0;
    for bytes in SIZES {
        let a = DevMem::new(bytes);
        // A fresh buffer, in place; the same again; a fresh pair, out of place.
        call(comm, rank, id, k, a.0, a.0, bytes, streams[0]);
        call(comm, rank, id, k + 1, a.0, a.0, bytes, streams[0]);
        let (s, r) = (DevMem::new(bytes), DevMem::new(bytes));
        call(comm, rank, id, k + 2, s.0, r.0, bytes, streams[0]);
        k += 3;
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn an_all_reduce_returns_before_its_peer_calls_at_every_size() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "30000".into()));
    let res = common::run_ranks(
        "an_all_reduce_returns_before_its_peer_calls_at_every_size",
        2,
        &env,
        Duration::from_secs(120),
    );
    eprintln!("{}", res[0].1.lines().filter(|l| l.starts_with("rank 0: call")).collect::<Vec<_>>().join("\n"));
    common::assert_all_ok(&res);
}

/// A call of more rounds than the ring holds (8 MiB in rounds of 64 KiB: 128 rounds, the ring
/// 64), twice, on areas of 64 KiB: each round reuses a slot once the round before it that used
/// the slot has finished (not the whole call, which would wait for itself). Exact.
fn many_rounds_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let bytes = 8 << 20;
    let buf = DevMem::new(bytes);
    for seed in [40, 41] {
        let t = DataType::Int32;
        let count = bytes / t.size();
        upload(buf.0, &input(t, rank, count, seed), streams[0]);
        let r = ncclAllReduce(buf.0 as *const _, buf.0 as *mut _, count, t as i32, 0, comm, streams[0].cast());
        assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}");
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(streams[0]) }.unwrap();
        let mut got = vec![0u8; bytes];
        // SAFETY: `buf` holds `bytes`; the stream is synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
        for (i, g) in oxccl::reduce::to_f64(t, &got).iter().enumerate() {
            let (want, _) = reference(t, ReduceOp::Sum, n, i, seed);
            assert_eq!(*g, want, "rank {rank}: element {i}");
        }
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn a_call_of_more_rounds_than_the_ring_holds_completes_exactly() {
    const NAME: &str = "a_call_of_more_rounds_than_the_ring_holds_completes_exactly";
    if let Some((rank, n, id)) = common::child_role() {
        many_rounds_rank(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "20000".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    env.push(("OXCCL_DEBUG", "INFO".into()));
    let res = common::run_ranks(NAME, 2, &env, Duration::from_secs(120));
    common::assert_all_ok(&res);
    assert!(res[0].1.contains("direct flow from"), "rank 0 did not take the direct flow:\n{}", res[0].1);
}
