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
//! call the mode forbids) and replayed 3 times with new inputs, exact. A captured call in a
//! group is refused with `ncclInvalidUsage`, and the communicator stays usable.
//!
//! Ranks that are threads of one process (one communicator each, the threads capturing at the
//! same time) capture the 10 calls in each mode, on the warmed-up buffers then on fresh ones,
//! and replay each graph 9 times concurrently, exact; their uncaptured calls after are exact.

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
    // A captured group is refused, and nothing is left half-enqueued: the communicator works.
    // SAFETY: as above.
    unsafe {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
        assert_eq!(sys::cuStreamBeginCapture_v2(stream, mode), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(ncclGroupStart(), ncclResult_t::ncclSuccess);
        assert_eq!(enqueue(comm, &cases[0], stream), ncclResult_t::ncclSuccess);
        assert_eq!(enqueue(comm, &cases[2], stream), ncclResult_t::ncclSuccess);
        assert_eq!(ncclGroupEnd(), ncclResult_t::ncclInvalidUsage, "a captured group");
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        assert_eq!(sys::cuStreamEndCapture(stream, &mut graph), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuGraphDestroy(graph), sys::CUresult::CUDA_SUCCESS);
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
/// graph; the capture must neither enqueue anything nor be invalidated.
fn capture_then(
    comm: ncclComm_t,
    cases: &[Case],
    stream: sys::CUstream,
    mode: sys::CUstreamCaptureMode,
    ended: impl FnOnce(),
) -> sys::CUgraphExec {
    // SAFETY (this block): a live non-blocking stream; the graph handles are used only here.
    unsafe {
        let before = standin_count(100);
        assert_eq!(sys::cuStreamBeginCapture_v2(stream, mode), sys::CUresult::CUDA_SUCCESS);
        for c in cases {
            assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess, "captured call ({mode:?})");
        }
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        assert_eq!(sys::cuStreamEndCapture(stream, &mut graph), sys::CUresult::CUDA_SUCCESS, "{mode:?}");
        assert_eq!(standin_count(100), before, "capturing enqueued stream operations");
        ended();
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        assert_eq!(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuGraphDestroy(graph), sys::CUresult::CUDA_SUCCESS);
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
    capture_then(comm, cases, stream, mode, || {})
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
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        ];
        as_threads(n, |rank, comm, stream| {
            let arena = DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20));
            let cases = cases(&arena);
            // Warm-up, uncaptured.
            round(&cases, rank, n, 1, stream, || {
                for c in &cases {
                    assert_eq!(enqueue(comm, c, stream), ncclResult_t::ncclSuccess);
                }
            });
            let mut arenas = Vec::new();
            for (m, mode) in modes.into_iter().enumerate() {
                // The first graph on the warmed-up buffers, the others on fresh ones.
                let fresh = (m > 0).then(|| DevMem::new(8 * IPC_DIRECT_MIN + (1 << 20)));
                let these = fresh.as_ref().map_or_else(|| crate::cases(&arena), crate::cases);
                // Both threads capture together: in GLOBAL mode, neither may make an unsafe
                // call (an upload's synchronisation, perhaps an instantiation) while the other
                // captures.
                meet.wait();
                let exec = capture_then(comm, &these, stream, mode, || {
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
