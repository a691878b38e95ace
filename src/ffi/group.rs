//! `ncclGroupStart` / `ncclGroupEnd`: per-thread, nestable groups.
//!
//! Between the outermost start and its end, every call on this thread is checked at once
//! (errors are returned by that call, which is then left out) and queued; the outermost end
//! runs the queue as one group ([`crate::group::run`]) and returns its result.
//!
//! Communicator constructors called inside a group (ncclCommInitRank and the others, split,
//! shrink, grow) are deferred as in NCCL, so one thread can create several ranks: each one
//! runs on a worker thread at once and writes its handle, and the outermost ncclGroupEnd waits
//! for all of them (each is bounded by `OXCCL_TIMEOUT_MS`) before running the queued calls.

use super::*;
use crate::coll::Op;

/// Work started inside a group that its outermost end waits for.
pub(crate) enum Deferred {
    /// A communicator being built under this (pending) handle.
    Comm(usize),
    /// Another collective step of a constructor (e.g. a split's `NCCL_SPLIT_NOCOLOR` rank).
    Task(std::thread::JoinHandle<Result<()>>),
}

#[derive(Default)]
struct State {
    depth: usize,
    ops: Vec<(Arc<Communicator>, Op<'static>)>,
    /// Calls on device buffers, enqueued at the outermost end.
    dev: crate::launch::StreamGroup,
    deferred: Vec<Deferred>,
}

/// Defers `d` to the end of the open group; gives it back when no group is open.
pub(crate) fn defer(d: Deferred) -> Option<Deferred> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some(d);
        }
        g.deferred.push(d);
        None
    })
}

/// Waits for deferred work; returns the first error.
fn finish_deferred(deferred: Vec<Deferred>) -> Result<()> {
    let mut first = Ok(());
    for d in deferred {
        let r = match d {
            Deferred::Comm(token) => super::config::wait_created(token),
            Deferred::Task(h) => h.join().unwrap_or_else(|_| Err(Error::internal("a deferred group task panicked"))),
        };
        if first.is_ok() {
            first = r;
        }
    }
    first
}

thread_local! {
    static GROUP: RefCell<State> = RefCell::new(State::default());
}

/// How deeply groups are nested on this thread (0: no group open).
pub(crate) fn depth() -> usize {
    GROUP.with(|g| g.borrow().depth)
}

/// Runs `op` now, or queues it when a group is open on this thread.
pub(crate) fn submit(comm: Arc<Communicator>, op: Op<'static>) -> Result<()> {
    let queued = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Some(op);
        }
        g.ops.push((comm.clone(), op));
        None
    });
    match queued {
        Some(op) => comm.run(op),
        None => Ok(()),
    }
}

/// Queues a checked call on device buffers in the open group.
///
/// # Safety
/// As [`crate::launch::StreamGroup::push`].
pub(crate) unsafe fn queue_device(
    comm: Arc<Communicator>,
    ordinal: i32,
    op: crate::device::DevOp,
    stream: *mut std::ffi::c_void,
) {
    // SAFETY: forwarded from this function's contract.
    GROUP.with(|g| unsafe { g.borrow_mut().dev.push(comm, ordinal, op, stream) });
}

/// Opens a group (groups nest; only the outermost end runs the operations).
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    boundary("ncclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().depth += 1);
        Ok(())
    })
}

/// Closes a group; the outermost end runs every operation queued since its start.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    boundary("ncclGroupEnd", || {
        let (ops, dev, deferred) = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return Err(Error::invalid_usage("ncclGroupEnd without a matching ncclGroupStart"));
            }
            g.depth -= 1;
            Ok(if g.depth == 0 {
                (std::mem::take(&mut g.ops), std::mem::take(&mut g.dev), std::mem::take(&mut g.deferred))
            } else {
                (Vec::new(), Default::default(), Vec::new())
            })
        })?;
        if let Err(e) = finish_deferred(deferred) {
            // A communicator of this group failed to build: its queued calls are dropped.
            drop(ops);
            if depth() == 0 {
                super::premul::release();
            }
            return Err(e);
        }
        // Host calls run first, then the device calls are enqueued (every rank does the same).
        let mut r = Ok(());
        if !ops.is_empty() {
            let (comms, ops): (Vec<Arc<Communicator>>, Vec<Op<'static>>) = ops.into_iter().unzip();
            r = crate::group::run(comms.iter().map(|c| &**c).zip(ops).collect());
            if depth() == 0 {
                super::premul::release();
            }
        }
        if !dev.is_empty() {
            let d = dev.run();
            r = r.and(d);
        }
        r
    })
}
