//! oxccl's own CUDA calls and stream capture.
//!
//! While a stream is capturing a CUDA graph, the driver forbids "potentially unsafe" calls
//! (allocating, freeing or registering memory, opening and closing IPC mappings, synchronous
//! copies, synchronisation and queries) by thread, according to the calling thread's capture
//! interaction mode (`cuThreadExchangeStreamCaptureMode`): in GLOBAL mode (every thread's
//! default) any GLOBAL capture of any thread forbids them, in THREAD_LOCAL mode only a capture
//! of the thread itself, in RELAXED mode none. A forbidden call fails and invalidates the
//! capture (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`).
//!
//! oxccl makes such calls where none of them becomes part of a graph:
//!
//! - its own threads (the proxy, the IPC watchdog and opener, the janitor) never capture; they
//!   switch themselves to RELAXED mode when they start ([`relax_thread`]), so a user's GLOBAL
//!   capture elsewhere in the process neither fails them nor is invalidated by them;
//! - a captured call that meets buffers it has not seen maps the peers' allocations during the
//!   capture (`window.rs`, `Window::share`): the mapping is made once, host-side, and kept for the
//!   communicator's life, so the graph depends on it as on the communicator's regions, not on a
//!   replayed allocation. Those calls run under [`relaxed`] (as NCCL does around its own
//!   allocations during capture);
//! - a communicator's device set-up (`state::state_for`: its region, flag page, peer mappings,
//!   kernels, internal stream and threads) runs under [`relaxed`] too, so its first device call
//!   may be captured; its memory operations run on the internal stream (non-blocking) and are
//!   waited for there, never on the legacy stream, which would join a blocking stream's capture.

use cudarc::driver::sys;

/// What a CUDA graph capture of device collectives takes (the text of `entry.rs`'s and
/// `run.rs`'s refusals of captured calls).
pub(crate) const CAPTURABLE: &str = "CUDA graph capture of device collectives: all-reduces, and broadcasts, reduces, \
     all-gathers, reduce-scatters, all-to-alls, gathers and scatters that fit the one-shot CUDA IPC flow (one, or a \
     group of them on one or several streams of one capture), on ranks of one host over CUDA IPC, or all-reduces on \
     a communicator of one rank, can be captured (not sends and receives, PreMulSum with a factor in device \
     memory, nor the staged path)";

/// Whether the driver has `cuThreadExchangeStreamCaptureMode` (CUDA 10.1 and later; every
/// driver oxccl supports, but cudarc's loader panics on a missing symbol).
fn exchange_available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| super::driver_has(c"cuThreadExchangeStreamCaptureMode"))
}

/// Sets the calling thread's capture interaction mode to `mode`; returns the previous one.
fn exchange(mode: sys::CUstreamCaptureMode) -> Option<sys::CUstreamCaptureMode> {
    if !exchange_available() {
        return None;
    }
    let mut m = mode;
    // SAFETY: writes the previous mode into `m`; touches no other state.
    let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(m)
}

/// Runs `f` with the calling thread's capture interaction mode RELAXED, then restores it: for
/// oxccl's own allocations and mappings, which stay outside any graph (the module's docs).
pub(crate) fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let old = exchange(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
    let out = f();
    if let Some(old) = old {
        exchange(old);
    }
    out
}

/// Sets the calling thread's capture interaction mode to RELAXED for good: the first thing an
/// oxccl thread does (it never captures, and its calls are never part of a graph).
pub(crate) fn relax_thread() {
    exchange(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
}
