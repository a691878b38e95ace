//! Per-communicator device state and the entry points of device calls ([`enqueue`], and
//! [`all_reduce`] for one plain all-reduce), which run them as a `DeviceRun` (`run.rs`).
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

use super::exec::DevOp;
use super::ipc::Ipc;
use super::proxy::Proxy;
use super::region::Region;
use super::run::DeviceRun;
use super::{check, Gpu};
use crate::algo::Collective;
use crate::comm::{byte_len, Communicator};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// A communicator's device mode (chosen at set-up, `setup.rs`).
pub(super) enum DeviceMode {
    /// Pinned host staging into the host engine.
    Proxy(Proxy),
    /// CUDA IPC between the ranks of one host.
    Ipc(Ipc),
}

/// The internal stream and the two events that chain it to user streams.
pub(super) struct Chain {
    pub(super) stream: sys::CUstream,
    ev_in: sys::CUevent,
    ev_out: sys::CUevent,
}

impl Chain {
    /// Creates the stream and events in the current context.
    fn new() -> Result<Chain> {
        use cudarc::driver::result::{event, stream};
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let s = stream::create(stream::StreamKind::NonBlocking).map_err(|e| super::cu_err(e.0, "cuStreamCreate"))?;
        let mut c = Chain { stream: s, ev_in: std::ptr::null_mut(), ev_out: std::ptr::null_mut() };
        c.ev_in = event::create(flags).map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
        c.ev_out = event::create(flags).map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
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
            for e in [self.ev_in, self.ev_out] {
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
        let _ = std::thread::Builder::new().name("oxccl-cuda-janitor".into()).spawn(|| loop {
            std::thread::sleep(Duration::from_millis(500));
            prune();
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
    let chain = Chain::new()?;
    let mode = super::setup::choose_mode(comm, gpu, chain.stream)?;
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

/// All-reduce on device (or managed) buffers of GPU `ordinal`, ordered on `stream` (`ncclAllReduce`
/// on device memory): enqueues the work and returns without waiting for it (`enqueue` of
/// one plain all-reduce).
///
/// `send` and `recv` are device addresses (`CUdeviceptr`, the pointer values of the C API).
///
/// # Safety
/// `send` and `recv` must be device-accessible buffers of `count` elements of `dtype` on GPU
/// `ordinal`, valid until the stream has run the call; equal (in place) or not overlapping.
/// `stream` must be a stream of that GPU's primary context, or NULL.
#[allow(clippy::too_many_arguments)]
pub unsafe fn all_reduce(
    comm: &Arc<Communicator>,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    ordinal: i32,
    stream: *mut c_void,
) -> Result<()> {
    byte_len(count, dtype)?;
    let o = DevOp { coll: Collective::AllReduce, send, recv, count, dtype, op, scale: None };
    // SAFETY: forwarded from this function's contract.
    unsafe { enqueue(comm, ordinal, &[(o, stream)]) }
}

/// The GPU of `comm`'s device calls, once its first one has run.
pub(crate) fn ordinal_of(comm: &Arc<Communicator>) -> Option<i32> {
    let map = lock(registry());
    let e = map.get(&(Arc::as_ptr(comm) as usize))?;
    e.comm.ptr_eq(&Arc::downgrade(comm)).then(|| lock(&e.state).ordinal)
}

/// Checks a user stream (of `gpu`'s context) and answers whether it is capturing a CUDA graph.
fn check_user_stream(gpu: &Gpu, stream: sys::CUstream) -> Result<bool> {
    check_stream(gpu, stream)?;
    let mut capture = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is the caller's stream handle (or NULL); writes the status.
    check(unsafe { sys::cuStreamIsCapturing(stream, &mut capture) }, "cuStreamIsCapturing")?;
    match capture {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(false),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(true),
        _ => Err(Error::invalid_usage("the stream's CUDA graph capture was invalidated")),
    }
}

/// Enqueues device calls of `comm` on GPU `ordinal`: one call, or one communicator's part of a
/// group, each call with its user stream (`calls[i].1`). The streams are checked here; the
/// calls then run as one [`DeviceRun`] through [`Communicator::dispatch`] (a device session:
/// usability, the device guard, the flight record, failing the communicator on an enqueue
/// error), which takes the route [`crate::algo::select::device`] gives them with the
/// communicator's mode known. Calls that all move nothing return at once.
///
/// # Safety
/// Each call's buffers must be device-accessible buffers on GPU `ordinal` holding what its
/// collective uses on this rank, valid until its stream has run it; every stream must be a
/// stream of that GPU's primary context, or NULL.
pub(crate) unsafe fn enqueue(comm: &Arc<Communicator>, ordinal: i32, calls: &[(DevOp, *mut c_void)]) -> Result<()> {
    let gpu = super::gpu(ordinal)?;
    let _ctx = gpu.enter()?;
    let mut streams: Vec<sys::CUstream> = Vec::with_capacity(calls.len());
    let mut captured = false;
    for (_, s) in calls {
        let s = *s as sys::CUstream;
        captured |= check_user_stream(&gpu, s)?;
        if !streams.contains(&s) {
            streams.push(s);
        }
    }
    if calls.iter().all(|(o, _)| o.count == 0) {
        return Ok(());
    }
    if captured && !(calls.len() == 1 && comm.size() > 1 && state_exists(comm)) {
        return Err(Error::invalid_usage(
            "CUDA graph capture of device collectives: only a single all-reduce (not in a group), on a communicator \
             of several ranks that already ran a device collective (outside the capture), can be captured",
        ));
    }
    let mut run = DeviceRun::new(comm, &gpu, calls, streams, captured);
    // SAFETY: forwarded from this function's contract.
    unsafe { comm.dispatch(&mut run) }
}

/// One communicator's part of a group: (communicator, GPU ordinal, calls with their streams).
pub(crate) type GroupPart = (Arc<Communicator>, i32, Vec<(DevOp, *mut c_void)>);

/// A group part that may cross to an enqueue thread (its raw stream handles are plain values).
struct SendPart<'a>(&'a GroupPart);
// SAFETY: the part's pointers are stream handles and device addresses, usable from any thread
// (`enqueue` makes the GPU's context current there); the caller waits for the thread.
unsafe impl Send for SendPart<'_> {}

impl<'a> SendPart<'a> {
    /// The part (a method, so that a closure captures the whole `SendPart`, not its field).
    fn get(self) -> &'a GroupPart {
        self.0
    }
}

/// Enqueues a group's parts whose device state is `ready` (as [`set_up_together`] said), and
/// returns the first error (the other parts are still enqueued: their peers expect them).
/// When two or more parts use one GPU, each part is enqueued by a thread of its own with their
/// barriers in lockstep (`lockstep.rs`: no barrier wait sits in front of the write it waits
/// for, whatever the number of hardware queues).
///
/// # Safety
/// As [`enqueue`], for every part.
pub(crate) unsafe fn enqueue_group(parts: &[GroupPart], ready: Vec<Result<()>>) -> Result<()> {
    let shared_gpu = parts.iter().enumerate().any(|(i, p)| parts[..i].iter().any(|q| q.1 == p.1));
    let results: Vec<Result<()>> = if shared_gpu && parts.len() > 1 {
        let jobs = parts
            .iter()
            .zip(ready)
            .map(|(p, ready)| {
                let part = SendPart(p);
                super::lockstep::Part(Box::new(move || {
                    let p = part.get();
                    // SAFETY: forwarded from this function's contract.
                    ready.and_then(|()| unsafe { enqueue(&p.0, p.1, &p.2) })
                }))
            })
            .collect();
        super::lockstep::enqueue_group(jobs)
    } else {
        parts
            .iter()
            .zip(ready)
            // SAFETY: forwarded from this function's contract.
            .map(|(p, ready)| ready.and_then(|()| unsafe { enqueue(&p.0, p.1, &p.2) }))
            .collect()
    };
    results.into_iter().find(Result::is_err).unwrap_or(Ok(()))
}

/// Whether `comm` has its device state (a device collective ran on it).
fn state_exists(comm: &Arc<Communicator>) -> bool {
    let map = lock(registry());
    map.get(&(Arc::as_ptr(comm) as usize)).is_some_and(|e| e.comm.ptr_eq(&Arc::downgrade(comm)))
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
fn check_stream(gpu: &Gpu, stream: sys::CUstream) -> Result<()> {
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
