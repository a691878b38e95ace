//! Calls with a CUDA stream: where each one runs, decided in one place for the C ABI and the
//! Rust API.
//!
//! A call is classified from the buffers this rank uses ([`Collective::buffer_counts`]: the send
//! buffer of a non-root broadcast or scatter rank and the receive buffer of a non-root reduce or
//! gather rank are never looked at). Host buffers run on the host path (after synchronising a
//! non-null stream); device buffers are checked like host calls ([`Communicator::prepare`] on
//! their addresses) and enqueued on the stream by the device executors ([`crate::device`]), at
//! once or, inside a group, at its end ([`StreamGroup`]).

use crate::algo::Collective;
use crate::comm::Communicator;
use crate::device::{DevOp, Scale};
use crate::error::{Error, Result};
use crate::types::ReduceOp;
use std::ffi::c_void;
use std::sync::Arc;

/// Where a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Host memory: the blocking host path.
    Host,
    /// Device (or managed) memory of GPU `ordinal`: stream-ordered device work.
    Device {
        /// The GPU holding the buffers.
        ordinal: i32,
    },
}

impl Communicator {
    /// Decides where a call runs from the buffers this rank uses, and for host buffers
    /// synchronises a non-null `stream` (when CUDA is loaded) so the host sees earlier GPU work,
    /// and waits for this communicator's device calls still run by its proxy thread (so the
    /// host call cannot interleave with them on the links).
    ///
    /// Buffers of different kinds (host and device, or two GPUs) are `ncclInvalidArgument`.
    pub fn target(
        &self,
        coll: Collective,
        send: *const c_void,
        recv: *const c_void,
        count: usize,
        stream: *mut c_void,
    ) -> Result<Target> {
        let (sc, rc) = coll.buffer_counts(self.rank(), self.size(), count);
        let send = if sc > 0 { send } else { std::ptr::null() };
        let recv = if rc > 0 { recv } else { std::ptr::null() };
        Ok(match crate::device::route(send, recv, stream)? {
            crate::device::Route::Host => {
                if crate::device::driver_loaded() {
                    crate::device::quiesce(self)?;
                }
                Target::Host
            }
            crate::device::Route::Device { ordinal } => Target::Device { ordinal },
        })
    }

    /// Checks a device call as a host call is checked (roots and peers in range, buffers
    /// present, sizes, overlap outside NCCL's in-place layouts), on its addresses.
    pub fn check_device_call(&self, op: &DevOp) -> Result<()> {
        // SAFETY: the op is only planned, never run: the addresses are not accessed.
        unsafe { self.prepare(op.coll, op.send as *const u8, op.recv as *mut u8, op.count, op.dtype, op.op) }.map(drop)
    }

