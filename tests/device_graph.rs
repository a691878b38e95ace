//! Device all-reduces captured into a CUDA graph and replayed, on the CUDA stand-in (or the real
//! driver, `OXCCL_DEVICE_TESTS_REAL=1`).
//!
//! Covered: 2 ranks as processes capture 10 all-reduces (small, staged and direct flows; several
//! types and operators; in and out of place) into one graph on a non-blocking stream in global
//! capture mode, after running the same calls once uncaptured (as frameworks warm up before
//! capturing). Capturing enqueues nothing (the stand-in's count of stream operations does not
//! move). The graph then replays 100 times, new inputs uploaded before each replay, and every
//! output of every replay is checked against the f64 reference. Then the same 10 calls on
//! buffers never seen before (allocated after the warm-up) are captured in each capture mode
//! (global, thread-local, relaxed; the stand-in refuses, and invalidates the capture on, any
//! call the mode forbids) and replayed 3 times with new inputs, exact.
//!
//! Communicators whose first device call is captured (split from the first; the device state is
//! set up during the capture): the 10 calls in each mode (replayed 3 times exact, then run
//! uncaptured, exact), and on a blocking stream (replayed 3 times exact). A captured group of 3
//! all-reduces (direct, staged and small flows; f16 and f32) as a communicator's first device
//! calls, on one stream, then on two
//! (the middle call on a stream forked into the capture and joined back by events), replayed 3
//! times exact. A captured group (a communicator's first device calls) of a broadcast, an
//! all-gather (on the forked stream), a reduce-scatter and an all-reduce on the one-shot flows,
//! replayed 3 times exact. Refused with `ncclInvalidUsage`, the communicator staying usable: a
//! captured group holding a send, and one whose second stream is not capturing. A communicator
//! of one rank captures its first call and a two-stream group (copies), replayed exactly.
//!
//! Ranks that are threads of one process (one communicator each, the threads capturing at the
//! same time) capture the 10 calls in each mode (the first graph holds the communicators' first
//! device calls, the others are on fresh buffers), and replay each graph 9 times concurrently,
//! exact; their uncaptured calls after are exact.

mod common;

use common::allreduce::{reference, unsigned};
use common::standin::{as_threads, join, standin_count, standin_env, upload, DevMem};
use cudarc::driver::{result, sys};
use oxccl::algo::select::IPC_DIRECT_MIN;
use oxccl::ffi::group::{ncclGroupEnd, ncclGroupStart};
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

/// Replays of the graph.
const REPLAYS: usize = 100;
/// Replays of each graph captured on fresh buffers.
const FRESH_REPLAYS: usize = 3;

/// One captured call: type, operator, elements, in place.
struct Case {
    t: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    send: u64,
    recv: u64,
}

fn cases(arena: &DevMem) -> Vec<Case> {
    let direct = IPC_DIRECT_MIN + 4096;
    let shapes: [(DataType, ReduceOp, usize, bool); 10] = [
        (DataType::Float32, ReduceOp::Sum, 2, false),
        (DataType::Float32, ReduceOp::Sum, 2, true),
        (DataType::Int32, ReduceOp::Max, 1000, false),
        (DataType::Bfloat16, ReduceOp::Sum, 2048, true),
        (DataType::Float64, ReduceOp::Min, 64, false),
        (DataType::Float32, ReduceOp::Avg, 40 << 10, false),
        (DataType::Float32, ReduceOp::Sum, direct / 4, false),
        (DataType::Float32, ReduceOp::Prod, 5, true),
        (DataType::Float16, ReduceOp::Sum, direct / 2, true),
        (DataType::Uint8, ReduceOp::Sum, 333, false),
    ];
    let mut at = arena.0 + 256;
    shapes
        .iter()
        .map(|&(t, op, count, in_place)| {
            let bytes = (count * t.size()).next_multiple_of(256) as u64;
            let send = at;
            let recv = if in_place { send } else { send + bytes };
            at = recv + bytes;
            Case { t, op, count, in_place, send, recv }
        })
        .collect()
}

