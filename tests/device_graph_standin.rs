//! Stream capture and graph replay, as the CUDA stand-in models them (cuda-standin/graph.inc):
//! operations enqueued on a capturing stream are recorded, not run (memory and the enqueue
//! counter stay unchanged, the recorded-operations counter grows); `cuStreamIsCapturing` says
//! ACTIVE, then NONE after `cuStreamEndCapture`; each launch of the instantiated graph runs every
//! recorded operation again, in order, with the arguments as they were at capture (a memset, a
//! device-to-device copy, a reduction kernel, a stream write and a satisfied stream wait, a host
//! function), on inputs changed between launches, and each launch counts its operations as
//! enqueued ones; the executable graph outlives the graph it came from; launches of one
//! executable graph on two streams do not overlap; `cuStreamGetCaptureInfo_v3` gives the
//! capture's id and graph. A capture forks to a second stream and joins it back through events,
//! and replays in that order; ending it with the second stream's work not joined back fails
//! (UNJOINED). Refused: capturing the legacy stream; on the stand-in also a wait for an event
//! recorded outside the capture on a capturing stream, a synchronisation of it, a graph launch
//! into it, the legacy stream while a blocking stream captures (each invalidates the capture,
//! whose end then fails), ending a capture on a stream that joined it, and merging two captures.
//!
//! The capture interaction modes: a potentially unsafe call (`cuMemAlloc`, `cuEventQuery`)
//! during a GLOBAL capture is refused on the capturing thread and on every thread in GLOBAL
//! mode, during a THREAD_LOCAL one on the capturing thread only, during a RELAXED one nowhere,
//! and never on a thread switched to RELAXED (`cuThreadExchangeStreamCaptureMode`); a refused
//! call invalidates the capture.
//!
//! On the real driver (`OXCCL_DEVICE_TESTS_REAL=1`) the replays and the legacy-stream refusal
//! are checked; the counters and the stand-in's refusals are not.

mod common;

use common::standin::{real_driver, standin_count, standin_env, upload, DevMem};
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sys::CUresult as R;
use sys::CUstreamCaptureMode as Mode;
use sys::CUstreamCaptureStatus as Status;

/// Elements of each buffer.
const N: usize = 1024;
/// Value the memset writes.
const FILL: u32 = 0x7777_7777;
/// What every buffer holds before a launch: a launch that did not write it shows.
const STALE: u32 = 0x1111_1111;

static HOST_CALLS: AtomicU32 = AtomicU32::new(0);

extern "C" fn bump(data: *mut c_void) {
    // SAFETY: `data` is &HOST_CALLS, a static.
    unsafe { &*(data as *const AtomicU32) }.fetch_add(1, Ordering::SeqCst);
}

fn ok(r: R, what: &str) {
    assert_eq!(r, R::CUDA_SUCCESS, "{what}");
}

fn capture_status(s: sys::CUstream) -> Status {
    let mut st = Status::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream of the current context; `st` outlives the call.
    ok(unsafe { sys::cuStreamIsCapturing(s, &mut st) }, "cuStreamIsCapturing");
    st
}

/// (id, graph) of the capture `s` is in (ACTIVE), from `cuStreamGetCaptureInfo_v3`; the
/// dependency set too when `deps` (the empty set: nothing recorded yet).
fn capture_info(s: sys::CUstream, deps: bool) -> (u64, sys::CUgraph) {
    let mut st = Status::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph) = (0u64, std::ptr::null_mut());
    let (mut dep, mut n) = (std::ptr::null(), usize::MAX);
    let (dep_out, n_out) =
        if deps { (&mut dep as *mut _, &mut n as *mut usize) } else { (std::ptr::null_mut(), std::ptr::null_mut()) };
    // SAFETY: a live stream; every output outlives the call (or is null: not asked for).
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(s, &mut st, &mut id, &mut graph, dep_out, std::ptr::null_mut(), n_out)
    };
    ok(r, "cuStreamGetCaptureInfo_v3");
    assert_eq!(st, Status::CU_STREAM_CAPTURE_STATUS_ACTIVE, "cuStreamGetCaptureInfo status");
    if deps {
        assert_eq!(n, 0, "dependencies of a capture with nothing recorded");
    }
    (id, graph)
}

fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}
fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// The `n` 32-bit words at `buf`, read with the synchronous copy (legacy stream; the capturing
/// stream is non-blocking, so this neither waits for it nor joins its capture).
fn read_u32(buf: u64, n: usize) -> Vec<u32> {
    let mut b = vec![0u8; 4 * n];
    // SAFETY: `buf` holds at least 4n bytes; `b` too.
    ok(unsafe { sys::cuMemcpyDtoH_v2(b.as_mut_ptr().cast(), buf, 4 * n) }, "cuMemcpyDtoH");
    b.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect()
}

fn count(what: i32) -> u64 {
    standin_count(what).unwrap_or(0)
}

/// The buffers of the captured sequence.
struct Bufs {
    a: DevMem,
    b: DevMem,
    sum: DevMem,
    src: DevMem,
    dst: DevMem,
    /// Word 0: written by the stream write; word 1: the gate the stream wait waits for (1).
    flag: DevMem,
}

/// Inputs of launch `k` uploaded on `s`, every output reset to STALE; returns (a, b, src).
fn prepare(bufs: &Bufs, k: u32, s: sys::CUstream) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let a: Vec<f32> = (0..N).map(|i| (i as f32) + 1000.0 * k as f32).collect();
    let b: Vec<f32> = (0..N).map(|i| 0.5 * (i as f32) * (k + 1) as f32).collect();
    let src: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(2654435761).wrapping_add(k)).collect();
    upload(bufs.a.0, &bytes_f32(&a), s);
    upload(bufs.b.0, &bytes_f32(&b), s);
    upload(bufs.src.0, &bytes_u32(&src), s);
    upload(bufs.sum.0, &bytes_u32(&[STALE; N]), s);
    upload(bufs.dst.0, &bytes_u32(&[STALE; N]), s);
    upload(bufs.flag.0, &bytes_u32(&[STALE, 1]), s);
    (a, b, src)
}

/// Records the sequence on `s` (capturing): 6 operations.
fn record(bufs: &Bufs, kernel: sys::CUfunction, s: sys::CUstream) {
    let half = N / 2;
    // SAFETY: every buffer holds N 32-bit words (`flag` 2); the kernel's parameters are
    // (float* dst, const float* a, const float* b, u64 n, u32 div), each passed by address and
    // copied at the call; HOST_CALLS is a static.
    unsafe {
        ok(sys::cuMemsetD32Async(bufs.dst.0, FILL, N, s), "cuMemsetD32Async");
        ok(sys::cuMemcpyDtoDAsync_v2(bufs.dst.0, bufs.src.0, 4 * half, s), "cuMemcpyDtoDAsync");
        let (mut dst, mut a, mut b, mut n, mut div) = (bufs.sum.0, bufs.a.0, bufs.b.0, N as u64, 1u32);
        let mut params: [*mut c_void; 5] = [
            (&mut dst as *mut u64).cast(),
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut div as *mut u32).cast(),
        ];
        ok(
            sys::cuLaunchKernel(kernel, 2, 1, 1, 32, 1, 1, 0, s, params.as_mut_ptr(), std::ptr::null_mut()),
            "cuLaunchKernel",
        );
        // The arguments were copied at the call: the replays must not see these.
        (dst, a, b, n, div) = (0, 0, 0, 0, 0);
        std::hint::black_box((dst, a, b, n, div, &params));
        ok(sys::cuStreamWriteValue32_v2(s, bufs.flag.0, 0xC0DE, 0), "cuStreamWriteValue32");
        ok(sys::cuStreamWaitValue32_v2(s, bufs.flag.0 + 4, 1, 0), "cuStreamWaitValue32 (GEQ 1, satisfied)");
        ok(
            sys::cuLaunchHostFunc(s, Some(bump), (&HOST_CALLS as *const AtomicU32).cast_mut().cast()),
            "cuLaunchHostFunc",
        );
    }
}

