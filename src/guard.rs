//! Refusing misuse of a communicator instead of running it: a call that reaches a communicator
//! after `ncclCommDestroy`/`ncclCommAbort` (queued in a group that ended later), and a call made
//! while another thread's call on the same communicator is still running.
//!
//! Two threads calling one communicator at once would otherwise be served one after the other,
//! in an order that differs from rank to rank, so one thread's data could be reduced with
//! another thread's on the peers. The second caller gets `ncclInvalidUsage` at once (a
//! try-lock, never a wait), and the communicator is failed with that reason, so the call that
//! was running stops too and every peer learns why: no rank can pair the wrong calls.

use std::sync::atomic::{AtomicBool, Ordering};

/// The per-communicator flags: closed (destroyed), busy (a call is running), and failed (an
/// error or an abort stopped it; the communicator keeps the reason).
#[derive(Default)]
pub(crate) struct Guard {
    closed: AtomicBool,
    busy: AtomicBool,
    failed: AtomicBool,
}

/// Proof that this thread runs the communicator's only call; released when dropped.
pub(crate) struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Guard {
    /// Marks the communicator destroyed: later calls fail.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether the communicator was destroyed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Marks the communicator failed (its reason is kept by the communicator).
    pub(crate) fn set_failed(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    /// Whether the communicator is destroyed or failed: a call must look closer before it
    /// runs. One load each on the hot path instead of the communicator's locks.
    pub(crate) fn troubled(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire)
    }

    /// Takes the communicator for one call, or `None` when another call holds it.
    pub(crate) fn enter(&self) -> Option<Busy<'_>> {
        self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| Busy(&self.busy))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_release_on_drop() {
        let g = Guard::default();
        let a = g.enter().expect("free at first");
        assert!(g.enter().is_none(), "a second caller is refused while the first holds it");
        drop(a);
        assert!(g.enter().is_some(), "free again once the first call ended");
        assert!(!g.is_closed());
        g.close();
        assert!(g.is_closed());
    }
}
