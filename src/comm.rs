//! The communicator: rank, size, links to peers, and the collective entry points.
use crate::bootstrap::UniqueId;
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};
use crate::Element;

/// A communicator: one rank's membership in a group of `size` ranks.
pub struct Communicator {
    rank: usize,
    size: usize,
}

impl Communicator {
    /// Joins the group described by `id` as `rank` of `nranks` (`ncclCommInitRank`).
    pub fn init_rank(nranks: usize, id: &UniqueId, rank: usize) -> Result<Communicator> {
        let _ = (nranks, id, rank);
        Err(Error::internal("not yet"))
    }
    /// Joins the group described by the launcher's environment (see `bootstrap::env`).
    pub fn from_env() -> Result<Communicator> {
        Err(Error::internal("not yet"))
    }
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Out-of-place all-reduce of typed slices.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let _ = (send, recv, op);
        Err(Error::internal("not yet"))
    }
    /// In-place all-reduce of a typed slice.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let _ = (buf, op);
        Err(Error::internal("not yet"))
    }
    /// All-reduce on raw pointers (`ncclAllReduce` on host memory).
    ///
    /// # Safety
    /// `send` must be readable and `recv` writable for `count * dtype.size()` bytes; they may be
    /// equal (in place) but must not otherwise overlap.
    pub unsafe fn all_reduce_raw(&self, send: *const u8, recv: *mut u8, count: usize, dtype: DataType, op: ReduceOp) -> Result<()> {
        let _ = (send, recv, count, dtype, op);
        Err(Error::internal("not yet"))
    }
}
