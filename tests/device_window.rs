//! Large device all-reduces on the CUDA stand-in (or the real driver, `OXCCL_DEVICE_TESTS_REAL=1`):
//! the window plans of `algo::window` run by the device executor.
//!
//! Covered: between processes, an all-reduce of at least `IPC_DIRECT_MIN` bytes takes the
//! direct flow (every rank folds its segment of the peers' buffers where they lie): no copy at
//! all but the first upload of its fold table (counted by the stand-in at enqueue: none when the
//! same buffers come again), at most 4(n - 1) + 3 stream operations per rank, and exact results
//! against the f64 reference for a selection of types and operators, in and out of place,
//! with buffers at aligned and unaligned offsets inside one allocation (as a caching allocator
//! hands them out), on 2 and 3 ranks. With `OXCCL_CUDA_DIRECT=0` on one rank only, that rank
//! stages its own buffers through its regions while the other's are read where they lie, and
//! the results stay exact. Ranks that are threads of one process take the direct flow too, their buffers
//! published on the device (the boards): every case exact, at most 4(n - 1) + 7 stream
//! operations per rank and no copy once the board table is cached; threads whose calls differ
//! in type all fail, at least one with `ncclInvalidUsage` from the device's check (the other
//! may first hear of its peer's failure), and a rank whose partner never calls
//! times out (after its communicator's `OXCCL_TIMEOUT_MS`, not the process's) without the
//! released fold writing anything; without 64-bit stream memory operations the same calls
//! write their words in 32-bit halves and stay exact. A PreMulSum
//! all-reduce (staged through the proxy thread) followed at once by a direct one: both exact.
//! Failures: a rank killed (SIGKILL) just before a direct all-reduce fails the others within
//! 2 s (with `OXCCL_TIMEOUT_MS` at 60 s), and later calls fail at once; ranks whose direct
//! all-reduces differ in type all fail (the enqueue returns; the error is asynchronous), at
//! least one with `ncclInvalidUsage` naming the mismatch.

mod common;
#[path = "common/devcase.rs"]
mod devcase;

use common::allreduce::{reference, unsigned};
use common::standin::{as_threads, join, real_driver, standin_count, standin_env, upload, wait_async_error, DevMem};
use cudarc::driver::{result, sys};
use devcase::last_error;
use oxccl::algo::select::IPC_DIRECT_MIN;
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::{Duration, Instant};

/// Bytes of each call: past the direct flow's threshold, with a tail that is no multiple of 16.
const BYTES: usize = IPC_DIRECT_MIN + 4096 + 40;

/// The cases: (type, operator); even ones in place.
const CASES: [(DataType, ReduceOp); 8] = [
    (DataType::Float32, ReduceOp::Sum),
    (DataType::Float32, ReduceOp::Avg),
    (DataType::Bfloat16, ReduceOp::Sum),
    (DataType::Float16, ReduceOp::Max),
    (DataType::Int32, ReduceOp::Min),
    (DataType::Uint8, ReduceOp::Sum),
    (DataType::Float64, ReduceOp::Prod),
    (DataType::Float8e4m3, ReduceOp::Sum),
];

fn input(t: DataType, op: ReduceOp, rank: usize, count: usize, seed: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
    let mut out = vec![0u8; count * t.size()];
    oxccl::reduce::from_f64(t, &vals, &mut out);
    out
}

fn check(t: DataType, op: ReduceOp, n: usize, seed: usize, got: &[u8], what: &str) {
    for (i, g) in oxccl::reduce::to_f64(t, got).iter().enumerate() {
        let (want, tol) = reference(t, op, n, i, seed);
        assert!((g - want).abs() <= tol, "{what}: element {i} is {g}, want {want} (tolerance {tol})");
    }
}

/// (stream operations, copies) the stand-in counted so far in this process.
fn counts() -> (u64, u64) {
    (standin_count(100).unwrap_or(0), standin_count(0).unwrap_or(0))
}

