//! The call layer: one description of a collective or point-to-point call ([`Call`]), checked
//! once, then run now ([`run`]) or collected in a group ([`Batch`], the per-thread nested group
//! of [`start_group`] / [`end_group`], and the scoped [`group()`]). The C ABI (`crate::ffi`)
//! and the Rust API ([`crate::api`]) both submit through here, so they have the same features:
//! host or device buffers, built-in operators or PreMulSum, groups of both, nonblocking
//! creation ([`CommInit`], with the policy of where a constructor runs: [`create`]).
//!
//! A call is checked once (`check`): its buffers are classified (host or GPU memory, from the
//! buffers this rank uses: [`Communicator::target`]); a host call is checked and planned by
//! [`Communicator::prepare`] (after PreMulSum's pre-scaled copy, [`premul`]); a device call is
//! checked on its addresses without a plan and handed to the device executors
//! ([`crate::device`]) as a [`DevOp`].

mod batch;
mod init;
pub mod memory;
pub mod premul;
mod scope;
mod target;
mod thread;

pub use crate::algo::Collective;
pub use crate::bootstrap::UniqueId;
pub use crate::comm::Communicator;
pub use crate::device::{Scalar, Target};
pub use batch::Batch;
pub use init::{create, now_or_at_group_end, CommInit, Created, InitState};
pub use scope::{group, Group, GroupComm};
pub use thread::{defer, depth as group_depth, end_group, start_group, Deferred};

use crate::coll::Op;
use crate::device::DevOp;
use crate::error::Result;
use crate::types::{DataType, ReduceOp};
use std::ffi::c_void;
use std::sync::Arc;

/// How a reducing call combines the ranks' inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reduction {
    /// One of NCCL's built-in operators.
    Builtin(ReduceOp),
    /// `sum(scalar * x_r)` over ranks `r` ([`premul`]).
    PreMulSum(Scalar),
}

impl From<ReduceOp> for Reduction {
    fn from(op: ReduceOp) -> Reduction {
        Reduction::Builtin(op)
    }
}

impl Reduction {
    /// The operator the executors apply (`Sum` for PreMulSum, whose factor is applied first).
    pub fn op(self) -> ReduceOp {
        match self {
            Reduction::Builtin(op) => op,
            Reduction::PreMulSum(_) => ReduceOp::Sum,
        }
    }

    /// The PreMulSum factor, if any.
    pub fn scale(self) -> Option<Scalar> {
        match self {
            Reduction::Builtin(_) => None,
            Reduction::PreMulSum(s) => Some(s),
        }
    }
}

/// One collective or point-to-point call of this rank, as `ncclAllReduce` ... `ncclRecv` take
/// it. Buffers are addresses of host or GPU memory (classified when the call is checked);
/// those the collective does not use on this rank may be NULL.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// The collective, with its root or peer.
    pub coll: Collective,
    /// This rank's send buffer.
    pub send: *const c_void,
    /// This rank's receive buffer.
    pub recv: *mut c_void,
    /// NCCL's count argument (per rank: see [`Communicator::prepare`]).
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (ignored by collectives that do not reduce).
    pub reduction: Reduction,
    /// A CUDA stream (`cudaStream_t`), or NULL: device calls are enqueued on it; host calls
    /// synchronise it first.
    pub stream: *mut c_void,
}

impl Call {
    /// A call on `coll` with no buffers, `Sum` and no stream: set the fields that matter.
    pub fn new(coll: Collective, count: usize, dtype: DataType) -> Call {
        Call {
            coll,
            send: std::ptr::null(),
            recv: std::ptr::null_mut(),
            count,
            dtype,
            reduction: Reduction::Builtin(ReduceOp::Sum),
            stream: std::ptr::null_mut(),
        }
    }

    /// The call as the device executors take it.
    fn dev_op(&self) -> DevOp {
        DevOp {
            coll: self.coll,
            send: self.send as u64,
            recv: self.recv as u64,
            count: self.count,
            dtype: self.dtype,
            op: self.reduction.op(),
            scale: self.reduction.scale(),
        }
    }
}

/// A checked call, ready to run or to queue.
pub(crate) enum Checked<'a> {
    /// Host buffers: the planned operation (owning a PreMulSum copy).
    Host(Op<'a>),
    /// Device buffers of GPU `ordinal`, enqueued on `stream`.
    Device { ordinal: i32, op: DevOp, stream: *mut c_void },
}

