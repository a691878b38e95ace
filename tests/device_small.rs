//! Small device all-reduces on the CUDA stand-in (or the real driver, `OXCCL_DEVICE_TESTS_REAL=1`):
//! what one call costs in stream operations and driver queries, counted by the stand-in at
//! enqueue (`oxccl_standin_count`), and that the results stay exact.
//!
//! Covered: an 8-byte all-reduce of every type × operator issues at most 5 stream operations
//! per rank and no `cuPointerGetAttribute`, with ranks in two processes sharing one GPU (where
//! `OXCCL_SMALL_KERNEL=1` is refused with a WARN: the LL kernel never runs on a shared GPU) and
//! with ranks as threads of one process; a change of stream costs at most one ordering
//! operation more; every result checked against the f64 reference.
//!
//! The LL flow (`OXCCL_SMALL_KERNEL=1`, one kernel per call, `src/device/small.rs`), with a GPU
//! per rank, as two processes and as two threads of one process, and with two threads of one
//! process sharing a GPU under `OXCCL_SMALL_KERNEL=2`: every type × operator at
//! sizes from one element to the LL limit, in and out of place, at byte offsets that leave the
//! buffers unaligned; each call at most 2 stream operations (the kernel, the done/ticket write);
//! then 200 calls back to back on alternating streams before one synchronisation (the flags'
//! sequence and the slots' parity), every result checked against the f64 reference. And an LL
//! kernel whose peer process left ends (the stream drains) once the watchdog fails the call. The call's time in units of one
//! minimal stream operation is printed (a figure, not asserted: speed is not a unit test's
//! business). And the cached classification of device buffers follows frees and reuse: a range
//! freed on one GPU and reallocated on another, or reallocated as pinned host memory, or freed
//! through `ncclMemFree`.

mod common;

use common::allreduce::{reference, unsigned};
use common::standin::{as_threads, join, real_driver, standin_counts, standin_env, upload, DevMem};
use cudarc::driver::{result, sys};
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::{Duration, Instant};

/// Most stream operations one 8-byte all-reduce may issue per rank.
const MAX_OPS: u64 = 5;
/// Bytes of the one allocation the test buffers are pieces of.
const ARENA: usize = 4096;

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

/// One counted 8-byte all-reduce in place at `buf` (already holding this rank's input):
/// returns (stream operations, pointer attribute queries) it issued, both 0 on the real driver.
fn counted_call(comm: ncclComm_t, buf: u64, t: DataType, op: ReduceOp, stream: sys::CUstream) -> (u64, u64) {
    let before = standin_counts().unwrap_or((0, 0));
    let count = 8 / t.size();
    let r = ncclAllReduce(buf as *const _, buf as *mut _, count, t as i32, op as i32, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    let after = standin_counts().unwrap_or((0, 0));
    (after.0 - before.0, after.1 - before.1)
}

/// Every type × operator as an 8-byte all-reduce on `streams[0]`, each counted, then checked;
/// then a change of stream. The buffers are 8-byte pieces of `arena` (one allocation, as a
/// caching allocator hands them out), which an earlier call has used: its classification is
/// cached. `tag` names the rank in messages.
fn every_case_counted(comm: ncclComm_t, rank: usize, n: usize, streams: &[sys::CUstream], arena: &DevMem, tag: &str) {
    let mut piece = 0u64;
    let mut next = || {
        piece += 16;
        arena.0 + piece
    };
    let mut live = Vec::new();
    let mut seed = 0;
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            seed += 1;
            let data = input(t, op, rank, 8 / t.size(), seed);
            let buf = next();
            upload(buf, &data, streams[0]);
            let (ops, attrs) = counted_call(comm, buf, t, op, streams[0]);
            let what = format!("{tag}: 8-byte {} {}", t.name(), op.name());
            assert!(ops <= MAX_OPS, "{what}: {ops} stream operations (at most {MAX_OPS})");
            assert_eq!(attrs, 0, "{what}: {attrs} cuPointerGetAttribute calls");
            live.push((t, op, seed, buf, what));
        }
    }
    // Another stream: one ordering operation more at most, then none again.
    let mut switched = Vec::new();
    for (k, &s) in [streams[1], streams[1], streams[0]].iter().enumerate() {
        seed += 1;
        let data = input(DataType::Float32, ReduceOp::Sum, rank, 2, seed);
        let buf = next();
        upload(buf, &data, s);
        let (ops, _) = counted_call(comm, buf, DataType::Float32, ReduceOp::Sum, s);
        let limit = if k == 1 { MAX_OPS } else { MAX_OPS + 1 };
        assert!(ops <= limit, "{tag}: call {k} after a change of stream: {ops} stream operations (at most {limit})");
        switched.push((DataType::Float32, ReduceOp::Sum, seed, buf, format!("{tag}: switched stream, call {k}")));
    }
    for &s in streams {
        // SAFETY: live streams of the current context.
        unsafe { result::stream::synchronize(s) }.expect("cuStreamSynchronize");
    }
    for (t, op, seed, buf, what) in live.iter().chain(&switched) {
        let mut got = vec![0u8; 8];
        // SAFETY: `buf` is 8 bytes inside the arena; the streams are synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut got, *buf) }.unwrap();
        check(*t, *op, n, *seed, &got, what);
    }
}

