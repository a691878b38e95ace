//! The raw-pointer entry points of the host collectives on host memory, for Rust callers and
//! oxccl-perf: each checks its call and runs it ([`Communicator::prepare`], then
//! [`Communicator::run`]), as the call layer does for a host call.

use crate::algo::Collective;
use crate::comm::{Caller, Communicator};
use crate::engine::Operands;
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

impl Communicator {
    /// All-reduce on raw pointers (`ncclAllReduce` on host memory).
    ///
    /// # Safety
    /// `send` must be readable and `recv` writable for `count * dtype.size()` bytes; they may be
    /// equal (in place) but must not otherwise overlap.
    pub unsafe fn all_reduce_raw(
        &self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.run_raw_for(Caller::User, Collective::AllReduce, send, recv, count, dtype, op) }
    }

    /// Checks and runs one call on raw pointers: [`Communicator::prepare`], then
    /// [`Communicator::run`]; a call on a plan-less path ([`crate::algo::select::path`]: the
    /// lane or the arena) has the same checks (`Communicator::check_args`) and runs on its path
    /// without an [`Op`](crate::coll::Op).
    ///
    /// # Safety
    /// As [`Communicator::prepare`], for the duration of the call.
    pub unsafe fn run_raw(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.run_raw_for(Caller::User, coll, send, recv, count, dtype, op) }
    }

    /// [`Communicator::run_raw`] for `caller` (whether the call waits for the communicator's
    /// device work in flight: [`Caller`]).
    ///
    /// # Safety
    /// As [`Communicator::run_raw`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run_raw_for(
        &self,
        caller: Caller,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let path = self.host_path(coll, count, dtype);
        if path.planless() {
            let checked = self.check_args(coll, send, recv, count, dtype);
            let (bufs, _, _) = checked.map_err(|e| self.record(e.context(coll.name())))?;
            // SAFETY: the buffers were checked above; the caller guarantees the rest.
            return unsafe { self.run_planless(&Operands { bufs, dtype, op }, count, path, caller) };
        }
        // SAFETY: forwarded from this function's contract.
        let op = unsafe { self.prepare(coll, send, recv, count, dtype, op)? };
        self.run_for(op, caller)
    }

    /// All-reduce of typed slices of one length now, outside any group: host work the library
    /// does on a communicator itself (device set-up) runs on this, never on the public API.
    pub(crate) fn all_reduce_slices<T: crate::Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_slices_for(Caller::User, send, recv, op)
    }

    /// [`Communicator::all_reduce_slices`] for `caller` (whether the call waits for the
    /// communicator's device work in flight: [`Caller`]).
    pub(super) fn all_reduce_slices_for<T: crate::Element>(
        &self,
        caller: Caller,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if send.len() != recv.len() {
            let e = Error::invalid_argument(format!("send has {} elements, recv {}", send.len(), recv.len()));
            return Err(self.record(e.context(Collective::AllReduce.name())));
        }
        let (s, r) = (send.as_ptr().cast(), recv.as_mut_ptr().cast());
        // SAFETY: both slices are valid and distinct (one is borrowed mutably) for the call.
        unsafe { self.run_raw_for(caller, Collective::AllReduce, s, r, send.len(), T::DTYPE, op) }
    }

    /// `ncclReduce` on host memory: the reduction of every rank's `send` into `root`'s `recv`
    /// (`recv` only matters at the root).
    ///
    /// # Safety
    /// As [`Communicator::prepare`].
    pub unsafe fn reduce_raw(
        &self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.run_raw(Collective::Reduce { root }, send, recv, count, dtype, op) }
    }

    /// `ncclReduceScatter` on host memory: block `rank` (`recvcount` elements) of the reduction
    /// of every rank's `send` (`nranks * recvcount` elements).
    ///
    /// # Safety
    /// As [`Communicator::prepare`].
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: *const u8,
        recv: *mut u8,
        recvcount: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.run_raw(Collective::ReduceScatter, send, recv, recvcount, dtype, op) }
    }
}
