//! Scoped groups of the Rust API: [`group()`] and [`Communicator::group`] collect calls in a
//! [`Batch`] that runs when the closure returns.

use super::{Batch, Call};
use crate::coll::Op;
use crate::comm::Communicator;
use crate::error::Result;
use std::cell::RefCell;
use std::sync::Arc;

/// Operations collected for [`group()`]: add them with [`Group::on`] (typed slices, through
/// [`crate::Collectives`]) or [`Group::add`] (any [`Call`], device buffers included).
#[derive(Default)]
pub struct Group<'a> {
    batch: RefCell<Batch<'a>>,
}

/// The view of a [`Group`] through which one communicator's operations are added: it offers
/// every collective of [`crate::Collectives`], queued instead of run.
pub struct GroupComm<'a, 'g> {
    group: &'g Group<'a>,
    comm: &'a Communicator,
}

impl<'a> Group<'a> {
    /// Adds operations on `comm` to this group.
    pub fn on<'g>(&'g self, comm: &'a Communicator) -> GroupComm<'a, 'g> {
        GroupComm { group: self, comm }
    }

    /// Queues a prepared operation.
    pub fn push(&self, comm: &'a Communicator, op: Op<'a>) {
        self.batch.borrow_mut().push(comm, op);
    }

    /// Checks `call` and queues it (host or device buffers, any reduction).
    ///
    /// # Safety
    /// As [`super::run`], for `'a` (device buffers: until the stream has run the group).
    pub unsafe fn add(&self, comm: &Arc<Communicator>, call: &Call) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.batch.borrow_mut().add(comm, call) }
    }

    /// Runs everything collected.
    pub fn run(self) -> Result<()> {
        self.batch.into_inner().run()
    }
}

impl<'a> GroupComm<'a, '_> {
    /// The communicator whose operations this view adds.
    pub(crate) fn comm(&self) -> &'a Communicator {
        self.comm
    }

    /// Queues a prepared operation on this view's communicator.
    pub(crate) fn queue(&self, op: Op<'a>) {
        self.group.push(self.comm, op);
    }
}

/// Runs `f`, which adds operations on any communicators to the group, then runs them all
/// together. If `f` fails, what it added still runs (its peers expect it), and `f`'s error is
/// returned.
///
/// ```no_run
/// # use oxccl::{Communicator, Collectives};
/// # let comm = Communicator::from_env()?;
/// let (rank, n) = (comm.rank(), comm.size());
/// let mine = vec![rank as f32; 4];
/// let mut from_left = vec![0f32; 4];
/// oxccl::group(|g| {
///     g.on(&comm).send(&mine, (rank + 1) % n)?;
///     g.on(&comm).recv(&mut from_left, (rank + n - 1) % n)
/// })?;
/// # Ok::<(), oxccl::Error>(())
/// ```
pub fn group<'a, R>(f: impl FnOnce(&Group<'a>) -> Result<R>) -> Result<R> {
    let g = Group::default();
    let r = f(&g);
    let ran = g.run();
    let r = r?;
    ran.map(|()| r)
}

impl Communicator {
    /// Like [`group()`] for operations on this communicator only:
    /// `comm.group(|g| { g.send(&a, right)?; g.recv(&mut b, left) })`.
    pub fn group<'a, R>(&'a self, f: impl FnOnce(&GroupComm<'a, '_>) -> Result<R>) -> Result<R> {
        group(|g| f(&g.on(self)))
    }
}