/// One all-reduce of `t`/`op` from `send` into `recv` (equal: in place), counted and checked.
/// `gate` runs around each reading of the counts (ranks that are threads of one process share
/// the stand-in's counts: their gate keeps them in step, so only the enqueues are counted).
#[allow(clippy::too_many_arguments)]
fn call(
    comm: ncclComm_t,
    rank: usize,
    n: usize,
    send: u64,
    recv: u64,
    t: DataType,
    op: ReduceOp,
    seed: usize,
    stream: sys::CUstream,
    gate: &dyn Fn(),
) -> (u64, u64) {
    let count = BYTES / t.size();
    upload(send, &input(t, op, rank, count, seed), stream);
    gate();
    let before = counts();
    gate();
    let r = ncclAllReduce(send as *const _, recv as *mut _, count, t as i32, op as i32, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: {}", last_error(comm));
    gate();
    let after = counts();
    gate();
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    let mut got = vec![0u8; count * t.size()];
    // SAFETY: `recv` holds count elements; the stream is synchronised.
    unsafe { result::memcpy_dtoh_sync(&mut got, recv) }.unwrap();
    let what = format!("rank {rank} of {n}: {} {} at {send:#x} -> {recv:#x}", t.name(), op.name());
    check(t, op, n, seed, &got, &what);
    (after.0 - before.0, after.1 - before.1)
}

/// Every case on one allocation, at offsets that change alignment; `direct`: the counts the
/// direct flow promises are asserted.
fn rank_main(rank: usize, n: usize, id: &str, direct: bool) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let arena = DevMem::new(2 * BYTES + 1024);
    for (k, &(t, op)) in CASES.iter().enumerate() {
        let shift = if k % 3 == 2 { t.size() as u64 } else { 0 };
        let send = arena.0 + 256 + shift;
        let recv = if k % 2 == 0 { send } else { send + BYTES as u64 + 256 };
        let seed = 10 + k;
        let (ops, copies) = call(comm, rank, n, send, recv, t, op, seed, streams[0], &|| ());
        if direct && !real_driver() {
            // The first call also sets the mode up (it zeroes the board).
            let limit = 4 * (n as u64 - 1) + 3 + u64::from(k == 0);
            assert!(ops <= limit, "rank {rank}, case {k}: {ops} stream operations (at most {limit})");
            assert!(copies <= 1, "rank {rank}, case {k}: {copies} copies (at most the fold table's upload)");
            // The same buffers again: the fold table is cached, nothing is copied at all.
            let (_, again) = call(comm, rank, n, send, recv, t, op, seed + 100, streams[0], &|| ());
            assert_eq!(again, 0, "rank {rank}, case {k}: a repeated call copied");
        }
    }
    staged_then_direct(comm, rank, n, &arena, streams[0]);
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

/// A PreMulSum all-reduce (staged through the proxy thread in IPC mode) and, without waiting,
/// a plain one that may take the direct flow: the direct flow's host exchange waits for the
/// staged job instead of meeting it on the links. Both results checked.
fn staged_then_direct(comm: ncclComm_t, rank: usize, n: usize, arena: &DevMem, stream: sys::CUstream) {
    use oxccl::ffi::premul::{ncclRedOpCreatePreMulSum, ncclRedOpDestroy};
    let t = DataType::Float32;
    let count = BYTES / t.size();
    let (a, b) = (arena.0 + 256, arena.0 + 256 + BYTES as u64 + 256);
    let (xa, xb) = (input(t, ReduceOp::Sum, rank, count, 70), input(t, ReduceOp::Sum, rank, count, 71));
    upload(a, &xa, stream);
    upload(b, &xb, stream);
    let mut scalar = 2.0f32;
    let mut op = 0;
    let r = ncclRedOpCreatePreMulSum(&mut op, (&mut scalar as *mut f32).cast(), t as i32, 1, comm);
    assert_eq!(r, ncclResult_t::ncclSuccess);
    let r = ncclAllReduce(a as *const _, a as *mut _, count, t as i32, op, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    let r = ncclAllReduce(b as *const _, b as *mut _, count, t as i32, ReduceOp::Sum as i32, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    assert_eq!(ncclRedOpDestroy(op, comm), ncclResult_t::ncclSuccess);
    let mut got = vec![0u8; count * t.size()];
    // SAFETY: `a` holds count elements; the stream is synchronised.
    unsafe { result::memcpy_dtoh_sync(&mut got, a) }.unwrap();
    for (i, g) in oxccl::reduce::to_f64(t, &got).iter().enumerate() {
        let (want, tol) = reference(t, ReduceOp::Sum, n, i, 70);
        assert!((g - 2.0 * want).abs() <= 2.0 * tol, "rank {rank}: PreMulSum element {i} is {g}, want {}", 2.0 * want);
    }
    // SAFETY: as above.
    unsafe { result::memcpy_dtoh_sync(&mut got, b) }.unwrap();
    check(t, ReduceOp::Sum, n, 71, &got, &format!("rank {rank}: the all-reduce after a staged one"));
}

fn run(entry: &str, n: usize, extra: &[(&'static str, String)]) -> Vec<(bool, String)> {
    let mut env = standin_env();
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    env.extend_from_slice(extra);
    common::run_ranks(entry, n, &env, Duration::from_secs(240))
}

const DIRECT_LINE: &str = "direct flow from";

#[test]
fn large_all_reduces_between_processes_read_the_peers_buffers_where_they_lie() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id, true);
        return;
    }
    for n in [2, 3] {
        let res = run("large_all_reduces_between_processes_read_the_peers_buffers_where_they_lie", n, &[]);
        common::assert_all_ok(&res);
        for (i, (_, err)) in res.iter().enumerate() {
            assert!(err.contains(DIRECT_LINE), "{n} ranks, rank {i}: no INFO line naming the direct flow:\n{err}");
        }
    }
}

#[test]
fn one_rank_refusing_the_direct_flow_stages_its_own_buffers_through_its_regions() {
    if let Some((rank, n, id)) = common::child_role() {
        if rank == 1 {
            // Before the communicator reads its settings; nothing else in this process reads
            // the environment concurrently (the rank's work runs on this thread).
            std::env::set_var("OXCCL_CUDA_DIRECT", "0");
        }
        rank_main(rank, n, &id, false);
        return;
    }
    let res = run("one_rank_refusing_the_direct_flow_stages_its_own_buffers_through_its_regions", 2, &[]);
    common::assert_all_ok(&res);
    assert!(res[1].1.contains("buffers staged through its regions: OXCCL_CUDA_DIRECT=0"), "rank 1:\n{}", res[1].1);
    assert!(res[0].1.contains("published in the flag pages"), "rank 0:\n{}", res[0].1);
}

/// Ranks as threads of one process: every case, the counts taken over both ranks together
/// (the stand-in counts per process) between gates that keep the threads in step.
fn threads_child() {
    const N: usize = 2;
    let gate = std::sync::Barrier::new(N);
    as_threads(N, |rank, comm, stream| {
        let arena = DevMem::new(2 * BYTES + 1024);
        for (k, &(t, op)) in CASES.iter().enumerate() {
            let shift = if k % 3 == 2 { t.size() as u64 } else { 0 };
            let send = arena.0 + 256 + shift;
            let recv = if k % 2 == 0 { send } else { send + BYTES as u64 + 256 };
            let (ops, copies) = call(comm, rank, N, send, recv, t, op, 40 + k, stream, &|| {
                gate.wait();
            });
            if !real_driver() {
                // The first call also sets the mode up (it zeroes each board). Without 64-bit
                // stream memory operations, the 4 board words and the ticket take 2 writes each.
                let halves = std::env::var("OXCCL_STANDIN_NO_MEMOP64").is_ok_and(|v| v == "1");
                let limit = N as u64 * (4 * (N as u64 - 1) + 7 + u64::from(k == 0) + if halves { 5 } else { 0 });
                assert!(ops <= limit, "case {k}: {ops} stream operations for {N} ranks (at most {limit})");
                let most = if k == 0 { N as u64 } else { 0 };
                assert!(copies <= most, "case {k}: {copies} copies (at most {most}: the board tables' first upload)");
            }
        }
    });
}

#[test]
fn ranks_that_share_a_process_publish_their_buffers_on_the_device() {
    if common::child_role().is_some() {
        threads_child();
        return;
    }
    let res = run("ranks_that_share_a_process_publish_their_buffers_on_the_device", 1, &[]);
    common::assert_all_ok(&res);
    assert!(res[0].1.contains(DIRECT_LINE), "threads did not take the direct flow:\n{}", res[0].1);
    assert!(res[0].1.contains("published on the device"), "no INFO line naming the boards:\n{}", res[0].1);
}

/// Thread rank 1 all-reduces int32 where rank 0 all-reduces float (same count): the fold
/// kernels refuse the boards. The first watchdog to see its fault word fails its communicator
/// with `ncclInvalidUsage` and tells the other, whose own kernel may not have run yet: every
/// rank fails, with `ncclInvalidUsage` or the peer's failure (`ncclRemoteError`), and at least
/// one with `ncclInvalidUsage` naming the mismatch.
fn threads_mismatch_child() {
    let seen = std::sync::Mutex::new(Vec::new());
    as_threads(2, |rank, comm, stream| {
        let buf = DevMem::new(BYTES);
        let t = if rank == 1 { DataType::Int32 } else { DataType::Float32 };
        let r = ncclAllReduce(buf.0 as *const _, buf.0 as *mut _, BYTES / 4, t as i32, 0, comm, stream.cast());
        assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: the enqueue cannot know yet");
        let e = wait_async_error(comm, Duration::from_secs(20));
        let msg = last_error(comm);
        assert!(
            e == ncclResult_t::ncclInvalidUsage && msg.contains("collective mismatch")
                || e == ncclResult_t::ncclRemoteError,
            "rank {rank}: {e:?}: {msg}"
        );
        seen.lock().unwrap().push(e);
        // SAFETY: a live stream of the current context (its barriers passed or were released).
        let _ = unsafe { result::stream::synchronize(stream) };
    });
    let seen = seen.into_inner().unwrap();
    assert!(seen.contains(&ncclResult_t::ncclInvalidUsage), "no rank reported the mismatch: {seen:?}");
}

#[test]
fn threads_whose_direct_all_reduces_differ_get_invalid_usage_from_the_device() {
    if common::child_role().is_some() {
        threads_mismatch_child();
        return;
    }
    let res = run("threads_whose_direct_all_reduces_differ_get_invalid_usage_from_the_device", 1, &[]);
    common::assert_all_ok(&res);
}

/// After one direct all-reduce together, thread rank 1 frees its buffers and calls no more;
/// rank 0's next direct all-reduce times out, the watchdog releases its
/// barrier, and the fold that then runs finds rank 1's board of the earlier call: nothing is
/// written (rank 0's receive buffer keeps its sentinel), nothing is read through rank 1's
/// freed buffers.
fn threads_alone_child() {
    as_threads(2, |rank, comm, stream| {
        let (send, recv) = (DevMem::new(BYTES), DevMem::new(BYTES));
        let r = ncclAllReduce(send.0 as *const _, recv.0 as *mut _, BYTES / 4, 7, 0, comm, stream.cast());
        assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: the first call");
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(stream) }.unwrap();
        if rank == 1 {
            return;
        }
        upload(recv.0, &vec![0x5Au8; BYTES], stream);
        let start = Instant::now();
        let r = ncclAllReduce(send.0 as *const _, recv.0 as *mut _, BYTES / 4, 7, 0, comm, stream.cast());
        assert_eq!(r, ncclResult_t::ncclSuccess);
        let e = wait_async_error(comm, Duration::from_secs(20));
        assert_ne!(e, ncclResult_t::ncclSuccess, "no error with a partner that never called");
        eprintln!("rank 0: alone for {:?}: {}", start.elapsed(), last_error(comm));
        // SAFETY: a live stream of the current context; its barriers were released. A fold
        // through rank 1's freed buffers would fail it (an illegal address).
        unsafe { result::stream::synchronize(stream) }.expect("the released call's stream");
        let mut got = vec![0u8; BYTES];
        // SAFETY: `recv` holds BYTES bytes; the stream is synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut got, recv.0) }.unwrap();
        assert!(got.iter().all(|&b| b == 0x5A), "the released fold wrote into the receive buffer");
    });
}

/// The bound is the communicators' `OXCCL_TIMEOUT_MS` (1.5 s, read when they are made), not the
/// process's (60 s, read first): the watchdog releases the call within the 20 s the child waits.
#[test]
fn a_thread_whose_partner_never_calls_times_out_and_its_fold_writes_nothing() {
    if common::child_role().is_some() {
        assert_eq!(oxccl::config::timeout(), Duration::from_secs(60), "the process's bound, read first");
        // Before the communicators read their settings; no other thread runs yet.
        std::env::set_var("OXCCL_TIMEOUT_MS", "1500");
        threads_alone_child();
        return;
    }
    let res = run("a_thread_whose_partner_never_calls_times_out_and_its_fold_writes_nothing", 1, &[]);
    common::assert_all_ok(&res);
}

/// On a device without 64-bit stream memory operations (the stand-in's
/// `OXCCL_STANDIN_NO_MEMOP64=1`, where `cuStreamWriteValue64` fails), the boards and the
/// done/ticket words are written as 32-bit halves: threads' direct all-reduces stay exact, with
/// one WARN line naming the attribute.
#[test]
fn without_64_bit_stream_memory_operations_words_are_written_in_halves() {
    if common::child_role().is_some() {
        threads_child();
        return;
    }
    if real_driver() {
        common::skipped("the stand-in's switch for 64-bit stream memory operations");
        return;
    }
    let res = run(
        "without_64_bit_stream_memory_operations_words_are_written_in_halves",
        1,
        &[("OXCCL_STANDIN_NO_MEMOP64", "1".into())],
    );
    common::assert_all_ok(&res);
    assert!(res[0].1.contains("CAN_USE_64_BIT_STREAM_MEM_OPS is 0"), "no WARN line:\n{}", res[0].1);
    assert!(res[0].1.contains(DIRECT_LINE), "threads did not take the direct flow:\n{}", res[0].1);
}

/// Rank n - 1 dies (SIGKILL) right before a direct all-reduce; the others' call must report it
/// within 2 s, and their next call fails at once.
fn killed_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let arena = DevMem::new(2 * BYTES + 1024);
    let (t, op) = (DataType::Float32, ReduceOp::Sum);
    call(comm, rank, n, arena.0, arena.0, t, op, 1, streams[0], &|| ());
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: kills this process, as `kill -9` would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let start = Instant::now();
    let count = BYTES / t.size();
    let r = ncclAllReduce(arena.0 as *const _, arena.0 as *mut _, count, t as i32, op as i32, comm, streams[0].cast());
    if r == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        let _ = unsafe { result::stream::synchronize(streams[0]) };
    }
    let e = wait_async_error(comm, Duration::from_secs(10));
    let took = start.elapsed();
    assert!(
        r != ncclResult_t::ncclSuccess || e != ncclResult_t::ncclSuccess,
        "rank {rank}: no error after a peer was killed"
    );
    assert!(took < Duration::from_secs(2), "rank {rank}: the peer's death was reported after {took:?}");
    eprintln!("rank {rank}: peer death reported after {took:?}: {}", last_error(comm));
    let r = ncclAllReduce(arena.0 as *const _, arena.0 as *mut _, 2, t as i32, op as i32, comm, streams[0].cast());
    assert_ne!(r, ncclResult_t::ncclSuccess, "rank {rank}: a call after the failure");
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn a_rank_killed_before_a_direct_all_reduce_fails_the_others_within_2s() {
    if let Some((rank, n, id)) = common::child_role() {
        killed_rank(rank, n, &id);
        return;
    }
    let res = run("a_rank_killed_before_a_direct_all_reduce_fails_the_others_within_2s", 3, &[]);
    assert!(!res[2].0, "the killed rank cannot succeed");
    common::assert_all_ok(&res[..2]);
}