/// One 8-byte all-reduce at the start of `arena` that sets the device state up (collective)
/// and is checked.
fn warm_up(comm: ncclComm_t, rank: usize, n: usize, stream: sys::CUstream, arena: &DevMem) {
    let data = input(DataType::Float32, ReduceOp::Sum, rank, 2, 999);
    upload(arena.0, &data, stream);
    counted_call(comm, arena.0, DataType::Float32, ReduceOp::Sum, stream);
    // SAFETY: a live stream.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    let mut got = vec![0u8; 8];
    // SAFETY: as above.
    unsafe { result::memcpy_dtoh_sync(&mut got, arena.0) }.unwrap();
    check(DataType::Float32, ReduceOp::Sum, n, 999, &got, "warm-up");
}

/// Round-trip time (enqueue, then synchronise the stream) of an 8-byte all-reduce and of one
/// minimal stream operation (a 32-bit stream write), each the median of `K` tries: printed by
/// rank 0, with their ratio.
fn timing(comm: ncclComm_t, rank: usize, stream: sys::CUstream, arena: &DevMem) {
    const K: usize = 101;
    let buf = arena.0;
    upload(buf, &[0u8; 8], stream);
    let sync = || {
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(stream) }.unwrap()
    };
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let calls: Vec<Duration> = (0..K)
        .map(|_| {
            let t = Instant::now();
            let r = ncclAllReduce(buf as *const _, buf as *mut _, 2, DataType::Float32 as i32, 0, comm, stream.cast());
            assert_eq!(r, ncclResult_t::ncclSuccess);
            sync();
            t.elapsed()
        })
        .collect();
    let word = DevMem::new(8);
    let ops: Vec<Duration> = (0..K)
        .map(|i| {
            let t = Instant::now();
            // SAFETY: `word` is a device allocation of 8 bytes (4-byte aligned).
            let r = unsafe { sys::cuStreamWriteValue32_v2(stream, word.0, i as u32, 0) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
            sync();
            t.elapsed()
        })
        .collect();
    let (call, op) = (median(calls), median(ops));
    if rank == 0 {
        let ratio = call.as_secs_f64() / op.as_secs_f64().max(1e-9);
        eprintln!("8 B all-reduce: {call:?} per call = {ratio:.1} minimal stream operations ({op:?} each), medians of {K} round trips");
    }
}

