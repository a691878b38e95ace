//! The safe Rust API: every collective on typed slices, run at once on a [`Communicator`] or
//! queued in a group ([`group`](fn@crate::group)).
//!
//! Every call is a [`crate::call::Call`] on host memory, checked and planned by the call layer
//! as the C ABI's are; reductions are built-in operators or PreMulSum (the `*_with` methods).
//! Device buffers and streams: [`crate::call::run`] / [`crate::call::submit`] with a `Call`.
//!
//! Buffers are slices of an [`Element`] type (`f32`, `i64`, `half::bf16`, ...). Counts come from
//! the slice lengths: as in NCCL, per rank (all-gather's input, reduce-scatter's output,
//! all-to-all's block per peer). Buffers that a collective ignores on this rank (a non-root
//! rank's receive buffer of `reduce`, ...) may be empty. The `*_in_place` forms take one
//! buffer in NCCL's in-place layout (for all-gather, this rank's input sits at block `rank`).
//!
//! ```no_run
//! use oxccl::{Collectives, Communicator, ReduceOp};
//! let comm = Communicator::from_env()?;
//! let mut weights = vec![0f32; 1024];
//! comm.broadcast_in_place(&mut weights, 0)?; // everyone starts from rank 0's weights
//! let mut grads = vec![1f32; 1024];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! let mut everyone = vec![0u32; comm.size()];
//! comm.all_gather(&[comm.rank() as u32], &mut everyone)?;
//! # Ok::<(), oxccl::Error>(())
//! ```

use crate::call::{Call, Collective, Reduction};
use crate::coll::Op;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::ReduceOp;
use crate::Element;

/// The buffers of a typed call.
enum Bufs<'a, T> {
    /// Separate send and receive slices.
    Two(&'a [T], &'a mut [T]),
    /// One slice in NCCL's in-place layout.
    One(&'a mut [T]),
}

/// Builds a checked [`Op`] from typed slices.
fn typed<'a, T: Element>(
    comm: &Communicator,
    coll: Collective,
    bufs: Bufs<'a, T>,
    op: impl Into<Reduction>,
) -> Result<Op<'a>> {
    let (rank, n) = (comm.rank(), comm.size());
    let per_rank = |len: usize| -> Result<usize> {
        if len % n != 0 {
            return Err(Error::invalid_argument(format!(
                "{}: buffer of {len} elements is not a multiple of {n} ranks",
                coll.name()
            )));
        }
        Ok(len / n)
    };
    let blocked = matches!(
        coll,
        Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather { .. }
            | Collective::Scatter { .. }
    );
    let (send, recv, count): (*const T, *mut T, usize) = match bufs {
        Bufs::One(buf) => {
            let count = if blocked { per_rank(buf.len())? } else { buf.len() };
            let (p, own) = (buf.as_mut_ptr(), rank * count);
            // Where this rank's input and output sit in the one buffer (NCCL's layouts).
            match coll {
                Collective::AllGather | Collective::Gather { .. } => (p.wrapping_add(own), p, count),
                Collective::ReduceScatter | Collective::Scatter { .. } => (p, p.wrapping_add(own), count),
                _ => (p, p, count),
            }
        }
        Bufs::Two(s, r) => {
            let count = match coll {
                Collective::AllReduce
                | Collective::Reduce { .. }
                | Collective::AllGather
                | Collective::Gather { .. }
                | Collective::Send { .. } => s.len(),
                Collective::AllToAll => per_rank(s.len())?,
                _ => r.len(),
            };
            let (need_s, need_r) = coll.buffer_counts(rank, n, count);
            for (what, have, need) in [("send", s.len(), need_s), ("receive", r.len(), need_r)] {
                if need > 0 && have != need {
                    return Err(Error::invalid_argument(format!(
                        "{}: {what} buffer has {have} elements, expected {need}",
                        coll.name()
                    )));
                }
            }
            (s.as_ptr(), r.as_mut_ptr(), count)
        }
    };
    let call = Call {
        coll,
        send: send.cast(),
        recv: recv.cast(),
        count,
        dtype: T::DTYPE,
        reduction: op.into(),
        stream: std::ptr::null_mut(),
    };
    // SAFETY: the pointers come from slices (host memory) borrowed for 'a (shared for the send
    // side, exclusive for the receive side); their lengths were checked against what the
    // collective uses (or, for one buffer, they address inside it by construction).
    unsafe { crate::call::host_op(comm, &call) }
}