/// Rank 1 all-reduces int32 where rank 0 all-reduces float, same count, past the threshold.
fn mismatched_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let buf = DevMem::new(BYTES);
    let t = if rank == 1 { DataType::Int32 } else { DataType::Float32 };
    let r = ncclAllReduce(buf.0 as *const _, buf.0 as *mut _, BYTES / 4, t as i32, 0, comm, streams[0].cast());
    // The enqueue does not meet the peer: the mismatch is found by the opener threads (or the
    // fold's check on the device) and reported asynchronously.
    let e = if r == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context (released by the watchdog).
        let _ = unsafe { result::stream::synchronize(streams[0]) };
        wait_async_error(comm, Duration::from_secs(10))
    } else {
        r
    };
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error for mismatched calls");
    eprintln!("rank {rank}: error {e:?}: {}", last_error(comm));
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn mismatched_direct_all_reduces_fail_with_invalid_usage() {
    if let Some((rank, n, id)) = common::child_role() {
        mismatched_rank(rank, n, &id);
        return;
    }
    let res = run("mismatched_direct_all_reduces_fail_with_invalid_usage", 2, &[]);
    common::assert_all_ok(&res);
    // One rank finds the mismatch (the other may first hear of its peer's failure).
    let found = res.iter().any(|(_, err)| err.contains("ncclInvalidUsage: ") && err.contains("collective mismatch"));
    assert!(found, "no rank reported ncclInvalidUsage for the mismatch:\n{}\n{}", res[0].1, res[1].1);
}
