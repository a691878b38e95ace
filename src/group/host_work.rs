//! The device layer's way into host calls: [`HostWork`], the host work done on behalf of a
//! device call (the CUDA proxy's host plans, a device window's handle exchange).
//!
//! A user's host call first waits for the communicator's device work in flight (the host fence
//! of `Communicator::check_usable`), so that host and device calls reach the links in the order
//! they were issued. The host work of a device call is part of that device work: were it to
//! wait for it, it would wait for itself. So the device layer never calls the public API for
//! it; it calls the same executors through this handle, which passes [`Caller::Device`] down
//! to the session instead of the public API's [`Caller::User`].

use super::run_one;
use crate::coll::Op;
use crate::comm::{Caller, Communicator};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// Host calls made on a communicator for one of its device calls: they run as the public API's
/// calls do, except that they never wait for the communicator's device work in flight.
#[derive(Clone, Copy)]
pub(crate) struct HostWork<'c> {
    comm: &'c Communicator,
}

impl Communicator {
    /// The host work of a device call on this communicator ([`HostWork`]). Only the device
    /// layer calls this, from the work of a device call (its proxy thread, or the call itself
    /// while it holds the communicator's device state).
    pub(crate) fn device_host_call(&self) -> HostWork<'_> {
        HostWork { comm: self }
    }
}

impl HostWork<'_> {
    /// [`Communicator::all_reduce_raw`], without waiting for the device work in flight.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw`].
    pub(crate) unsafe fn all_reduce_raw(
        &self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let all_reduce = crate::algo::Collective::AllReduce;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.comm.run_raw_for(Caller::Device, all_reduce, send, recv, count, dtype, op) }
    }

    /// `Communicator::all_reduce_slices`, without waiting for the device work in flight.
    pub(crate) fn all_reduce_slices<T: crate::Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.comm.all_reduce_slices_for(Caller::Device, send, recv, op)
    }

    /// Runs `ops`, prepared on this communicator, as one group ([`crate::group::run`] of one
    /// communicator), without waiting for the device work in flight.
    pub(crate) fn run_group(&self, ops: Vec<Op<'_>>) -> Result<()> {
        if ops.is_empty() {
            return Err(Error::internal("an empty group of host work for a device call"));
        }
        run_one(self.comm, ops, Caller::Device)
    }
}