/// Every collective on typed slices. Implemented by [`Communicator`] (runs at once) and by a
/// group's [`crate::call::GroupComm`] (queued until the group ends). `'a` is how long the
/// buffers are borrowed.
pub trait Collectives<'a> {
    /// The communicator the calls run on.
    fn communicator(&self) -> &Communicator;

    /// Runs or queues a prepared call.
    fn submit(&self, op: Op<'a>) -> Result<()>;

    /// All-reduce `send` into `recv` (same length) on every rank.
    fn all_reduce<T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllReduce, Bufs::Two(send, recv), op)?)
    }
    /// All-reduce in place.
    fn all_reduce_in_place<T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllReduce, Bufs::One(buf), op)?)
    }
    /// Broadcast `root`'s `send` into every rank's `recv` (`send` is only read at the root).
    fn broadcast<T: Element>(&self, send: &'a [T], recv: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Broadcast { root }, Bufs::Two(send, recv), ReduceOp::Sum)?)
    }
    /// Broadcast `root`'s `buf` into every rank's `buf` (`ncclBcast`).
    fn broadcast_in_place<T: Element>(&self, buf: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Broadcast { root }, Bufs::One(buf), ReduceOp::Sum)?)
    }
    /// Reduce every rank's `send` into `root`'s `recv` (`recv` is only written at the root).
    fn reduce<T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Reduce { root }, Bufs::Two(send, recv), op)?)
    }
    /// Reduce in place: `root`'s `buf` receives the reduction of every rank's `buf`.
    fn reduce_in_place<T: Element>(&self, buf: &'a mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Reduce { root }, Bufs::One(buf), op)?)
    }
    /// All-gather: `recv` (`nranks * send.len()`) gets every rank's `send`, in rank order.
    fn all_gather<T: Element>(&self, send: &'a [T], recv: &'a mut [T]) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllGather, Bufs::Two(send, recv), ReduceOp::Sum)?)
    }
    /// All-gather in place: this rank's input is block `rank` of `buf`.
    fn all_gather_in_place<T: Element>(&self, buf: &'a mut [T]) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllGather, Bufs::One(buf), ReduceOp::Sum)?)
    }
    /// Reduce-scatter: `recv` gets block `rank` of the reduction of every rank's `send`
    /// (`nranks * recv.len()` elements).
    fn reduce_scatter<T: Element>(&self, send: &'a [T], recv: &'a mut [T], op: ReduceOp) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::ReduceScatter, Bufs::Two(send, recv), op)?)
    }
    /// Reduce-scatter in place: the result is block `rank` of `buf`.
    fn reduce_scatter_in_place<T: Element>(&self, buf: &'a mut [T], op: ReduceOp) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::ReduceScatter, Bufs::One(buf), op)?)
    }
    /// All-reduce with any [`Reduction`], PreMulSum included (`sum(scalar * send)` over ranks,
    /// the scalar a [`crate::call::Scalar::Host`] value).
    fn all_reduce_with<T: Element>(&self, send: &'a [T], recv: &'a mut [T], red: Reduction) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllReduce, Bufs::Two(send, recv), red)?)
    }
    /// Reduce with any [`Reduction`] into `root`'s `recv`.
    fn reduce_with<T: Element>(&self, send: &'a [T], recv: &'a mut [T], red: Reduction, root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Reduce { root }, Bufs::Two(send, recv), red)?)
    }
    /// Reduce-scatter with any [`Reduction`].
    fn reduce_scatter_with<T: Element>(&self, send: &'a [T], recv: &'a mut [T], red: Reduction) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::ReduceScatter, Bufs::Two(send, recv), red)?)
    }
    /// All-to-all: block `p` of `send` goes to rank `p`, block `p` of `recv` comes from it
    /// (both `nranks` blocks long).
    fn all_to_all<T: Element>(&self, send: &'a [T], recv: &'a mut [T]) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllToAll, Bufs::Two(send, recv), ReduceOp::Sum)?)
    }
    /// All-to-all in place.
    fn all_to_all_in_place<T: Element>(&self, buf: &'a mut [T]) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::AllToAll, Bufs::One(buf), ReduceOp::Sum)?)
    }
    /// Gather: block `p` of `root`'s `recv` gets rank `p`'s `send` (`recv` only used at root).
    fn gather<T: Element>(&self, send: &'a [T], recv: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Gather { root }, Bufs::Two(send, recv), ReduceOp::Sum)?)
    }
    /// Gather in place: this rank's input is block `rank` of `buf`.
    fn gather_in_place<T: Element>(&self, buf: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Gather { root }, Bufs::One(buf), ReduceOp::Sum)?)
    }
    /// Scatter: rank `p`'s `recv` gets block `p` of `root`'s `send` (`send` only used at root).
    fn scatter<T: Element>(&self, send: &'a [T], recv: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Scatter { root }, Bufs::Two(send, recv), ReduceOp::Sum)?)
    }
    /// Scatter in place: this rank's output is block `rank` of `buf`.
    fn scatter_in_place<T: Element>(&self, buf: &'a mut [T], root: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Scatter { root }, Bufs::One(buf), ReduceOp::Sum)?)
    }
    /// Send `buf` to `peer` (who receives the same number of elements). Outside a group it
    /// returns once the bytes are handed to the transport; pair sends and receives in a group.
    fn send<T: Element>(&self, buf: &'a [T], peer: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Send { peer }, Bufs::Two(buf, &mut []), ReduceOp::Sum)?)
    }
    /// Receive `buf.len()` elements from `peer`.
    fn recv<T: Element>(&self, buf: &'a mut [T], peer: usize) -> Result<()> {
        self.submit(typed(self.communicator(), Collective::Recv { peer }, Bufs::Two(&[], buf), ReduceOp::Sum)?)
    }
}

impl Communicator {
    /// Out-of-place all-reduce of typed slices (`send.len()` elements; `recv` must be as long).
    /// The other collectives are in [`crate::Collectives`].
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        Collectives::all_reduce(self, send, recv, op)
    }

    /// In-place all-reduce of a typed slice.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        Collectives::all_reduce_in_place(self, buf, op)
    }
}

impl<'a> Collectives<'a> for Communicator {
    fn communicator(&self) -> &Communicator {
        self
    }
    fn submit(&self, op: Op<'a>) -> Result<()> {
        self.run(op)
    }
}

impl<'a> Collectives<'a> for crate::call::GroupComm<'a, '_> {
    fn communicator(&self) -> &Communicator {
        self.comm()
    }
    fn submit(&self, op: Op<'a>) -> Result<()> {
        self.queue(op);
        Ok(())
    }
}
