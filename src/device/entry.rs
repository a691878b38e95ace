//! The entry points of device calls ([`enqueue`], [`enqueue_group`], and [`all_reduce`] for
//! one plain all-reduce): the user streams are checked here, then the calls run as one
//! `DeviceRun` (`run.rs`) through [`Communicator::dispatch`]. Above `state.rs` (the
//! per-communicator state) and `run.rs` (the executor), which name nothing here.

use super::capture::CAPTURABLE;
use super::exec::DevOp;
use super::run::DeviceRun;
use super::state::check_stream;
use super::{check, Gpu};
use crate::algo::Collective;
use crate::comm::{byte_len, Communicator};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::Arc;

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

/// Checks a user stream (of `gpu`'s context) and answers whether it is capturing a CUDA graph:
/// `Some(id)` of the capture (0 when the driver lacks `cuStreamGetCaptureInfo_v3`, before
/// CUDA 12.3), or `None`.
fn check_user_stream(gpu: &Gpu, stream: sys::CUstream) -> Result<Option<u64>> {
    static HAS_INFO: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    check_stream(gpu, stream)?;
    let mut capture = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    if *HAS_INFO.get_or_init(|| super::driver_has(c"cuStreamGetCaptureInfo_v3")) {
        use std::ptr::null_mut;
        // SAFETY: `stream` is the caller's stream handle (or NULL); writes the status and the
        // id (the other outputs are not asked for). The symbol exists (checked above).
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream,
                &mut capture,
                &mut id,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
            )
        };
        check(r, "cuStreamGetCaptureInfo")?;
    } else {
        // SAFETY: as above; writes the status.
        check(unsafe { sys::cuStreamIsCapturing(stream, &mut capture) }, "cuStreamIsCapturing")?;
    }
    match capture {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(None),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Some(id)),
        _ => Err(Error::invalid_usage("the stream's CUDA graph capture was invalidated")),
    }
}

/// Refuses captured calls that cannot be captured (before anything runs, so the communicator
/// stays usable): `captures` holds each distinct stream's capture (`check_user_stream`), at
/// least one of them `Some`. Every stream must be in one capture, no call a send or receive
/// (on one rank: every call an all-reduce), and not under `OXCCL_DETERMINISTIC` (whose fixed
/// order takes the staged path). Whether each call has a capturable flow is known once the
/// device state is (`DeviceRun::captured`).
fn check_captured(comm: &Communicator, calls: &[(DevOp, *mut c_void)], captures: &[Option<u64>]) -> Result<()> {
    let rank = comm.rank();
    if captures.iter().any(Option::is_none) {
        return Err(Error::invalid_usage(format!(
            "rank {rank}: a group's streams are either all capturing a CUDA graph or none: some are, some are not"
        )));
    }
    if captures.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::invalid_usage(format!(
            "rank {rank}: a group's streams are capturing different CUDA graphs (one capture must hold them all)"
        )));
    }
    let moving = || calls.iter().map(|(o, _)| o).filter(|o| o.count > 0);
    let refused = |o: &&DevOp| match o.coll {
        Collective::Send { .. } | Collective::Recv { .. } => true,
        Collective::AllReduce => false,
        _ => comm.size() == 1,
    };
    if let Some(o) = moving().find(refused) {
        return Err(Error::invalid_usage(format!("rank {rank}: {CAPTURABLE}; this call is a {}", o.coll.name())));
    }
    if comm.size() > 1 && comm.deterministic() {
        return Err(Error::invalid_usage(format!(
            "rank {rank}: {CAPTURABLE}; OXCCL_DETERMINISTIC runs reductions in a fixed order on the staged path, \
             which cannot be captured"
        )));
    }
    Ok(())
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
    let mut captures: Vec<Option<u64>> = Vec::with_capacity(calls.len());
    for (_, s) in calls {
        let s = *s as sys::CUstream;
        if !streams.contains(&s) {
            captures.push(check_user_stream(&gpu, s)?);
            streams.push(s);
        }
    }
    if calls.iter().all(|(o, _)| o.count == 0) {
        return Ok(());
    }
    let captured = captures.iter().any(Option::is_some);
    if captured {
        check_captured(comm, calls, &captures)?;
    }
    let mut run = DeviceRun::new(comm, &gpu, calls, streams, captured);
    // A user's call (a device session takes no fence whoever calls).
    // SAFETY: forwarded from this function's contract.
    unsafe { comm.dispatch(&mut run, crate::comm::Caller::User) }
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
