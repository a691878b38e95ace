//! The one executor interface: an [`Executor`] (the engine's plan run, the shared-memory lane,
//! the host arena, the device layer's route run) runs inside a session, which owns the
//! bookkeeping every executor shares: refusing an unusable communicator, the concurrency
//! guard, the flight record's entry, and failing the call (settling the failure with the
//! peers). The route (what [`crate::algo::select`] answered) picks the executor;
//! [`Communicator::dispatch`] is the one place that runs it.
//!
//! Two kinds of session ([`SessionKind`]), chosen by the executor:
//! - [`Session`], a host call's: the host guard and the communicator's lock for the whole call,
//!   the peers' lazy link set-up, the per-peer call numbers of the mismatch check, and a failure
//!   settled over the links.
//! - `DeviceSession` (`src/device/session.rs`), a device call's, which only enqueues work on
//!   streams, through the narrow calls below ([`Communicator::enter_device_call`]...): the device guard
//!   (a second device call from another thread at once is refused, and fails the communicator,
//!   as a second host call is), no host lock and no fence, because the call's host work, if
//!   any, runs later on the device layer's proxy thread, which opens host sessions of its own;
//!   the flight record's device ring (done once enqueued); an enqueue error fails the
//!   communicator, settled with the peers through the control channel.

use super::*;
use crate::guard::Busy;

/// A call's executor: what it records and talks to, which session it runs in, and how it runs.
pub(crate) trait Executor {
    /// What the call returns besides success (the arena: whether it ran the call).
    type Output;

    /// The session the executor runs in: [`Session`] (host calls) or the device layer's
    /// (`crate::device::DeviceSession`).
    type Session<'c>: SessionKind<'c>;

    /// The call's name in errors and the flight record.
    fn what(&self) -> &str;

    /// The call's description (flight record, mismatch signature).
    fn desc(&self) -> mismatch::Desc;

    /// The peers the call talks to, into `out` (which is cleared first).
    fn peers(&self, rank: usize, nranks: usize, out: &mut Vec<usize>);

    /// Runs the call in `s` (guard held, flight entry started; a host session's links not
    /// yet connected: [`Session::connect`]). An error is settled when the session finishes,
    /// unless the executor already settled it ([`Session::fail_early`], the device session's
    /// `refuse`).
    ///
    /// # Safety
    /// The call's buffers must be valid for what it reads and writes (the contract of
    /// [`Communicator::prepare`]; for device buffers, until their streams have run the call).
    unsafe fn run(&mut self, s: &mut Self::Session<'_>) -> Result<Self::Output>;
}

/// What [`Communicator::dispatch`] does with a session: open it, start the flight record's
/// entry with the call's peers, and record and settle the outcome.
pub(crate) trait SessionKind<'c>: Sized {
    /// Takes `comm` for one call named `what`, or refuses it (destroyed, failed or aborted
    /// communicator; another thread's call holding it, which fails the communicator).
    fn open(comm: &'c Communicator, what: &str) -> Result<Self>;

    /// Where the executor writes the call's peers.
    fn peers(&mut self) -> &mut Vec<usize>;

    /// Starts the flight record's entry of the call, with the peers written.
    fn start(&mut self, what: &str, desc: &mismatch::Desc);

    /// Records the call's outcome; on failure settles it and fails the communicator.
    fn finish<T>(&mut self, r: Result<T>) -> Result<T>;
}

/// One host call's hold on its communicator: taken by [`Communicator::dispatch`] before an
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

impl<'c> SessionKind<'c> for Session<'c> {
    /// Also waits for the communicator's device work in flight (the host fence of
    /// [`Communicator::check_usable`]).
    #[inline(always)]
    fn open(comm: &'c Communicator, what: &str) -> Result<Session<'c>> {
        comm.check_usable(what)?;
        let Some(busy) = comm.guard.enter() else { return Err(comm.refuse_concurrent(what)) };
        Ok(Session { comm, inner: lock(&comm.inner), _busy: busy, entry: None })
    }

    #[inline(always)]
    fn peers(&mut self) -> &mut Vec<usize> {
        &mut self.inner.peers
    }

    #[inline(always)]
    fn start(&mut self, what: &str, desc: &mismatch::Desc) {
        self.entry = Some(self.comm.flight.start(what, desc, &self.inner.peers));
    }

    /// Settles a failure with the peers, shuts the links and fails the communicator (unless
    /// [`Session::fail_early`] already did).
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

impl<'c> Session<'c> {
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
}

impl Communicator {
    /// Opens a device call named `what` (the device session's, `crate::device`): the host
    /// checks but the fence (a destroyed, failed or aborted communicator refuses it), then the
    /// device guard (another thread's device call at once refuses it and fails the
    /// communicator).
    pub(crate) fn enter_device_call(&self, what: &str) -> Result<Busy<'_>> {
        self.check_open(what)?;
        self.guard.enter_device().ok_or_else(|| self.refuse_concurrent(what))
    }

    /// Starts the flight record's device entry of a call.
    pub(crate) fn start_device_entry(&self, what: &str, desc: &mismatch::Desc, peers: &[usize]) -> u64 {
        self.flight.start_device(what, desc, peers)
    }

    /// Records the outcome of the flight record's device entry `entry`.
    pub(crate) fn finish_device_entry(&self, entry: u64, r: &Result<()>) {
        self.flight.finish_device(entry, r)
    }

    /// Fails the communicator with a device call's error `e` (an enqueue that failed part
    /// way): settled with the peers through the control channel first, if there is one.
    pub(crate) fn fail_device_call(&self, e: Error) -> Error {
        let e = match &self.control {
            Some(c) => c.settle(e),
            None => e,
        };
        self.fail_as(e)
    }
}

impl Communicator {
    /// Runs one call on executor `e`: opens its session (host or device), starts the flight
    /// record's entry with the call's peers, runs the executor, then records and settles its
    /// outcome.
    ///
    /// # Safety
    /// As [`Executor::run`].
    #[inline(always)]
    pub(crate) unsafe fn dispatch<'c, E: Executor>(&'c self, e: &mut E) -> Result<E::Output> {
        let mut s = <E::Session<'c> as SessionKind<'c>>::open(self, e.what())?;
        e.peers(self.rank, self.size, s.peers());
        s.start(e.what(), &e.desc());
        // SAFETY: the caller's contract.
        let r = unsafe { e.run(&mut s) };
        s.finish(r)
    }
}