fn input(c: &Case, rank: usize, seed: usize) -> Vec<u8> {
    let vals: Vec<f64> =
        (0..c.count).map(|i| common::input(rank, i, seed, unsigned(c.t), c.op == ReduceOp::Prod)).collect();
    let mut out = vec![0u8; c.count * c.t.size()];
    oxccl::reduce::from_f64(c.t, &vals, &mut out);
    out
}

fn enqueue(comm: ncclComm_t, c: &Case, stream: sys::CUstream) -> ncclResult_t {
    ncclAllReduce(c.send as *const _, c.recv as *mut _, c.count, c.t as i32, c.op as i32, comm, stream.cast())
}

/// Uploads every case's input for `seed`, runs `go`, and checks every output.
fn round(cases: &[Case], rank: usize, n: usize, seed: usize, stream: sys::CUstream, go: impl FnOnce()) {
    for c in cases {
        upload(c.send, &input(c, rank, seed), stream);
    }
    go();
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    for (k, c) in cases.iter().enumerate() {
        let mut got = vec![0u8; c.count * c.t.size()];
        // SAFETY: `recv` holds `count` elements; the stream is synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut got, c.recv) }.unwrap();
        for (i, g) in oxccl::reduce::to_f64(c.t, &got).iter().enumerate() {
            let (want, tol) = reference(c.t, c.op, n, i, seed);
            assert!(
                (g - want).abs() <= tol,
                "rank {rank}, seed {seed}, call {k} ({} {} x{}, in place {}): element {i} is {g}, want {want}",
                c.t.name(),
                c.op.name(),
                c.count,
                c.in_place
            );
        }
    }
}

fn rank_main(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let stream = streams[0];
    let arena = DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20));
    let cases = cases(&arena);
    // Warm-up, uncaptured: sets the device state up and maps the buffers.
    round(&cases, rank, n, 1, stream, || {
        for c in &cases {
            assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess);
        }
    });
    let exec = capture(comm, &cases, stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL);
    for rep in 0..REPLAYS {
        // SAFETY: an instantiated graph and a live stream.
        round(&cases, rank, n, 100 + rep, stream, || {
            assert_eq!(unsafe { sys::cuGraphLaunch(exec, stream) }, sys::CUresult::CUDA_SUCCESS, "replay {rep}");
        });
    }
    // SAFETY: no launch of it is pending (the stream was synchronised).
    assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, sys::CUresult::CUDA_SUCCESS);
    // Buffers never seen before (allocated after the warm-up, not run uncaptured), in each
    // capture mode: the captured calls map the peers' buffers without a forbidden call.
    let modes = [
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    ];
    let mut arenas = Vec::new();
    for (m, mode) in modes.into_iter().enumerate() {
        let fresh = DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20));
        let fresh_cases = crate::cases(&fresh);
        let exec = capture(comm, &fresh_cases, stream, mode);
        for rep in 0..FRESH_REPLAYS {
            // SAFETY: an instantiated graph and a live stream.
            round(&fresh_cases, rank, n, 1000 * (m + 1) + rep, stream, || {
                assert_eq!(unsafe { sys::cuGraphLaunch(exec, stream) }, sys::CUresult::CUDA_SUCCESS, "{mode:?} {rep}");
            });
        }
        // SAFETY: no launch of it is pending (the stream was synchronised).
        assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, sys::CUresult::CUDA_SUCCESS);
        arenas.push(fresh);
    }
    round(&cases, rank, n, 999, stream, || {
        for c in &cases {
            assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess);
        }
    });
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
    drop(arenas);
}

/// Captures every case's all-reduce on `stream` in `mode`, runs `ended`, and instantiates the
/// graph; the capture must not be invalidated and, when `quiet` (the device state was set up
/// before, and no other thread sets one up meanwhile), must enqueue nothing.
fn capture_then(
    comm: ncclComm_t,
    cases: &[Case],
    stream: sys::CUstream,
    mode: sys::CUstreamCaptureMode,
    quiet: bool,
    ended: impl FnOnce(),
) -> sys::CUgraphExec {
    let before = standin_count(100);
    let exec = capture_calls(stream, &[], mode, || {
        for c in cases {
            assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess, "captured call ({mode:?})");
        }
    });
    if quiet {
        assert_eq!(standin_count(100), before, "capturing enqueued stream operations");
    }
    ended();
    exec
}

