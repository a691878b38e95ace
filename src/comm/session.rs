//! The one executor interface of host calls: an [`Executor`] (the engine's plan run, the
//! shared-memory lane, the host arena) runs inside a [`Session`], which owns the bookkeeping
//! every executor shares: the communicator's concurrency guard and its lock, the flight
//! record's entry, the peers' lazy link set-up, the per-peer call numbers of the mismatch
//! check, and failing the call (settling the failure with the peers). The route (what
//! [`crate::algo::select::path`] answered) picks the executor; [`Communicator::dispatch`] is the
//! one place that runs it.

use super::*;
use crate::guard::Busy;

/// A host call's executor: what it records and talks to, and how it runs.
pub(crate) trait Executor {
    /// What the call returns besides success (the arena: whether it ran the call).
    type Output;

    /// The call's name in errors and the flight record.
    fn what(&self) -> &str;

    /// The call's description (flight record, mismatch signature).
    fn desc(&self) -> mismatch::Desc;

    /// The peers the call talks to, into `out` (which is cleared first).
    fn peers(&self, rank: usize, nranks: usize, out: &mut Vec<usize>);

    /// Runs the call in `s` (guard held, flight entry started, links not yet connected:
    /// [`Session::connect`]). An error is settled by [`Session::finish`] unless the executor
    /// already failed the session ([`Session::fail_early`]).
    ///
    /// # Safety
    /// The call's buffers must be valid for what it reads and writes (the contract of
    /// [`Communicator::prepare`]).
    unsafe fn run(&mut self, s: &mut Session<'_>) -> Result<Self::Output>;
}

/// One call's hold on its communicator: taken by [`Communicator::dispatch`] before an
/// executor runs and given back (lock, then guard) when it ends. The call's peers are in
/// `Inner::peers` (memory kept from call to call; moving them into the session would put a
/// store-to-load stall on the small all-reduce's path).
pub(crate) struct Session<'c> {
    comm: &'c Communicator,
    /// The communicator's per-call state, locked for the call (dropped before `_busy`).
    inner: MutexGuard<'c, Inner>,
    /// The concurrency guard's proof that this is the communicator's only call.
    _busy: Busy<'c>,
    /// The flight record's entry, until the call's outcome is recorded.
    entry: Option<u64>,
}

impl<'c> Session<'c> {
    /// Takes `comm` for one call named `what`: refuses it on a destroyed, failed or aborted
    /// communicator, and fails the communicator when another thread's call holds it.
    #[inline(always)]
    fn open(comm: &'c Communicator, what: &str) -> Result<Session<'c>> {
        comm.check_usable(what)?;
        let Some(busy) = comm.guard.enter() else { return Err(comm.refuse_concurrent(what)) };
        Ok(Session { comm, inner: lock(&comm.inner), _busy: busy, entry: None })
    }

    /// The communicator.
    #[inline(always)]
    pub(crate) fn comm(&self) -> &'c Communicator {
        self.comm
    }

    /// The communicator's per-call state (`peers` holds the call's peers).
    #[inline(always)]
    pub(super) fn inner(&mut self) -> &mut Inner {
        &mut self.inner
    }

    /// Connects a link to every peer of the call that has none yet, bounded by the
    /// communicator's timeout.
    #[inline(always)]
    pub(crate) fn connect(&mut self) -> Result<()> {
        let (rank, inner) = (self.comm.rank, &mut *self.inner);
        if inner.peers.iter().any(|&p| p != rank && inner.links.get(p).is_some_and(|l| l.is_none())) {
            let deadline = Instant::now() + self.comm.timeout();
            let peers = std::mem::take(&mut inner.peers);
            let r = self.comm.ensure_links(inner, &peers, deadline);
            inner.peers = peers;
            r?;
        }
        Ok(())
    }

    /// Counts the call in each peer's sequence (the mismatch check's numbering, shared by
    /// every executor) when the check is on, calling `each(peer, number)`.
    #[inline(always)]
    pub(crate) fn count_call(&mut self, mut each: impl FnMut(usize, u64)) {
        if !self.comm.config.check_mismatch {
            return;
        }
        let inner = &mut *self.inner;
        for &p in &inner.peers {
            inner.seq[p] += 1;
            each(p, inner.seq[p]);
        }
    }

    /// Fails the communicator with `e` before the call moved anything (its links could not
    /// be set up): the failure is recorded without settling it over the links.
    pub(crate) fn fail_early(&mut self, e: Error) -> Error {
        let e = self.comm.fail(e);
        if let Some(entry) = self.entry.take() {
            self.comm.flight.finish(entry, &Err(e.clone()));
        }
        e
    }

    /// Records the call's outcome; on failure settles it with the peers, shuts the links and
    /// fails the communicator (unless [`Session::fail_early`] already did).
    #[inline(always)]
    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        let Some(entry) = self.entry.take() else { return r };
        match r {
            Ok(v) => {
                self.comm.flight.finish(entry, &Ok(()));
                Ok(v)
            }
            Err(e) => {
                let e = self.comm.fail_call(&mut self.inner, e);
                self.comm.flight.finish(entry, &Err(e.clone()));
                Err(e)
            }
        }
    }
}

impl Communicator {
    /// Runs one host call on executor `e`: takes the session (guard, lock), starts the flight
    /// record's entry with the call's peers, runs the executor, then records and settles its
    /// outcome.
    ///
    /// # Safety
    /// As [`Executor::run`].
    #[inline(always)]
    pub(crate) unsafe fn dispatch<E: Executor>(&self, e: &mut E) -> Result<E::Output> {
        let mut s = Session::open(self, e.what())?;
        e.peers(self.rank, self.size, &mut s.inner.peers);
        s.entry = Some(self.flight.start(e.what(), &e.desc(), &s.inner.peers));
        // SAFETY: the caller's contract.
        let r = unsafe { e.run(&mut s) };
        s.finish(r)
    }
}
