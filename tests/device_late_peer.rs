//! A device all-reduce whose peer calls 300 ms late, between two rank processes, on the CUDA
//! stand-in (or the real driver, `OXCCL_DEVICE_TESTS_REAL=1`): the GPU check kit's step for
//! asynchronous enqueue (docs/GPU.md, `5-late-peer`).
//!
//! Rank 1 sleeps [`LATE`] before each measured call; rank 0 calls at once and measures how long
//! its `ncclAllReduce` takes to return, at 8 B, 64 KiB, 4 MiB (and 32 MiB on a real GPU), on
//! buffers the communicator has seen (a warm-up call together first) and on fresh ones. Every
//! result is checked exact against the f64 reference. The return times are printed (a `NOTE:`
//! line): they are figures, not asserted here, except with `OXCCL_KIT_STRICT=1` (the kit on a
//! real GPU), where each must be at most [`BOUND_MS`] (NCCL's enqueue never waits for peers).

mod common;

use common::allreduce::reference;
use common::standin::{join, real_driver, standin_env, upload, DevMem};
use cudarc::driver::result;
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::{Duration, Instant};

/// How late rank 1 calls.
const LATE: Duration = Duration::from_millis(300);
/// The most a call may take to return under `OXCCL_KIT_STRICT=1`.
const BOUND_MS: f64 = 20.0;
/// The prefix of rank 0's figure lines.
const LINE: &str = "LATE-PEER ";

fn sizes() -> Vec<usize> {
    let mut v = vec![8, 64 << 10, 4 << 20];
    if real_driver() {
        v.push(32 << 20);
    }
    v
}

fn rank_main(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let s = streams[0];
    let t = DataType::Float32;
    let mut seed = 0;
    let mut one = |buf: &DevMem, bytes: usize, late: bool| -> f64 {
        seed += 1;
        let count = bytes / t.size();
        let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, seed, false, false)).collect();
        let mut data = vec![0u8; bytes];
        oxccl::reduce::from_f64(t, &vals, &mut data);
        upload(buf.0, &data, s);
        if late && rank == 1 {
            std::thread::sleep(LATE);
        }
        let t0 = Instant::now();
        let r =
            ncclAllReduce(buf.0 as *const _, buf.0 as *mut _, count, t as i32, ReduceOp::Sum as i32, comm, s.cast());
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: {bytes} bytes");
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(s) }.unwrap();
        // SAFETY: `buf` holds `bytes`; the stream is synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut data, buf.0) }.unwrap();
        for (i, g) in oxccl::reduce::to_f64(t, &data).iter().enumerate() {
            let (want, tol) = reference(t, ReduceOp::Sum, n, i, seed);
            assert!((g - want).abs() <= tol, "rank {rank}, {bytes} bytes: element {i} is {g}, want {want}");
        }
        ms
    };
    for bytes in sizes() {
        let seen = DevMem::new(bytes);
        one(&seen, bytes, false);
        let ms_seen = one(&seen, bytes, true);
        let fresh = DevMem::new(bytes);
        let ms_fresh = one(&fresh, bytes, true);
        if rank == 0 {
            eprintln!("{LINE}{bytes} {ms_seen:.2} {ms_fresh:.2}");
        }
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn a_late_peer_and_the_return_of_the_enqueue() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    let res = common::run_ranks("a_late_peer_and_the_return_of_the_enqueue", 2, &env, Duration::from_secs(240));
    common::assert_all_ok(&res);
    let rows: Vec<(usize, f64, f64)> = res[0]
        .1
        .lines()
        .filter_map(|l| l.strip_prefix(LINE))
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    assert_eq!(rows.len(), sizes().len(), "rank 0's figures:\n{}", res[0].1);
    let text: Vec<String> = rows.iter().map(|(b, s, f)| format!("{b} B {s:.1}/{f:.1} ms")).collect();
    // The kit's runner takes the first NOTE line of a step as its note.
    println!(
        "\nNOTE: peer {} ms late, return of rank 0's call (seen/fresh buffers): {}",
        LATE.as_millis(),
        text.join(", ")
    );
    if std::env::var("OXCCL_KIT_STRICT").is_ok_and(|v| v == "1") {
        for (b, s, f) in rows {
            assert!(s.max(f) <= BOUND_MS, "{b} bytes: the call returned after {s:.1}/{f:.1} ms (at most {BOUND_MS})");
        }
    }
}