/// What launch `k` must have left, against the inputs `prepare` uploaded.
fn check(bufs: &Bufs, k: u32, (a, b, src): &(Vec<f32>, Vec<f32>, Vec<u32>)) {
    let dst = read_u32(bufs.dst.0, N);
    for (i, &got) in dst.iter().enumerate() {
        let want = if i < N / 2 { src[i] } else { FILL };
        assert_eq!(got, want, "launch {k}: dst[{i}] (first half copied, second half set)");
    }
    let sum = read_u32(bufs.sum.0, N);
    for i in 0..N {
        // Small integers and halves: the f32 sum is exact.
        let want = (f64::from(a[i]) + f64::from(b[i])) as f32;
        assert_eq!(f32::from_bits(sum[i]), want, "launch {k}: sum[{i}] = a + b");
    }
    assert_eq!(read_u32(bufs.flag.0, 2), [0xC0DE, 1], "launch {k}: the stream write");
    assert_eq!(HOST_CALLS.load(Ordering::SeqCst), k + 1, "launch {k}: host function calls");
}

/// Capture, instantiate, three checked launches (the graph destroyed before the last).
fn replays(kernel: sys::CUfunction, s: sys::CUstream) {
    let bufs = Bufs {
        a: DevMem::new(4 * N),
        b: DevMem::new(4 * N),
        sum: DevMem::new(4 * N),
        src: DevMem::new(4 * N),
        dst: DevMem::new(4 * N),
        flag: DevMem::new(8),
    };
    prepare(&bufs, 0, s);
    assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_NONE, "before the capture");
    let (enq0, rec0, launches0) = (count(100), count(110), count(111));
    // Relaxed: the synchronous reads below are legal during the capture on the real driver too.
    // SAFETY: a live non-blocking stream of the current context.
    ok(unsafe { sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_RELAXED) }, "cuStreamBeginCapture");
    assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_ACTIVE, "during the capture");
    let (id, captured) = capture_info(s, true);
    assert!(id != 0 && !captured.is_null(), "cuStreamGetCaptureInfo: id {id}, graph {captured:?}");
    record(&bufs, kernel, s);
    assert_eq!(capture_info(s, false), (id, captured), "cuStreamGetCaptureInfo after recording");
    if !real_driver() {
        // Graph nodes are not modelled: the dependency set is refused once something is recorded.
        let mut st = Status::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut deps, mut n) = (std::ptr::null(), 0usize);
        // SAFETY: a live stream; every output outlives the call.
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                s,
                &mut st,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut deps,
                std::ptr::null_mut(),
                &mut n,
            )
        };
        assert_eq!(r, R::CUDA_ERROR_NOT_SUPPORTED, "the dependency set of a non-empty capture");
    }
    if !real_driver() {
        // (Before the reads below, which are enqueued operations of the legacy stream.)
        assert_eq!(count(100), enq0, "recorded operations counted as enqueued");
        assert_eq!(count(110) - rec0, 6, "operations recorded into the graph");
    }
    std::thread::sleep(Duration::from_millis(50));
    // Nothing ran.
    assert!(read_u32(bufs.dst.0, N).iter().all(|&w| w == STALE), "the capture ran the memset or the copy");
    assert!(read_u32(bufs.sum.0, N).iter().all(|&w| w == STALE), "the capture ran the kernel");
    assert_eq!(read_u32(bufs.flag.0, 2), [STALE, 1], "the capture ran the stream write");
    assert_eq!(HOST_CALLS.load(Ordering::SeqCst), 0, "the capture ran the host function");
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing; `graph` outlives the call.
    ok(unsafe { sys::cuStreamEndCapture(s, &mut graph) }, "cuStreamEndCapture");
    assert!(!graph.is_null(), "cuStreamEndCapture gave no graph");
    assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_NONE, "after the capture");
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the graph just captured; `exec` outlives the call.
    ok(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "cuGraphInstantiateWithFlags");
    for k in 0..3u32 {
        let inputs = prepare(&bufs, k, s);
        if k == 2 {
            // The executable graph is independent of the graph it was instantiated from.
            // SAFETY: `graph` is not used after this.
            ok(unsafe { sys::cuGraphDestroy(graph) }, "cuGraphDestroy");
        }
        let (enq, kernels, launches) = (count(100), count(3), count(111));
        // SAFETY: a live executable graph and stream of the current context.
        ok(unsafe { sys::cuGraphLaunch(exec, s) }, "cuGraphLaunch");
        if !real_driver() {
            assert_eq!(count(100) - enq, 6, "launch {k}: operations enqueued");
            assert_eq!(count(3) - kernels, 1, "launch {k}: kernels enqueued");
            assert_eq!(count(111) - launches, 1, "launch {k}: graph launches");
        }
        // SAFETY: a live stream.
        ok(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize");
        check(&bufs, k, &inputs);
    }
    if !real_driver() {
        assert_eq!(count(111) - launches0, 3, "graph launches");
        assert_eq!(count(110) - rec0, 6, "launches record nothing");
    }
    // SAFETY: launched work has finished; `exec` is not used after this.
    ok(unsafe { sys::cuGraphExecDestroy(exec) }, "cuGraphExecDestroy");
}