fn counted_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let arena = DevMem::new(ARENA);
    warm_up(comm, rank, n, streams[0], &arena);
    every_case_counted(comm, rank, n, &streams, &arena, &format!("rank {rank} of {n} processes"));
    timing(comm, rank, streams[0], &arena);
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

fn run(entry: &str, n: usize, extra: &[(&'static str, String)]) -> Vec<(bool, String)> {
    let mut env = standin_env();
    env.extend_from_slice(extra);
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_TIMEOUT_MS", "30000".into()));
    common::run_ranks(entry, n, &env, Duration::from_secs(180))
}

fn show(res: &[(bool, String)]) {
    use std::io::Write;
    for l in res.iter().flat_map(|(_, e)| e.lines()).filter(|l| l.contains("minimal stream operations")) {
        let _ = writeln!(std::io::stderr().lock(), "{l}");
    }
}

#[test]
fn an_8_byte_all_reduce_issues_at_most_5_stream_operations_per_rank_between_processes() {
    if let Some((rank, n, id)) = common::child_role() {
        counted_rank(rank, n, &id);
        return;
    }
    // The LL kernel asked for, on one GPU shared by two processes: refused, the 5-operation flow.
    let small = [("OXCCL_SMALL_KERNEL", "1".to_string())];
    let res = run("an_8_byte_all_reduce_issues_at_most_5_stream_operations_per_rank_between_processes", 2, &small);
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        assert!(err.contains("device collectives through CUDA IPC"), "rank {i}: not on CUDA IPC:\n{err}");
        assert!(err.contains("one-shot"), "rank {i}: no INFO line naming the small flow:\n{err}");
        assert!(!err.contains("LL kernel launch"), "rank {i}: the LL flow on a shared GPU:\n{err}");
        if !real_driver() {
            // Two processes on one simulated GPU, no MPS daemon: the set-up says what that costs.
            assert!(err.contains("no MPS daemon is seen"), "rank {i}: no WARN about time slicing:\n{err}");
            let why = "OXCCL_SMALL_KERNEL=1 ignored, small all-reduces take five stream operations: ranks 0 and 1 use one GPU";
            assert_eq!(err.matches(why).count(), 1, "rank {i}: one WARN naming why:\n{err}");
        }
    }
    show(&res);
}

/// Largest all-reduce of the LL flow (`SMALL_KERNEL_BYTES` in src/device/small.rs).
const LL_BYTES: usize = 8 << 10;
/// Most stream operations of one LL all-reduce: the kernel and the done/ticket write.
const LL_OPS: u64 = 2;

/// Element counts of the LL cases of type `t`: one element, sizes around a line (8 bytes) and
/// a warp's lines, and the limit.
fn ll_counts(t: DataType) -> Vec<usize> {
    let es = t.size();
    let mut v = vec![1, 8 / es + 1, 3 * 8 / es - 1, 33 * 8 / es + 1, LL_BYTES / es];
    v.dedup();
    v
}

/// One LL all-reduce of `count` elements of `t` from `send` into `recv` (equal: in place) on
/// `stream`, counted: returns the stream operations it issued (`None` without the stand-in's
/// counters or when `counted` is false).
#[allow(clippy::too_many_arguments)]
fn ll_call(
    comm: ncclComm_t,
    send: u64,
    recv: u64,
    count: usize,
    t: DataType,
    op: ReduceOp,
    stream: sys::CUstream,
    counted: bool,
) -> Option<u64> {
    let before = standin_counts().filter(|_| counted);
    let r = ncclAllReduce(send as *const _, recv as *mut _, count, t as i32, op as i32, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    Some(standin_counts()?.0 - before?.0)
}

/// Every LL case of one rank (a GPU of its own, `streams` of its context): every type ×
/// operator × size of [`ll_counts`], alternately in and out of place, the buffers 1..7 bytes
/// (whole elements) past 8-byte boundaries; each call at most [`LL_OPS`] stream operations
/// when `counted`, each result checked. Then 200 f32 and i8 calls back to back on alternating
/// streams, checked after one synchronisation.
fn ll_cases(comm: ncclComm_t, rank: usize, n: usize, streams: &[sys::CUstream], tag: &str, counted: bool) {
    let span = LL_BYTES + 64;
    let arena = DevMem::new(2 * span);
    warm_up(comm, rank, n, streams[0], &arena);
    let mut seed = 1000;
    let mut k = 0usize;
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            for count in ll_counts(t) {
                seed += 1;
                k += 1;
                let es = t.size();
                let shift = (k % 8) / es * es;
                let send = arena.0 + shift as u64;
                let recv = if k % 2 == 0 { send } else { arena.0 + (span + 8 - shift) as u64 };
                let what = format!(
                    "{tag}: LL {} {} of {count} (send +{shift}, in place {})",
                    t.name(),
                    op.name(),
                    send == recv
                );
                upload(send, &input(t, op, rank, count, seed), streams[0]);
                let ops = ll_call(comm, send, recv, count, t, op, streams[0], counted);
                if let Some(ops) = ops {
                    assert!(ops <= LL_OPS, "{what}: {ops} stream operations (at most {LL_OPS})");
                }
                // SAFETY: a live stream of the current context.
                unsafe { result::stream::synchronize(streams[0]) }.unwrap();
                let mut got = vec![0u8; count * es];
                // SAFETY: `recv` holds count elements inside the arena; the stream is synchronised.
                unsafe { result::memcpy_dtoh_sync(&mut got, recv) }.unwrap();
                check(t, op, n, seed, &got, &what);
            }
        }
    }
    // Back to back: 200 calls, each on its own 8-byte piece, alternating streams (the second
    // call on a new stream is ordered after the first by the library), one synchronisation.
    let mut live = Vec::new();
    for c in 0..200usize {
        seed += 1;
        let t = if c % 3 == 0 { DataType::Int8 } else { DataType::Float32 };
        let count = 8 / t.size();
        let at = arena.0 + 8 * c as u64;
        upload(at, &input(t, ReduceOp::Sum, rank, count, seed), streams[c % 2]);
        live.push((t, seed, at));
    }
    for (c, &(t, _, at)) in live.iter().enumerate() {
        ll_call(comm, at, at, 8 / t.size(), t, ReduceOp::Sum, streams[(c / 7) % 2], false);
    }
    for &s in streams {
        // SAFETY: live streams of the current context.
        unsafe { result::stream::synchronize(s) }.unwrap();
    }
    for (c, &(t, seed, at)) in live.iter().enumerate() {
        let mut got = vec![0u8; 8];
        // SAFETY: 8 bytes inside the arena; the streams are synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut got, at) }.unwrap();
        check(t, ReduceOp::Sum, n, seed, &got, &format!("{tag}: back-to-back call {c}"));
    }
}