/// Begins a capture on `stream` in `mode`, forks each of `forked` into it (an event recorded on
/// `stream`, waited for by the forked stream), runs `calls`, joins each forked stream back,
/// ends the capture (which must be valid) and instantiates the graph.
fn capture_calls(
    stream: sys::CUstream,
    forked: &[sys::CUstream],
    mode: sys::CUstreamCaptureMode,
    calls: impl FnOnce(),
) -> sys::CUgraphExec {
    use sys::CUresult::CUDA_SUCCESS as OK;
    // SAFETY (this block): live non-blocking streams of the current context; the event and the
    // graph handles are used only here.
    unsafe {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        assert_eq!(sys::cuStreamBeginCapture_v2(stream, mode), OK);
        for &f in forked {
            assert_eq!(sys::cuEventRecord(ev, stream), OK, "fork");
            assert_eq!(sys::cuStreamWaitEvent(f, ev, 0), OK, "fork");
        }
        calls();
        for &f in forked {
            assert_eq!(sys::cuEventRecord(ev, f), OK, "join");
            assert_eq!(sys::cuStreamWaitEvent(stream, ev, 0), OK, "join");
        }
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        assert_eq!(sys::cuStreamEndCapture(stream, &mut graph), OK, "{mode:?}");
        assert_eq!(sys::cuEventDestroy_v2(ev), OK);
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        assert_eq!(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), OK);
        assert_eq!(sys::cuGraphDestroy(graph), OK);
        exec
    }
}

/// [`capture_then`] with nothing between the capture's end and the instantiation.
fn capture(
    comm: ncclComm_t,
    cases: &[Case],
    stream: sys::CUstream,
    mode: sys::CUstreamCaptureMode,
) -> sys::CUgraphExec {
    capture_then(comm, cases, stream, mode, true, || {})
}

/// Replays `exec` on `stream` `replays` times (seeds from `seed`), each checked as [`round`].
fn replay(
    exec: sys::CUgraphExec,
    cases: &[Case],
    rank: usize,
    n: usize,
    seed: usize,
    replays: usize,
    stream: sys::CUstream,
) {
    for rep in 0..replays {
        round(cases, rank, n, seed + rep, stream, || {
            // SAFETY: an instantiated graph and a live stream.
            let r = unsafe { sys::cuGraphLaunch(exec, stream) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "rank {rank}: replay {rep}");
        });
    }
    // SAFETY: no launch of it is pending (`round` synchronised the stream).
    assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, sys::CUresult::CUDA_SUCCESS);
}

/// A communicator split from `comm` (every rank the same `color`, or one each): no device
/// call has run on it.
fn split(comm: ncclComm_t, color: i32, key: usize) -> ncclComm_t {
    let mut child: ncclComm_t = std::ptr::null_mut();
    let r = oxccl::ffi::config::ncclCommSplit(comm, color, key as i32, &mut child, std::ptr::null_mut());
    assert_eq!(r, ncclResult_t::ncclSuccess, "ncclCommSplit");
    child
}

/// The three cases of the captured groups, in this order: f16 sum in place past
/// `IPC_DIRECT_MIN` (the direct flow), f32 avg of 160 KiB (staged), f32 sum of 8 B out of
/// place (small).
fn group_cases(arena: &DevMem) -> Vec<Case> {
    let mut all = cases(arena);
    [8, 5, 0].into_iter().map(|k| all.swap_remove(k)).collect()
}

/// Elements per rank of the captured broadcast, all-gather and reduce-scatter.
const COLL: usize = 1000;