    /// Runs any collective or point-to-point call with a stream, as `ncclAllReduce` ...
    /// `ncclRecv` do: device buffers are enqueued on `stream` (returns before they complete),
    /// host buffers run now, after `stream` is synchronised. A send or receive outside a group
    /// on device buffers pairs with the peer's; pair exchanges in a [`StreamGroup`].
    ///
    /// # Safety
    /// `op.send` and `op.recv` are the addresses of buffers holding what the collective uses on
    /// this rank (readable / writable), valid and otherwise untouched until the call completed
    /// (for device buffers: until `stream` has run it); `stream` is a stream of the buffers'
    /// GPU, or NULL.
    pub unsafe fn launch(self: &Arc<Self>, op: DevOp, stream: *mut c_void) -> Result<()> {
        match self.target(op.coll, op.send as *const c_void, op.recv as *const c_void, op.count, stream)? {
            Target::Device { ordinal } => {
                self.check_device_call(&op)?;
                // SAFETY: forwarded from this function's contract.
                unsafe { crate::device::enqueue(self, ordinal, &[(op, stream)]) }
            }
            Target::Host => {
                let mut scaled: Vec<u64> = Vec::new();
                let send = match op.scale {
                    None => op.send as *const u8,
                    Some(Scale::Host(f)) => {
                        let (sc, _) = op.coll.buffer_counts(self.rank(), self.size(), op.count);
                        let bytes = crate::comm::byte_len(sc, op.dtype)?;
                        if bytes > 0 && op.send == 0 {
                            return Err(Error::invalid_argument("sendbuff is NULL"));
                        }
                        scaled = vec![0u64; bytes.div_ceil(8)];
                        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut scaled)[..bytes];
                        if bytes > 0 {
                            // SAFETY: the send buffer holds `bytes` (the contract).
                            buf.copy_from_slice(unsafe { std::slice::from_raw_parts(op.send as *const u8, bytes) });
                        }
                        crate::reduce::scale(op.dtype, buf, f);
                        scaled.as_ptr().cast()
                    }
                    Some(Scale::Device(_)) => return Err(device_scalar_on_host()),
                };
                let red = if op.scale.is_some() { ReduceOp::Sum } else { op.op };
                // SAFETY: forwarded from this function's contract; `scaled` outlives the call.
                let r = unsafe { self.run_raw(op.coll, send, op.recv as *mut u8, op.count, op.dtype, red) };
                drop(scaled);
                r
            }
        }
    }
}

/// The error of a PreMulSum scalar in GPU memory on a call with host buffers.
pub(crate) fn device_scalar_on_host() -> Error {
    Error::invalid_usage("a PreMulSum scalar in GPU memory (ncclScalarDevice) needs device buffers")
}

/// Device calls collected by an open group (`ncclGroupStart` / `ncclGroupEnd`), enqueued
/// together at its end: per communicator, one job that runs the calls' plans merged (as a
/// host group), on the internal stream joined with every stream of those calls.
#[derive(Default)]
pub struct StreamGroup {
    calls: Vec<(Arc<Communicator>, i32, DevOp, *mut c_void)>,
}

impl StreamGroup {
    /// Queues a checked device call of `comm` on GPU `ordinal` (see [`Communicator::target`]).
    ///
    /// # Safety
    /// As [`Communicator::launch`], until the stream has run the group.
    pub unsafe fn push(&mut self, comm: Arc<Communicator>, ordinal: i32, op: DevOp, stream: *mut c_void) {
        self.calls.push((comm, ordinal, op, stream));
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Enqueues everything queued, per communicator in issue order, after setting up the device
    /// state of every communicator that has none yet, together; returns the first error (the
    /// other communicators' parts are still enqueued: their peers expect them).
    pub fn run(self) -> Result<()> {
        type Part = (Arc<Communicator>, i32, Vec<(DevOp, *mut c_void)>);
        let mut parts: Vec<Part> = Vec::new();
        for (c, ordinal, op, s) in self.calls {
            match parts.iter_mut().find(|(k, _, _)| Arc::ptr_eq(k, &c)) {
                Some((_, o, v)) if *o == ordinal => v.push((op, s)),
                Some(_) => {
                    return Err(Error::invalid_argument(format!(
                        "rank {}: a group's device calls on one communicator must use one GPU",
                        c.rank()
                    )))
                }
                None => parts.push((c, ordinal, vec![(op, s)])),
            }
        }
        // Device state first, for every communicator of the group at once (its creation is
        // collective: one thread driving several ranks would otherwise wait on itself).
        let keys: Vec<(Arc<Communicator>, i32)> = parts.iter().map(|(c, o, _)| (c.clone(), *o)).collect();
        let ready = crate::device::set_up_together(&keys);
        let mut first = Ok(());
        for ((c, ordinal, calls), ready) in parts.into_iter().zip(ready) {
            let r = match ready {
                // SAFETY: the contract of `push`.
                Ok(()) => unsafe { crate::device::enqueue(&c, ordinal, &calls) },
                Err(e) => Err(e),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