/// The stand-in with a simulated GPU per rank.
fn gpu_each(n: usize) -> Vec<(&'static str, String)> {
    vec![("OXCCL_SMALL_KERNEL", "1".to_string()), ("OXCCL_STANDIN_DEVICES", n.to_string())]
}

#[test]
fn the_ll_kernel_is_exact_for_every_type_and_op_between_processes_with_a_gpu_each() {
    if let Some((rank, n, id)) = common::child_role() {
        let (comm, streams, ctx) = join(rank, n, &id);
        drop(ctx);
        let _ctx = oxccl::device::gpu(rank as i32).unwrap().enter().unwrap();
        let streams: Vec<sys::CUstream> =
            streams.iter().map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect();
        ll_cases(comm, rank, n, &streams, &format!("rank {rank} of {n} processes"), true);
        assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
        return;
    }
    if real_driver() && oxccl::device::device_count() < 2 {
        eprintln!("SKIPPED: the LL flow needs a GPU per rank (2 GPUs)");
        return;
    }
    let res = run("the_ll_kernel_is_exact_for_every_type_and_op_between_processes_with_a_gpu_each", 2, &gpu_each(2));
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        assert!(err.contains("in one LL kernel launch (OXCCL_SMALL_KERNEL=1)"), "rank {i}: not on the LL flow:\n{err}");
        assert!(!err.contains("OXCCL_SMALL_KERNEL=1 ignored"), "rank {i}:\n{err}");
    }
}

