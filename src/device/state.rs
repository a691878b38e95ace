//! Per-communicator device state (the entry points of device calls, which run them as a
//! `DeviceRun`, are in `entry.rs`).
//!
//! The state lives in a process-wide map keyed by the communicator's address (so the
//! communicator itself needs no CUDA field), holding a `Weak` to it. It is created by the first
//! device call on a communicator, which is collective: every rank publishes an IPC card through
//! the communicator's host all-reduce, and all ranks pick the same mode (`setup.rs`): CUDA IPC
//! when every rank is on this host (at most `ipc::MAX_RANKS` of them), compiled the kernels and
//! exported a region, and ranks of one process on different GPUs got peer access (and
//! `OXCCL_CUDA_IPC` is not `0`); otherwise the proxy (pinned staging into the host engine,
//! which also crosses hosts). `OXCCL_DEBUG=INFO` says once per communicator which one it uses.
//! A janitor thread drops the state of destroyed communicators (waiting, bounded, for their GPU
//! work first).
//!
//! Ordering. A CUDA IPC all-reduce is enqueued straight on the user's stream, after the
//! communicator's previous call: nothing to add when that ran on the same stream (same
//! `cuStreamGetId`), one wait on the ticket word when it ran on another user stream, one wait
//! on the internal stream's last event when it ran there ([`Tail`]). Every other device call
//! runs on one internal stream (as NCCL's enqueue): it records an event on the user's stream and
//! makes the internal stream wait for it (and for the ticket word after an all-reduce on a
//! user's stream), enqueues its work on the internal stream, then records an event there and
//! makes the user's stream wait for that. Calls from several user streams are thus serialised
//! in issue order, each after the user's earlier work on its own stream and before the user's
//! later work.

use super::proxy::Proxy;
use super::region::Region;
use super::{check, Gpu};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

pub(super) use super::setup::DeviceMode;

/// The internal stream and the two events that chain it to user streams, and the event that
/// orders user streams of one CUDA graph capture (`ev_cap`: recorded only in captures).
pub(super) struct Chain {
    pub(super) stream: sys::CUstream,
    ev_in: sys::CUevent,
    ev_out: sys::CUevent,
    ev_cap: sys::CUevent,
}

impl Chain {
    /// Creates the stream and events in the current context.
    fn new() -> Result<Chain> {
        use cudarc::driver::result::{event, stream};
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let s = stream::create(stream::StreamKind::NonBlocking).map_err(|e| super::cu_err(e.0, "cuStreamCreate"))?;
        let null = std::ptr::null_mut();
        let mut c = Chain { stream: s, ev_in: null, ev_out: null, ev_cap: null };
        c.ev_in = event::create(flags).map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
        c.ev_out = event::create(flags).map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
        c.ev_cap = event::create(flags).map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
        Ok(c)
    }

    /// Makes the internal stream wait for `user`'s work so far.
    pub(super) fn join_from(&self, user: sys::CUstream) -> Result<()> {
        // SAFETY: live event and streams of the current context (the user's stream was checked).
        unsafe {
            check(sys::cuEventRecord(self.ev_in, user), "cuEventRecord(user stream)")?;
            check(sys::cuStreamWaitEvent(self.stream, self.ev_in, 0), "cuStreamWaitEvent(internal stream)")
        }
    }

    /// Makes `user`'s later work wait for the internal stream's work so far.
    pub(super) fn join_to(&self, user: sys::CUstream) -> Result<()> {
        // SAFETY: as in `join_from`.
        unsafe {
            check(sys::cuEventRecord(self.ev_out, self.stream), "cuEventRecord(internal stream)")?;
            check(sys::cuStreamWaitEvent(user, self.ev_out, 0), "cuStreamWaitEvent(user stream)")
        }
    }

    /// Makes `to`'s later work wait for `from`'s work so far, both user streams of one CUDA
    /// graph capture: in the graph, an edge from `from`'s last captured work to `to`'s next
    /// (an event recorded and waited for in a capture is no node of its own).
    pub(super) fn capture_edge(&self, from: sys::CUstream, to: sys::CUstream) -> Result<()> {
        // SAFETY: a live event of the current context and two checked user streams.
        unsafe {
            check(sys::cuEventRecord(self.ev_cap, from), "cuEventRecord(captured stream)")?;
            check(sys::cuStreamWaitEvent(to, self.ev_cap, 0), "cuStreamWaitEvent(captured stream)")
        }
    }

    /// Makes `user` wait for the internal stream's work up to its last `join_to` (nothing when
    /// the host already sees that work done).
    pub(super) fn after_internal(&self, user: sys::CUstream) -> Result<()> {
        // SAFETY: a live event of the current context.
        if unsafe { sys::cuEventQuery(self.ev_out) } == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        // SAFETY: as in `join_from`.
        check(unsafe { sys::cuStreamWaitEvent(user, self.ev_out, 0) }, "cuStreamWaitEvent(user stream)")
    }
}

