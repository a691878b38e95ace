//! The per-thread, nestable group of `ncclGroupStart` / `ncclGroupEnd` ([`start_group`],
//! [`end_group`]).
//!
//! Between the outermost start and its end, every call [`super::submit`]s on this thread is
//! checked at once (errors are returned by that call, which is then left out) and added to the
//! thread's [`Batch`]; the outermost end runs it and returns its result. Work started inside a
//! group that must finish first (communicators being built, [`Deferred`]) is awaited by the
//! outermost end before the calls run.

use super::Batch;
use crate::error::{Error, Result};
use std::cell::RefCell;

/// Work started inside a group that its outermost end waits for (e.g. a communicator being
/// built, or another collective step of a constructor); returns its outcome.
pub type Deferred = Box<dyn FnOnce() -> Result<()>>;

#[derive(Default)]
struct State {
    depth: usize,
    batch: Batch<'static>,
    deferred: Vec<Deferred>,
}

thread_local! {
    static GROUP: RefCell<State> = RefCell::new(State::default());
}

/// How deeply groups are nested on this thread (0: no group open).
pub fn depth() -> usize {
    GROUP.with(|g| g.borrow().depth)
}

/// Runs `f` on the open group's batch.
pub(crate) fn with_batch<R>(f: impl FnOnce(&mut Batch<'static>) -> R) -> R {
    GROUP.with(|g| f(&mut g.borrow_mut().batch))
}

/// Defers `d` to the end of the open group; gives it back when no group is open.
pub fn defer(d: Deferred) -> Option<Deferred> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some(d);
        }
        g.deferred.push(d);
        None
    })
}

/// Opens a group on this thread (groups nest; only the outermost end runs the calls).
pub fn start_group() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Closes a group; the outermost end waits for the deferred work (if some failed, the queued
/// calls are dropped and its first error returned), then runs every call queued since its start.
pub fn end_group() -> Result<()> {
    let (batch, deferred) = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Error::invalid_usage("ncclGroupEnd without a matching ncclGroupStart"));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 {
            (std::mem::take(&mut g.batch), std::mem::take(&mut g.deferred))
        } else {
            (Batch::default(), Vec::new())
        })
    })?;
    let mut first = Ok(());
    for d in deferred {
        let r = d();
        if first.is_ok() {
            first = r;
        }
    }
    // A communicator of this group failed to build: its queued calls are dropped.
    first?;
    batch.run()
}