/// Input element `i` of `rank` for `seed`: small integers, exact in f32 and in any sum here.
fn val(rank: usize, i: usize, seed: usize) -> f32 {
    ((rank * 7 + i * 3 + seed) % 1000) as f32
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A captured group (the communicator's first device calls) of a broadcast from rank 1, an
/// all-gather, a reduce-scatter (sum) and an all-reduce (sum) of f32 on the one-shot flows,
/// the all-gather on the forked stream `s1`; replayed 3 times, each output exact.
fn other_collectives(comm: ncclComm_t, rank: usize, n: usize, s0: sys::CUstream, s1: sys::CUstream) {
    use oxccl::ffi::coll::{ncclAllGather, ncclBroadcast, ncclReduceScatter};
    let f32t = DataType::Float32 as i32;
    let sum = ReduceOp::Sum as i32;
    let buf = |elems: usize| DevMem::new(elems * 4);
    let (bs, br, gs, gr, rs, rr, as_, ar) =
        (buf(COLL), buf(COLL), buf(COLL), buf(n * COLL), buf(n * COLL), buf(COLL), buf(COLL), buf(COLL));
    let global = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let exec = capture_calls(s0, &[s1], global, || {
        let p = |m: &DevMem| m.0 as *mut std::ffi::c_void;
        assert_eq!(ncclGroupStart(), ncclResult_t::ncclSuccess);
        assert_eq!(ncclBroadcast(p(&bs), p(&br), COLL, f32t, 1, comm, s0.cast()), ncclResult_t::ncclSuccess);
        assert_eq!(ncclAllGather(p(&gs), p(&gr), COLL, f32t, comm, s1.cast()), ncclResult_t::ncclSuccess);
        assert_eq!(ncclReduceScatter(p(&rs), p(&rr), COLL, f32t, sum, comm, s0.cast()), ncclResult_t::ncclSuccess);
        assert_eq!(ncclAllReduce(p(&as_), p(&ar), COLL, f32t, sum, comm, s0.cast()), ncclResult_t::ncclSuccess);
        assert_eq!(ncclGroupEnd(), ncclResult_t::ncclSuccess, "a captured group of collectives");
    });
    let read = |m: &DevMem, elems: usize| -> Vec<f32> {
        let mut b = vec![0u8; elems * 4];
        // SAFETY: `m` holds `elems` f32; the stream was synchronised.
        unsafe { result::memcpy_dtoh_sync(&mut b, m.0) }.unwrap();
        b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    for rep in 0..FRESH_REPLAYS {
        let seed = 10 * rep + 1;
        let mine = |elems: usize, sd: usize| f32_bytes(&(0..elems).map(|i| val(rank, i, sd)).collect::<Vec<_>>());
        upload(bs.0, &mine(COLL, seed), s0);
        upload(gs.0, &mine(COLL, seed + 1), s0);
        upload(rs.0, &mine(n * COLL, seed + 2), s0);
        upload(as_.0, &mine(COLL, seed + 3), s0);
        // SAFETY: an instantiated graph and live streams.
        unsafe {
            assert_eq!(sys::cuGraphLaunch(exec, s0), sys::CUresult::CUDA_SUCCESS, "replay {rep}");
            result::stream::synchronize(s0).unwrap();
        }
        let check = |what: &str, got: Vec<f32>, want: &dyn Fn(usize) -> f32| {
            for (i, g) in got.iter().enumerate() {
                assert_eq!(*g, want(i), "rank {rank}, replay {rep}: {what} element {i}");
            }
        };
        check("broadcast", read(&br, COLL), &|i| val(1, i, seed));
        check("all-gather", read(&gr, n * COLL), &|j| val(j / COLL, j % COLL, seed + 1));
        check("reduce-scatter", read(&rr, COLL), &|i| (0..n).map(|r| val(r, rank * COLL + i, seed + 2)).sum());
        check("all-reduce", read(&ar, COLL), &|i| (0..n).map(|r| val(r, i, seed + 3)).sum());
    }
    // SAFETY: no launch of it is pending (the stream was synchronised).
    assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, sys::CUresult::CUDA_SUCCESS);
}

fn first_calls_main(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let (s0, s1) = (streams[0], streams[1]);
    let modes = [
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    ];
    // Buffers of each communicator here are its own (none is mapped by two communicators).
    let arena = || DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20));
    let mut arenas = Vec::new();
    for (m, mode) in modes.into_iter().enumerate() {
        // The communicator's first device call is captured: its set-up runs in the capture.
        let fresh = split(comm, 0, rank);
        arenas.push(arena());
        let these = cases(&arenas[m]);
        let exec = capture_then(fresh, &these, s0, mode, false, || {});
        replay(exec, &these, rank, n, 100 * (m + 1), FRESH_REPLAYS, s0);
        // Its uncaptured calls after are exact.
        round(&these, rank, n, 100 * (m + 1) + 50, s0, || {
            for c in &these {
                assert_eq!(enqueue(fresh, c, s0), ncclResult_t::ncclSuccess);
            }
        });
        assert_eq!(ncclCommDestroy(fresh), ncclResult_t::ncclSuccess);
    }
    // The same on a blocking stream (set-up must not touch the legacy stream, which would join
    // the capture and invalidate it).
    let blocking = result::stream::create(result::stream::StreamKind::Default).unwrap();
    let fresh = split(comm, 0, rank);
    arenas.push(arena());
    let these = cases(&arenas[3]);
    let exec = capture_then(fresh, &these, blocking, modes[0], false, || {});
    replay(exec, &these, rank, n, 400, FRESH_REPLAYS, blocking);
    assert_eq!(ncclCommDestroy(fresh), ncclResult_t::ncclSuccess);
    // SAFETY: synchronised by the last replay; not used after this.
    unsafe { result::stream::destroy(blocking) }.unwrap();
    // A captured group of 3 all-reduces, the first device calls of a communicator, on one
    // stream; then on two streams (the middle call on the forked one).
    let group = |comm: ncclComm_t, gc: &[Case], on: [sys::CUstream; 3]| {
        assert_eq!(ncclGroupStart(), ncclResult_t::ncclSuccess);
        for (c, s) in gc.iter().zip(on) {
            assert_eq!(enqueue(comm, c, s), ncclResult_t::ncclSuccess);
        }
        assert_eq!(ncclGroupEnd(), ncclResult_t::ncclSuccess, "a captured group");
    };
    let fresh = split(comm, 0, rank);
    arenas.push(arena());
    let gc = group_cases(&arenas[4]);
    let global = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let exec = capture_calls(s0, &[], global, || group(fresh, &gc, [s0; 3]));
    replay(exec, &gc, rank, n, 500, FRESH_REPLAYS, s0);
    let exec = capture_calls(s0, &[s1], global, || group(fresh, &gc, [s0, s1, s0]));
    replay(exec, &gc, rank, n, 600, FRESH_REPLAYS, s0);
    // Refused, and nothing is left half-enqueued: a group with a send (no captured flow), and a
    // group whose streams are not all capturing.
    let send = |comm: ncclComm_t, c: &Case, s: sys::CUstream| {
        oxccl::ffi::coll::ncclSend(c.send as *const _, c.count, c.t as i32, 1 - rank as i32, comm, s.cast())
    };
    // SAFETY (this block): live streams; the graphs are destroyed here.
    unsafe {
        for mixed in [false, true] {
            assert_eq!(sys::cuStreamBeginCapture_v2(s0, global), sys::CUresult::CUDA_SUCCESS);
            assert_eq!(ncclGroupStart(), ncclResult_t::ncclSuccess);
            assert_eq!(enqueue(fresh, &gc[0], s0), ncclResult_t::ncclSuccess);
            if mixed {
                assert_eq!(enqueue(fresh, &gc[1], s1), ncclResult_t::ncclSuccess);
            } else {
                assert_eq!(send(fresh, &gc[1], s0), ncclResult_t::ncclSuccess);
            }
            assert_eq!(ncclGroupEnd(), ncclResult_t::ncclInvalidUsage, "refused (uncapturing stream: {mixed})");
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            assert_eq!(sys::cuStreamEndCapture(s0, &mut graph), sys::CUresult::CUDA_SUCCESS);
            assert_eq!(sys::cuGraphDestroy(graph), sys::CUresult::CUDA_SUCCESS);
        }
    }
    round(&gc, rank, n, 700, s0, || group(fresh, &gc, [s0; 3]));
    assert_eq!(ncclCommDestroy(fresh), ncclResult_t::ncclSuccess);
    let fresh = split(comm, 0, rank);
    other_collectives(fresh, rank, n, s0, s1);
    assert_eq!(ncclCommDestroy(fresh), ncclResult_t::ncclSuccess);
    // A communicator of one rank: its first call and a group captured (copies on the stream).
    // (Its rank is 0: the inputs and the reference are rank 0's of one.)
    let alone = split(comm, rank as i32, 0);
    let exec = capture_then(alone, &gc[..1], s0, global, false, || {});
    replay(exec, &gc[..1], 0, 1, 800, 2, s0);
    let exec = capture_calls(s0, &[s1], global, || group(alone, &gc, [s0, s1, s0]));
    replay(exec, &gc, 0, 1, 900, 2, s0);
    assert_eq!(ncclCommDestroy(alone), ncclResult_t::ncclSuccess);
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
    drop(arenas);
}