/// A peer that leaves after the first call: rank 0's next LL kernel spins until its watchdog
/// finds the peer dead (or the call overdue), fails the communicator and sets this rank's abort
/// word, which the kernel's waits look at (no peer is left to write it); the kernel then ends,
/// the stream drains and the error is reported.
fn ll_peer_leaves(rank: usize, n: usize, id: &str) {
    let (comm, streams, ctx) = join(rank, n, id);
    drop(ctx);
    let _ctx = oxccl::device::gpu(rank as i32).unwrap().enter().unwrap();
    drop(streams);
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let arena = DevMem::new(64);
    warm_up(comm, rank, n, stream, &arena);
    if rank == 1 {
        // Gone without a teardown or a second call.
        std::process::exit(0);
    }
    let r = ncclAllReduce(arena.0 as *const _, arena.0 as *mut _, 2, 7, 0, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess, "the LL call enqueues without waiting for the peer");
    let e = common::standin::wait_async_error(comm, Duration::from_secs(30));
    assert_ne!(e, ncclResult_t::ncclSuccess, "no error after the peer left");
    // The kernel gave up: the stream drains.
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.expect("the stream drains after the failure");
    eprintln!("LL kernel released: async error {e:?}");
    std::process::exit(0);
}

#[test]
fn an_ll_kernel_whose_peer_left_ends_when_the_watchdog_fails_the_call() {
    if let Some((rank, n, id)) = common::child_role() {
        ll_peer_leaves(rank, n, &id);
        return;
    }
    if real_driver() && oxccl::device::device_count() < 2 {
        eprintln!("SKIPPED: the LL flow needs a GPU per rank (2 GPUs)");
        return;
    }
    let mut env = standin_env();
    env.extend(gpu_each(2));
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_TIMEOUT_MS", "1500".into()));
    let entry = "an_ll_kernel_whose_peer_left_ends_when_the_watchdog_fails_the_call";
    let res = common::run_ranks(entry, 2, &env, Duration::from_secs(90));
    common::assert_all_ok(&res);
    assert!(res[0].1.contains("LL kernel released"), "rank 0:\n{}", res[0].1);
    assert!(res[0].1.contains("in one LL kernel launch"), "rank 0 not on the LL flow:\n{}", res[0].1);
}

/// Two ranks as threads of one process (`ncclCommInitAll` on `devs`), each on its GPU with two
/// streams of its own: every LL case.
fn threads_ll(devs: &[i32]) {
    let n = devs.len();
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let r = oxccl::ffi::config::ncclCommInitAll(comms.as_mut_ptr(), n as i32, devs.as_ptr());
    assert_eq!(r, ncclResult_t::ncclSuccess);
    std::thread::scope(|s| {
        for (rank, &comm) in comms.iter().enumerate() {
            let (comm, dev) = (comm as usize, devs[rank]);
            s.spawn(move || {
                let _ctx = oxccl::device::gpu(dev).unwrap().enter().unwrap();
                let streams: Vec<sys::CUstream> =
                    (0..2).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect();
                ll_cases(comm as ncclComm_t, rank, n, &streams, &format!("thread rank {rank} on GPU {dev}"), false);
                for s in streams {
                    // SAFETY: synchronised by `ll_cases`; destroyed once.
                    unsafe { result::stream::destroy(s) }.unwrap();
                }
            });
        }
    });
    for c in comms {
        assert_eq!(ncclCommDestroy(c), ncclResult_t::ncclSuccess);
    }
}