/// Where a communicator's last device call ran, which the next one must come after.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Tail {
    /// No call yet.
    Idle,
    /// On the internal stream (ending with a record of `ev_out`).
    Internal,
    /// Straight on a user's stream (an IPC all-reduce), known by its stream id when the driver
    /// has `cuStreamGetId`: a later call on the same stream is ordered after it already.
    User(Option<u64>),
}

/// The driver's id of `stream` (unique in the process for its lifetime, never reused, unlike
/// the handle), or `None` when the driver lacks `cuStreamGetId` (CUDA < 12) or refuses.
pub(super) fn stream_id(stream: sys::CUstream) -> Option<u64> {
    static HAS: OnceLock<bool> = OnceLock::new();
    if !*HAS.get_or_init(|| super::driver_has(c"cuStreamGetId")) {
        return None;
    }
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: the caller's stream handle (checked by `check_user_stream`); writes the id. The
    // symbol exists (checked above), so cudarc's loader does not panic.
    let r = unsafe { sys::cuStreamGetId(stream, &mut id) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(id)
}

impl Drop for Chain {
    fn drop(&mut self) {
        // SAFETY: created in `new` (null handles skipped); the modes drained the stream first.
        unsafe {
            for e in [self.ev_in, self.ev_out, self.ev_cap] {
                if !e.is_null() {
                    sys::cuEventDestroy_v2(e);
                }
            }
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}

// Field order matters: `mode` and `staged` drop (draining the internal stream) before `chain`.
pub(super) struct DeviceComm {
    /// The GPU of the communicator's device calls.
    pub(super) ordinal: i32,
    /// CUDA IPC or the proxy.
    pub(super) mode: DeviceMode,
    /// In IPC mode, the proxy that runs every call but a plain all-reduce (created on first
    /// use; not collective: every rank creates its own when its first such call comes).
    pub(super) staged: Option<Proxy>,
    /// (collective, path) pairs logged already (once per communicator, collective and path).
    pub(super) logged: std::collections::HashSet<(&'static str, &'static str)>,
    /// Where the last call ran.
    pub(super) tail: Tail,
    /// The internal stream and its events.
    pub(super) chain: Chain,
}

// SAFETY: stream and event handles usable from any thread with the context current; used under
// the state's mutex.
unsafe impl Send for Chain {}

struct Entry {
    comm: Weak<Communicator>,
    state: Arc<Mutex<DeviceComm>>,
}

pub(super) use crate::sync::lock;

fn registry() -> &'static Mutex<HashMap<usize, Entry>> {
    static R: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    R.get_or_init(|| {
        let _ = std::thread::Builder::new().name("oxccl-cuda-janitor".into()).spawn(|| {
            // It frees communicators' device memory: never refused by a user's capture.
            super::capture::relax_thread();
            loop {
                std::thread::sleep(Duration::from_millis(500));
                prune();
            }
        });
        Mutex::new(HashMap::new())
    })
}

/// Drops the state of communicators that no longer exist.
fn prune() {
    let dead: Vec<Entry> = {
        let mut map = lock(registry());
        let keys: Vec<usize> = map.iter().filter(|(_, e)| e.comm.strong_count() == 0).map(|(k, _)| *k).collect();
        keys.into_iter().filter_map(|k| map.remove(&k)).collect()
    };
    for e in dead {
        // Teardown frees CUDA memory: do it with the GPU's context current.
        let ordinal = lock(&e.state).ordinal;
        let guard = super::gpu(ordinal).and_then(|g| g.enter());
        drop(e);
        drop(guard);
    }
}

/// The state of `comm`, created collectively on first use (the GPU's context is current).
pub(super) fn state_for(comm: &Arc<Communicator>, gpu: &Gpu) -> Result<Arc<Mutex<DeviceComm>>> {
    let key = Arc::as_ptr(comm) as usize;
    {
        let mut map = lock(registry());
        match map.get(&key) {
            Some(e) if e.comm.ptr_eq(&Arc::downgrade(comm)) => return Ok(e.state.clone()),
            Some(_) => {
                map.remove(&key); // a dead communicator at the same address
            }
            None => {}
        }
    }
    // Set-up allocates, exports, registers and maps memory, loads kernels, synchronises its
    // own stream and starts threads: under RELAXED capture mode for this thread, so that a
    // first device call made while a stream captures a CUDA graph (this thread's, or another
    // thread's GLOBAL capture) neither fails nor invalidates the capture. None of it is
    // enqueued on a user's stream; all of it is kept for the communicator's life, so no graph
    // depends on an allocation that a replay would need again (`capture.rs`).
    let (chain, mode) = super::capture::relaxed(|| -> Result<(Chain, DeviceMode)> {
        let chain = Chain::new()?;
        let mode = super::setup::choose_mode(comm, gpu, chain.stream)?;
        Ok((chain, mode))
    })?;
    let state = Arc::new(Mutex::new(DeviceComm {
        ordinal: gpu.ordinal,
        mode,
        staged: None,
        logged: Default::default(),
        tail: Tail::Idle,
        chain,
    }));
    lock(registry()).insert(key, Entry { comm: Arc::downgrade(comm), state: state.clone() });
    let _ = comm.host_fence.set(quiesce);
    Ok(state)
}

/// Sets up, together, the device state of a group's communicators that have none yet (each
/// with the GPU of its calls): creating it is collective (a host exchange among the
/// communicator's ranks), so when one thread drives several ranks of a clique (e.g. after
/// `ncclCommInitAll`), the set-ups must run at the same time to meet: each runs on a thread of
/// its own. Returns one result per part, in order.
pub(crate) fn set_up_together(parts: &[(Arc<Communicator>, i32)]) -> Vec<Result<()>> {
    let mut out: Vec<Result<()>> = parts.iter().map(|_| Ok(())).collect();
    let fresh: Vec<usize> = (0..parts.len()).filter(|&i| ordinal_of(&parts[i].0).is_none()).collect();
    if fresh.len() < 2 {
        return out; // one set-up meets its peers in other threads or processes, inside enqueue
    }
    let done: Vec<(usize, Result<()>)> = std::thread::scope(|s| {
        let handles: Vec<_> = fresh
            .iter()
            .map(|&i| {
                let (comm, ordinal) = (&parts[i].0, parts[i].1);
                let h = s.spawn(move || -> Result<()> {
                    let gpu = super::gpu(ordinal)?;
                    let _ctx = gpu.enter()?;
                    state_for(comm, &gpu).map(drop)
                });
                (i, h)
            })
            .collect();
        handles
            .into_iter()
            .map(|(i, h)| {
                (
                    i,
                    h.join()
                        .unwrap_or_else(|_| Err(Error::internal("setting up a communicator's device state panicked"))),
                )
            })
            .collect()
    });
    for (i, r) in done {
        out[i] = r;
    }
    out
}

/// The GPU of `comm`'s device calls, once its first one has run.
pub(crate) fn ordinal_of(comm: &Arc<Communicator>) -> Option<i32> {
    let map = lock(registry());
    let e = map.get(&(Arc::as_ptr(comm) as usize))?;
    e.comm.ptr_eq(&Arc::downgrade(comm)).then(|| lock(&e.state).ordinal)
}

/// Waits until the proxy of `comm` (if it has device state) has run every device call handed
/// to it: a host collective issued next on this thread then cannot run on the communicator's
/// links at the same time as a staged device call of the proxy thread (the two would pair with
/// different calls of the peers).
pub(crate) fn quiesce(comm: &Communicator) -> Result<()> {
    let state = {
        let map = lock(registry());
        match map.get(&(comm as *const Communicator as usize)) {
            Some(e) if std::ptr::eq(e.comm.as_ptr(), comm) => e.state.clone(),
            _ => return Ok(()),
        }
    };
    let st = lock(&state);
    if let DeviceMode::Proxy(p) = &st.mode {
        p.drain()?;
    }
    match &st.staged {
        Some(p) => p.drain(),
        None => Ok(()),
    }
}

/// Memory `comm`'s device state holds: (bytes of GPU memory, bytes of pinned host memory).
/// (0, 0) before its first device call. GPU memory: the CUDA IPC region (input and result
/// areas, small slots) and the fold tables; pinned host memory: the fold tables' sources and
/// the proxies' flags and staging buffers.
pub fn memory(comm: &Arc<Communicator>) -> (u64, u64) {
    let map = lock(registry());
    let Some(e) = map.get(&(Arc::as_ptr(comm) as usize)) else { return (0, 0) };
    if !e.comm.ptr_eq(&Arc::downgrade(comm)) {
        return (0, 0);
    }
    let st = lock(&e.state);
    let (gpu, mut pinned) = match &st.mode {
        DeviceMode::Ipc(i) => {
            let (dev, host) = i.win.bytes();
            (Region::bytes(i.half()) + i.ll_bytes() + dev, host)
        }
        DeviceMode::Proxy(p) => (0, p.pinned_bytes()),
    };
    pinned += st.staged.as_ref().map_or(0, |p| p.pinned_bytes());
    (gpu as u64, pinned as u64)
}

/// Which device path `comm` uses ("ipc" or "proxy"), once its first device call has chosen one.
pub fn path(comm: &Arc<Communicator>) -> Option<&'static str> {
    let map = lock(registry());
    let e = map.get(&(Arc::as_ptr(comm) as usize))?;
    if !e.comm.ptr_eq(&Arc::downgrade(comm)) {
        return None;
    }
    let st = lock(&e.state);
    Some(match st.mode {
        DeviceMode::Proxy(_) => "proxy",
        DeviceMode::Ipc(_) => "ipc",
    })
}

/// Checks that a non-null `stream` belongs to `gpu`'s context (the current one).
pub(super) fn check_stream(gpu: &Gpu, stream: sys::CUstream) -> Result<()> {
    if stream.is_null() || stream as usize <= 2 {
        return Ok(()); // the default (legacy or per-thread) stream of the current context
    }
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller's stream handle; writes its context.
    check(unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }, "cuStreamGetCtx(stream)")?;
    if ctx != gpu.context() {
        return Err(Error::invalid_argument(format!(
            "the stream does not belong to GPU {}'s primary context (the buffers' GPU)",
            gpu.ordinal
        )));
    }
    Ok(())
}