/// Ends the capture of `s`, expecting it invalidated: no graph, the stream usable again.
fn end_invalidated(s: sys::CUstream, what: &str) {
    assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_INVALIDATED, "{what}: status");
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: `s` is in (invalidated) capture; `graph` outlives the call.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut graph) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{what}: cuStreamEndCapture");
    assert!(graph.is_null(), "{what}: an invalidated capture gave a graph");
    assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_NONE, "{what}: after the end");
    // SAFETY: a live stream, no longer capturing.
    ok(unsafe { sys::cuStreamSynchronize(s) }, "{what}: the stream after the capture");
}

fn refusals(s: sys::CUstream) {
    let begin = |s: sys::CUstream| {
        // SAFETY: `s` is a live stream of the current context or the legacy stream.
        unsafe { sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
    };
    assert_eq!(begin(std::ptr::null_mut()), R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "capture of the legacy stream");
    if real_driver() {
        return; // the rest is the stand-in's own refusals
    }
    // A wait for an event recorded outside the capture, on a capturing stream.
    let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let word = DevMem::new(8);
    // SAFETY: live event and stream (not capturing yet).
    ok(unsafe { sys::cuEventRecord(ev, s) }, "cuEventRecord outside the capture");
    ok(begin(s), "cuStreamBeginCapture");
    // SAFETY: live event and stream.
    let r = unsafe { sys::cuStreamWaitEvent(s, ev, 0) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "a wait for an uncaptured event on a capturing stream");
    // Later operations fail until the capture ends.
    // SAFETY: `word` is a device allocation of 8 bytes.
    let r = unsafe { sys::cuMemsetD32Async(word.0, 1, 2, s) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "an operation after the invalidation");
    end_invalidated(s, "uncaptured event wait");
    // SAFETY: `ev` is not used after this.
    ok(unsafe { sys::cuEventDestroy_v2(ev) }, "cuEventDestroy");

    // A synchronisation of a capturing stream.
    ok(begin(s), "cuStreamBeginCapture");
    // SAFETY: a live stream.
    let r = unsafe { sys::cuStreamSynchronize(s) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamSynchronize of a capturing stream");
    end_invalidated(s, "synchronize");

    // A graph launch into a capturing stream.
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    ok(begin(s), "cuStreamBeginCapture");
    // SAFETY: `s` is capturing (an empty capture); the handles outlive the calls.
    unsafe {
        ok(sys::cuStreamEndCapture(s, &mut graph), "empty capture");
        ok(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "instantiate the empty graph");
        ok(sys::cuGraphLaunch(exec, s), "launch of the empty graph");
    }
    ok(begin(s), "cuStreamBeginCapture");
    // SAFETY: live executable graph and stream.
    let r = unsafe { sys::cuGraphLaunch(exec, s) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuGraphLaunch into a capturing stream");
    end_invalidated(s, "graph launch");
    // SAFETY: not used after this.
    unsafe {
        ok(sys::cuGraphExecDestroy(exec), "cuGraphExecDestroy");
        ok(sys::cuGraphDestroy(graph), "cuGraphDestroy");
    }

    // The legacy stream while a blocking stream captures (its implicit synchronisation).
    let blocking = result::stream::create(result::stream::StreamKind::Default).unwrap();
    ok(begin(blocking), "cuStreamBeginCapture (blocking stream)");
    // SAFETY: `word` holds 2 words; the legacy stream.
    let r = unsafe { sys::cuMemsetD32Async(word.0, 1, 2, std::ptr::null_mut()) };
    assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "the legacy stream during a blocking stream's capture");
    end_invalidated(blocking, "legacy stream");
}

/// A capture over two streams (fork and join through events, as the driver has them): `s`
/// begins it and memsets `a`; `other` waits for an event recorded on `s` (joining the capture)
/// and copies `a` into `b`; `s` waits for an event recorded on `other` and copies `b` into `c`.
/// Nothing runs at capture; `other` leaves the capture when `s` ends it; each launch (on `s`)
/// writes the fill into all three, in that order. Refused: ending the capture while `other`
/// has work `s` did not wait for (UNJOINED, and `other` leaves the capture), ending it on
/// `other` (UNMATCHED), and on the stand-in `other` waiting for a second capture's event while
/// in the first (MERGE).
fn two_streams(s: sys::CUstream) {
    let other = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let (fork, join) = (
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap(),
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap(),
    );
    let bytes = N * 4;
    let (a, b, c) = (DevMem::new(bytes), DevMem::new(bytes), DevMem::new(bytes));
    let stale = || {
        for m in [&a, &b, &c] {
            upload(m.0, &bytes_u32(&[STALE; N]), s);
        }
        // SAFETY: a live stream.
        ok(unsafe { sys::cuStreamSynchronize(s) }, "uploads");
    };
    stale();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY (this block): live streams, events and allocations of `bytes` bytes each.
    unsafe {
        ok(sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
        ok(sys::cuMemsetD32Async(a.0, FILL, N, s), "memset a");
        ok(sys::cuEventRecord(fork, s), "cuEventRecord(fork) in the capture");
        assert_eq!(capture_status(other), Status::CU_STREAM_CAPTURE_STATUS_NONE, "other before the fork");
        ok(sys::cuStreamWaitEvent(other, fork, 0), "other joins the capture");
        assert_eq!(capture_status(other), Status::CU_STREAM_CAPTURE_STATUS_ACTIVE, "other after the fork");
        assert_eq!(capture_info(other, false).0, capture_info(s, false).0, "one capture id");
        ok(sys::cuMemcpyDtoDAsync_v2(b.0, a.0, bytes, other), "copy a -> b on other");
        ok(sys::cuEventRecord(join, other), "cuEventRecord(join) in the capture");
        ok(sys::cuStreamWaitEvent(s, join, 0), "s joins other");
        ok(sys::cuMemcpyDtoDAsync_v2(c.0, b.0, bytes, s), "copy b -> c on s");
        ok(sys::cuStreamEndCapture(s, &mut graph), "cuStreamEndCapture over two streams");
    }
    assert_eq!(capture_status(other), Status::CU_STREAM_CAPTURE_STATUS_NONE, "other after the end");
    for m in [&a, &b, &c] {
        assert!(read_u32(m.0, N).iter().all(|&w| w == STALE), "the capture ran an operation");
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: the graph just captured; `exec` outlives the call.
    ok(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }, "instantiate");
    for rep in 0..2 {
        stale();
        // SAFETY: an instantiated graph and a live stream.
        ok(unsafe { sys::cuGraphLaunch(exec, s) }, "cuGraphLaunch");
        // SAFETY: a live stream.
        ok(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize");
        for (m, name) in [(&a, "a"), (&b, "b"), (&c, "c")] {
            assert!(read_u32(m.0, N).iter().all(|&w| w == FILL), "launch {rep}: {name} not filled in order");
        }
    }
    // SAFETY: no launch pending; not used after this.
    unsafe {
        ok(sys::cuGraphExecDestroy(exec), "cuGraphExecDestroy");
        ok(sys::cuGraphDestroy(graph), "cuGraphDestroy");
    }
    // Work on the joined stream that the origin never waited for.
    // SAFETY (this block): as above.
    unsafe {
        ok(sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
        ok(sys::cuEventRecord(fork, s), "cuEventRecord(fork)");
        ok(sys::cuStreamWaitEvent(other, fork, 0), "other joins");
        ok(sys::cuMemsetD32Async(b.0, FILL, N, other), "memset b on other");
        if !real_driver() {
            assert_eq!(
                sys::cuStreamEndCapture(other, &mut graph),
                R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
                "end on other"
            );
        }
        let mut g: sys::CUgraph = std::ptr::null_mut();
        assert_eq!(sys::cuStreamEndCapture(s, &mut g), R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "unjoined work");
        assert!(g.is_null(), "an unjoined capture gave a graph");
    }
    assert_eq!(capture_status(other), Status::CU_STREAM_CAPTURE_STATUS_NONE, "other after the unjoined end");
    if !real_driver() {
        // Two captures cannot merge.
        let third = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        // SAFETY (this block): as above.
        unsafe {
            ok(sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_RELAXED), "first capture");
            ok(sys::cuStreamBeginCapture_v2(third, Mode::CU_STREAM_CAPTURE_MODE_RELAXED), "second capture");
            ok(sys::cuEventRecord(fork, s), "cuEventRecord in the first");
            let r = sys::cuStreamWaitEvent(third, fork, 0);
            assert_eq!(r, R::CUDA_ERROR_STREAM_CAPTURE_MERGE, "a wait across two captures");
            end_invalidated(third, "merge");
            let mut g: sys::CUgraph = std::ptr::null_mut();
            ok(sys::cuStreamEndCapture(s, &mut g), "the first capture is intact");
            ok(sys::cuGraphDestroy(g), "cuGraphDestroy");
            result::stream::destroy(third).unwrap();
        }
    }
    // SAFETY: the streams are idle; not used after this.
    unsafe {
        ok(sys::cuStreamSynchronize(other), "cuStreamSynchronize(other)");
        ok(sys::cuEventDestroy_v2(fork), "cuEventDestroy");
        ok(sys::cuEventDestroy_v2(join), "cuEventDestroy");
        result::stream::destroy(other).unwrap();
    }
}

/// Sets this thread's capture interaction mode to `m`; returns the previous one.
fn exchange(m: Mode) -> Mode {
    let mut m = m;
    // SAFETY: writes the previous mode into `m`.
    ok(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) }, "cuThreadExchangeStreamCaptureMode");
    m
}

/// What `cuMemAlloc` (then `cuMemFree` when it succeeded) and `cuEventQuery` of an idle event
/// answer on this thread.
fn unsafe_calls(ev: sys::CUevent) -> (R, R) {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: writes the allocation's address; freed at once.
    let alloc = unsafe { sys::cuMemAlloc_v2(&mut p, 256) };
    if alloc == R::CUDA_SUCCESS {
        // SAFETY: allocated just above.
        ok(unsafe { sys::cuMemFree_v2(p) }, "cuMemFree");
    }
    // SAFETY: a live event.
    (alloc, unsafe { sys::cuEventQuery(ev) })
}

/// The same, from another thread with `mode` as its capture interaction mode.
fn unsafe_calls_elsewhere(ev: sys::CUevent, mode: Mode) -> (R, R) {
    let ev = ev as usize;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let _ctx = oxccl::device::gpu(0).unwrap().enter().unwrap();
            exchange(mode);
            unsafe_calls(ev as sys::CUevent)
        })
        .join()
        .unwrap()
    })
}