#[test]
fn first_device_calls_and_groups_captured_replay_exactly() {
    if let Some((rank, n, id)) = common::child_role() {
        first_calls_main(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    let res =
        common::run_ranks("first_device_calls_and_groups_captured_replay_exactly", 2, &env, Duration::from_secs(300));
    common::assert_all_ok(&res);
}

#[test]
fn a_captured_graph_of_10_all_reduces_replays_100_times_exactly() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id);
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    let res = common::run_ranks(
        "a_captured_graph_of_10_all_reduces_replays_100_times_exactly",
        2,
        &env,
        Duration::from_secs(300),
    );
    common::assert_all_ok(&res);
}

#[test]
fn ranks_that_share_a_process_capture_and_replay_exactly() {
    if common::child_role().is_some() {
        let (n, meet) = (2, std::sync::Barrier::new(2));
        let modes = [
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        ];
        as_threads(n, |rank, comm, stream| {
            let arena = DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20));
            let cases = cases(&arena);
            let mut arenas = Vec::new();
            for (m, mode) in modes.into_iter().enumerate() {
                // The first graph holds the communicator's first device calls (the device
                // state is set up during the capture); the others are on fresh buffers.
                let fresh = (m > 0).then(|| DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20)));
                let these = fresh.as_ref().map_or_else(|| crate::cases(&arena), crate::cases);
                // Both threads capture together: in GLOBAL mode, neither may make an unsafe
                // call (an upload's synchronisation, perhaps an instantiation) while the other
                // captures. The first capture enqueues set-up work on the internal streams.
                meet.wait();
                let exec = capture_then(comm, &these, stream, mode, m > 0, || {
                    meet.wait();
                });
                for rep in 0..FRESH_REPLAYS * 3 {
                    round(&these, rank, n, 100 * (m + 1) + rep, stream, || {
                        // SAFETY: an instantiated graph and a live stream.
                        let r = unsafe { sys::cuGraphLaunch(exec, stream) };
                        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "rank {rank}: {mode:?} replay {rep}");
                    });
                }
                // SAFETY: no launch of it is pending (the stream was synchronised).
                assert_eq!(unsafe { sys::cuGraphExecDestroy(exec) }, sys::CUresult::CUDA_SUCCESS);
                arenas.extend(fresh);
                if m == 0 {
                    // Uncaptured calls after the first graph's replays.
                    round(&cases, rank, n, 1, stream, || {
                        for c in &cases {
                            assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess);
                        }
                    });
                }
            }
            // Uncaptured calls after the replays.
            round(&cases, rank, n, 2, stream, || {
                for c in &cases {
                    assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess);
                }
            });
        });
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    let res =
        common::run_ranks("ranks_that_share_a_process_capture_and_replay_exactly", 1, &env, Duration::from_secs(300));
    common::assert_all_ok(&res);
}