#[test]
fn the_ll_kernel_is_exact_for_every_type_and_op_between_threads_with_a_gpu_each() {
    if common::child_role().is_some() {
        threads_ll(&[0, 1]);
        return;
    }
    if real_driver() && oxccl::device::device_count() < 2 {
        eprintln!("SKIPPED: the LL flow needs a GPU per rank (2 GPUs)");
        return;
    }
    let res = run("the_ll_kernel_is_exact_for_every_type_and_op_between_threads_with_a_gpu_each", 1, &gpu_each(2));
    common::assert_all_ok(&res);
    assert_eq!(res[0].1.matches("in one LL kernel launch (OXCCL_SMALL_KERNEL=1)").count(), 2, "{}", res[0].1);
}

/// Ranks of one process sharing a GPU take the LL flow only with `OXCCL_SMALL_KERNEL=2` (each
/// rank on streams of its own: the stand-in gives every stream its own worker, as the driver
/// gives streams their own hardware queues up to `CUDA_DEVICE_MAX_CONNECTIONS`).
#[test]
fn the_ll_kernel_is_exact_between_threads_sharing_a_gpu_with_small_kernel_2() {
    if common::child_role().is_some() {
        threads_ll(&[0, 0]);
        return;
    }
    let env = [("OXCCL_SMALL_KERNEL", "2".to_string())];
    let res = run("the_ll_kernel_is_exact_between_threads_sharing_a_gpu_with_small_kernel_2", 1, &env);
    common::assert_all_ok(&res);
    assert_eq!(res[0].1.matches("in one LL kernel launch (OXCCL_SMALL_KERNEL=2)").count(), 2, "{}", res[0].1);
}

/// Two ranks as threads of one process (`ncclCommInitAll`), one GPU.
fn threads_child() {
    let n = 2;
    let barrier = std::sync::Barrier::new(n);
    let totals = std::sync::Mutex::new(Vec::new());
    as_threads(n, |rank, comm, stream| {
        let arena = DevMem::new(ARENA);
        warm_up(comm, rank, n, stream, &arena);
        for round in 0..10 {
            let seed = 100 + round;
            let buf = arena.0 + 16 * (round as u64 + 1);
            let data = input(DataType::Float32, ReduceOp::Sum, rank, 2, seed);
            upload(buf, &data, stream);
            barrier.wait();
            let before = standin_counts().unwrap_or((0, 0));
            barrier.wait();
            let r = ncclAllReduce(buf as *const _, buf as *mut _, 2, 7, 0, comm, stream.cast());
            assert_eq!(r, ncclResult_t::ncclSuccess);
            barrier.wait();
            let after = standin_counts().unwrap_or((0, 0));
            barrier.wait();
            if rank == 0 {
                totals.lock().unwrap().push((after.0 - before.0, after.1 - before.1));
            }
            // SAFETY: a live stream.
            unsafe { result::stream::synchronize(stream) }.unwrap();
            let mut got = vec![0u8; 8];
            // SAFETY: as above.
            unsafe { result::memcpy_dtoh_sync(&mut got, buf) }.unwrap();
            check(DataType::Float32, ReduceOp::Sum, n, seed, &got, &format!("thread rank {rank}, round {round}"));
        }
    });
    for (round, &(ops, attrs)) in totals.lock().unwrap().iter().enumerate() {
        // Both ranks' calls were counted together.
        assert!(ops <= MAX_OPS * n as u64, "round {round}: {ops} stream operations for {n} ranks");
        assert_eq!(attrs, 0, "round {round}: {attrs} cuPointerGetAttribute calls");
    }
}

#[test]
fn an_8_byte_all_reduce_issues_at_most_5_stream_operations_per_rank_between_threads() {
    if common::child_role().is_some() {
        threads_child();
        return;
    }
    let res = run("an_8_byte_all_reduce_issues_at_most_5_stream_operations_per_rank_between_threads", 1, &[]);
    common::assert_all_ok(&res);
    assert!(!res[0].1.contains("no MPS daemon"), "threads of one process need no MPS:\n{}", res[0].1);
}