/// The driver's rules for potentially unsafe calls during stream capture (the stand-in
/// enforces them): a GLOBAL capture forbids them to its own thread and to every thread in
/// GLOBAL mode, a THREAD_LOCAL one to its own thread only, a RELAXED one to none; a thread in
/// RELAXED mode may always make them. A forbidden call fails with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture.
fn capture_modes(s: sys::CUstream) {
    let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let (yes, no) = (R::CUDA_SUCCESS, R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    let begin = |m: Mode| {
        // SAFETY: a live non-blocking stream of the current context.
        ok(unsafe { sys::cuStreamBeginCapture_v2(s, m) }, "cuStreamBeginCapture")
    };
    let end_ok = |what: &str| {
        assert_eq!(capture_status(s), Status::CU_STREAM_CAPTURE_STATUS_ACTIVE, "{what}: still active");
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `s` is capturing; the graph is destroyed at once.
        unsafe {
            ok(sys::cuStreamEndCapture(s, &mut graph), what);
            ok(sys::cuGraphDestroy(graph), what);
        }
    };
    let (g, t, r) = (
        Mode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        Mode::CU_STREAM_CAPTURE_MODE_RELAXED,
    );
    // GLOBAL: another thread in GLOBAL mode is refused (its allocation invalidates the capture).
    begin(g);
    assert_eq!(unsafe_calls_elsewhere(ev, g), (no, no), "another GLOBAL thread during a GLOBAL capture");
    end_invalidated(s, "another thread's allocation");
    // GLOBAL: other threads in THREAD_LOCAL or RELAXED mode are not, nor this thread once relaxed.
    begin(g);
    assert_eq!(unsafe_calls_elsewhere(ev, t), (yes, yes), "a THREAD_LOCAL thread during a GLOBAL capture");
    assert_eq!(unsafe_calls_elsewhere(ev, r), (yes, yes), "a RELAXED thread during a GLOBAL capture");
    let old = exchange(r);
    assert_eq!(old, g, "a thread starts in GLOBAL mode");
    assert_eq!(unsafe_calls(ev), (yes, yes), "the capturing thread, relaxed");
    exchange(old);
    end_ok("GLOBAL capture with relaxed calls");
    // GLOBAL: the capturing thread itself is refused.
    begin(g);
    assert_eq!(unsafe_calls(ev), (no, no), "the capturing thread");
    end_invalidated(s, "the capturing thread's allocation");
    // THREAD_LOCAL: other threads are free, the capturing thread is not.
    begin(t);
    assert_eq!(unsafe_calls_elsewhere(ev, g), (yes, yes), "another thread during a THREAD_LOCAL capture");
    end_ok("THREAD_LOCAL capture, another thread's calls");
    begin(t);
    assert_eq!(unsafe_calls(ev).0, no, "the THREAD_LOCAL capturing thread");
    end_invalidated(s, "the THREAD_LOCAL capturing thread's allocation");
    // RELAXED: nobody is refused.
    begin(r);
    assert_eq!(unsafe_calls(ev), (yes, yes), "the RELAXED capturing thread");
    assert_eq!(unsafe_calls_elsewhere(ev, g), (yes, yes), "another thread during a RELAXED capture");
    end_ok("RELAXED capture");
    // SAFETY: not used after this.
    ok(unsafe { sys::cuEventDestroy_v2(ev) }, "cuEventDestroy");
}

/// The steps of the host function `slow_step`, in the order they ran.
static STEPS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

extern "C" fn slow_step(_: *mut c_void) {
    STEPS.lock().unwrap().push("start");
    std::thread::sleep(Duration::from_millis(40));
    STEPS.lock().unwrap().push("end");
}

/// Launches of one executable graph on two streams run one after the other (the real driver
/// orders each launch behind the previous launch of the same executable graph).
fn launches_of_one_graph_are_ordered(s: sys::CUstream) {
    let other = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: live streams of the current context; the handles outlive the calls; `slow_step`
    // takes no data.
    unsafe {
        ok(sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
        ok(sys::cuLaunchHostFunc(s, Some(slow_step), std::ptr::null_mut()), "cuLaunchHostFunc");
        ok(sys::cuStreamEndCapture(s, &mut graph), "cuStreamEndCapture");
        ok(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), "cuGraphInstantiateWithFlags");
        ok(sys::cuGraphLaunch(exec, s), "cuGraphLaunch on the first stream");
        ok(sys::cuGraphLaunch(exec, other), "cuGraphLaunch on the second stream");
        ok(sys::cuStreamSynchronize(other), "cuStreamSynchronize");
        ok(sys::cuStreamSynchronize(s), "cuStreamSynchronize");
        ok(sys::cuGraphExecDestroy(exec), "cuGraphExecDestroy");
        ok(sys::cuGraphDestroy(graph), "cuGraphDestroy");
    }
    assert_eq!(
        *STEPS.lock().unwrap(),
        ["start", "end", "start", "end"],
        "two launches of one executable graph overlapped"
    );
}

fn child() {
    assert!(oxccl::device::available(), "no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let gpu = oxccl::device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let kernel = gpu.kernels().unwrap().entry("oxccl_reduce_f32_sum").unwrap().0;
    // Streams of the current context, destroyed by process exit.
    let s = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    replays(kernel, s);
    launches_of_one_graph_are_ordered(s);
    two_streams(s);
    refusals(s);
    if !real_driver() {
        capture_modes(s);
    }
}

#[test]
fn captured_stream_operations_replay_from_a_graph() {
    if common::child_role().is_some() {
        child();
        return;
    }
    let res = common::run_ranks(
        "captured_stream_operations_replay_from_a_graph",
        1,
        &standin_env(),
        Duration::from_secs(180),
    );
    common::assert_all_ok(&res);
}
