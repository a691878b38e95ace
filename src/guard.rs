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

/// The per-communicator flags: closed (destroyed), busy (a host call is running), device (a
/// device call is being enqueued), and failed (an error or an abort stopped it; the
/// communicator keeps the reason). A device call holds `device`, not `busy`: its host work
/// runs later on the device layer's proxy thread, which takes `busy` for it.
#[derive(Default)]
pub(crate) struct Guard {
    closed: AtomicBool,
    busy: AtomicBool,
    device: AtomicBool,
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

    /// Takes the communicator for one device call, or `None` when another device call holds it.
    pub(crate) fn enter_device(&self) -> Option<Busy<'_>> {
        let d = &self.device;
        d.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| Busy(d))
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
        let d = g.enter_device().expect("a device call does not wait for a host call's guard");
        assert!(g.enter_device().is_none(), "a second device call is refused while the first holds it");
        drop(d);
        assert!(g.enter_device().is_some(), "free again once the device call ended");
        drop(a);
        assert!(g.enter().is_some(), "free again once the first call ended");
        assert!(!g.is_closed());
        g.close();
        assert!(g.is_closed());
    }
}