/// Allocates `len` bytes with `alloc` until it returns `at` (the allocator reusing a freed
/// range); the misses are freed with `free` afterwards. `None` when it never does.
fn alloc_at(at: u64, alloc: impl Fn() -> u64, free: impl Fn(u64)) -> Option<u64> {
    let mut misses = Vec::new();
    let mut hit = None;
    for _ in 0..16 {
        let p = alloc();
        if p == at {
            hit = Some(p);
            break;
        }
        misses.push(p);
    }
    misses.into_iter().for_each(free);
    hit
}

fn cache_child() {
    use oxccl::device::{classifications_cached as cached, route, Target};
    let (g0, g1) = (oxccl::device::gpu(0).unwrap(), oxccl::device::gpu(1).unwrap());
    let null = std::ptr::null_mut();
    let as_ptr = |p: u64| p as *const std::ffi::c_void;
    let _c0 = g0.enter().unwrap();
    let malloc = || unsafe { result::malloc_sync(1 << 16) }.unwrap();
    let free = |p: u64| unsafe { result::free_sync(p) }.unwrap();
    let a = malloc();
    assert_eq!(route(as_ptr(a + 64), as_ptr(a), null).unwrap(), Target::Device { ordinal: 0 });
    assert!(cached() >= 1, "the allocation's classification is cached");
    free(a);
    {
        // Freed on GPU 0, reallocated at the same range on GPU 1 (its context current).
        let _c1 = g1.enter().unwrap();
        let Some(b) = alloc_at(a, malloc, free) else {
            common::skipped("the stand-in did not reuse the freed range");
            return;
        };
        assert_eq!(route(as_ptr(b), as_ptr(b), null).unwrap(), Target::Device { ordinal: 1 });
        free(b);
    }
    // Reallocated as pinned host memory: host.
    let host_alloc = || {
        let mut p = std::ptr::null_mut();
        // SAFETY: writes the allocation's address.
        assert_eq!(unsafe { sys::cuMemHostAlloc(&mut p, 1 << 16, 0) }, sys::CUresult::CUDA_SUCCESS);
        p as u64
    };
    // SAFETY: allocated by cuMemHostAlloc.
    let host_free = |p: u64| assert_eq!(unsafe { sys::cuMemFreeHost(p as *mut _) }, sys::CUresult::CUDA_SUCCESS);
    match alloc_at(a, host_alloc, host_free) {
        Some(h) => {
            assert_eq!(route(as_ptr(h), as_ptr(h), null).unwrap(), Target::Host);
            host_free(h);
        }
        None => common::skipped("the stand-in did not reuse the freed range for pinned host memory"),
    }
    // ncclMemFree forgets the range.
    let mut p = std::ptr::null_mut();
    assert_eq!(oxccl::ffi::extra::ncclMemAlloc(&mut p, 4096), ncclResult_t::ncclSuccess);
    assert_eq!(route(p, p, null).unwrap(), Target::Device { ordinal: 0 });
    let held = cached();
    assert_eq!(oxccl::ffi::extra::ncclMemFree(p), ncclResult_t::ncclSuccess);
    assert_eq!(cached(), held - 1, "ncclMemFree drops the cached classification");
}

#[test]
fn the_cached_classification_follows_frees_and_reuse() {
    if real_driver() {
        common::skipped("address reuse is arranged on the CUDA stand-in");
        return;
    }
    if common::child_role().is_some() {
        cache_child();
        return;
    }
    let res = run("the_cached_classification_follows_frees_and_reuse", 1, &[("OXCCL_STANDIN_DEVICES", "2".into())]);
    common::assert_all_ok(&res);
    if let Some(l) = res[0].1.lines().find(|l| l.contains("SKIPPED")) {
        common::skipped(l);
    }
}