/// Checks a call once: where it runs ([`Communicator::target`], which synchronises the stream
/// of a host call), then the checks of its executor: a host call is planned (with PreMulSum's
/// scaled copy); a device call is checked on its addresses.
///
/// # Safety
/// As [`run`], for the lifetime `'a` of the result.
pub(crate) unsafe fn check<'a>(comm: &Communicator, call: &Call) -> Result<Checked<'a>> {
    match comm.target(call.coll, call.send, call.recv, call.count, call.stream)? {
        Target::Device { ordinal } => {
            device_op(comm, call).map(|op| Checked::Device { ordinal, op, stream: call.stream })
        }
        // SAFETY: forwarded from this function's contract.
        Target::Host => unsafe { host_op(comm, call) }.map(Checked::Host),
    }
}

/// A call on device buffers, checked on its addresses (no plan), as the device executors take it.
fn device_op(comm: &Communicator, call: &Call) -> Result<DevOp> {
    comm.check_call(call.coll, call.send.cast(), call.recv.cast(), call.count, call.dtype)?;
    Ok(call.dev_op())
}

/// The planned operation of a call on host buffers (no classification: the caller knows them
/// to be host memory).
///
/// # Safety
/// As [`Communicator::prepare`], for the lifetime `'a` of the op.
pub(crate) unsafe fn host_op<'a>(comm: &Communicator, call: &Call) -> Result<Op<'a>> {
    // SAFETY: forwarded from this function's contract.
    let (send, scaled) = unsafe { premul::scaled_send(comm, call) }?;
    // SAFETY: forwarded; a scaled copy is owned by the op, so it lives as long as the op.
    let mut op =
        unsafe { comm.prepare(call.coll, send, call.recv.cast(), call.count, call.dtype, call.reduction.op())? };
    op.scaled = scaled;
    Ok(op)
}

/// Runs one call now, outside any group: device buffers are enqueued on the call's stream
/// (returns before they complete), host buffers run now, after the stream is synchronised.
///
/// # Safety
/// `call.send` and `call.recv` address buffers holding what the collective uses on this rank
/// (readable / writable), valid and otherwise untouched until the call completed (for device
/// buffers: until its stream has run it); `call.stream` is a stream of the buffers' GPU, or
/// NULL.
pub unsafe fn run(comm: &Arc<Communicator>, call: &Call) -> Result<()> {
    match comm.target(call.coll, call.send, call.recv, call.count, call.stream)? {
        Target::Device { ordinal } => {
            let op = device_op(comm, call)?;
            // SAFETY: forwarded from this function's contract.
            unsafe { crate::device::enqueue(comm, ordinal, &[(op, call.stream)]) }
        }
        Target::Host => {
            // SAFETY: forwarded from this function's contract.
            let (send, scaled) = unsafe { premul::scaled_send(comm, call) }?;
            // SAFETY: forwarded; `scaled` outlives the call. `run_raw` is `check`'s host path
            // (`prepare`) run at once, without an op for a plan-less all-reduce.
            let r =
                unsafe { comm.run_raw(call.coll, send, call.recv.cast(), call.count, call.dtype, call.reduction.op()) };
            drop(scaled);
            r
        }
    }
}

/// Runs `call` now, or adds it to this thread's open group ([`start_group`]), where it is
/// checked at once and runs at the outermost [`end_group`]: what `ncclAllReduce` ... `ncclRecv`
/// do.
///
/// # Safety
/// As [`run`]; in a group, until the outermost [`end_group`] has returned (for device buffers:
/// until the stream has run the group).
pub unsafe fn submit(comm: &Arc<Communicator>, call: &Call) -> Result<()> {
    if thread::depth() > 0 {
        // SAFETY: forwarded from this function's contract.
        return thread::with_batch(|b| unsafe { b.add(comm, call) });
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { run(comm, call) }
}

impl Communicator {
    /// Runs a call on device buffers (or host buffers) with a stream now, outside any group:
    /// [`run`] for a [`DevOp`].
    ///
    /// # Safety
    /// As [`run`].
    pub unsafe fn launch(self: &Arc<Self>, op: DevOp, stream: *mut c_void) -> Result<()> {
        let reduction = match op.scale {
            Some(s) => Reduction::PreMulSum(s),
            None => Reduction::Builtin(op.op),
        };
        let call = Call {
            coll: op.coll,
            send: op.send as *const c_void,
            recv: op.recv as *mut c_void,
            count: op.count,
            dtype: op.dtype,
            reduction,
            stream,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { run(self, &call) }
    }
}
