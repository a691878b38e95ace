//! The raw-pointer entry points of the host collectives (`ncclAllReduce` and the others on
//! host memory), used by the call layer and oxccl-perf: each checks its call and runs it, on a
//! plan-less path ([`algo::select::path`]) or on its plan.

use super::*;

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
        unsafe { self.run_raw(Collective::AllReduce, send, recv, count, dtype, op) }
    }

    /// Checks and runs one call on raw pointers (see [`Communicator::prepare`]).
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
        let path = self.host_path(coll, count, dtype);
        if path.planless() {
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.planless_raw(send, recv, count, dtype, op, path) };
        }
        // SAFETY: forwarded from this function's contract.
        let op = unsafe { self.prepare(coll, send, recv, count, dtype, op)? };
        self.run(op)
    }

    /// An all-reduce on the plan-less `path` ([`algo::select::path`]) from raw pointers, with
    /// `prepare`'s checks of an all-reduce and no `Op` (no plan, no reference count).
    ///
    /// # Safety
    /// As [`Communicator::prepare`].
    unsafe fn planless_raw(
        &self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        path: algo::select::Path,
    ) -> Result<()> {
        // The length is checked before any use: a count whose byte length wraps must not
        // reach the host arena, which takes every size on a crowded host.
        let checked = (|| {
            let len = check_len(count, dtype, self.size())?;
            let bufs = Buffers { send, send_len: len, recv, recv_len: len };
            check_null(&bufs, count)?;
            check_overlap(&bufs)?;
            Ok(bufs)
        })();
        let bufs = checked.map_err(|e: Error| self.record(e.context(Collective::AllReduce.name())))?;
        let call = Operands { bufs, dtype, op };
        // SAFETY: the buffers were checked above; the caller guarantees the rest.
        unsafe { self.run_planless(&call, count, path) }
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
