//! `ncclGroupStart` / `ncclGroupEnd`: per-thread, nestable groups ([`crate::call`]'s
//! `start_group` / `end_group`).
//!
//! Between the outermost start and its end, every call on this thread is checked at once
//! (errors are returned by that call, which is then left out) and queued; the outermost end
//! runs the queue as one group and returns its result.
//!
//! Communicator constructors called inside a group (ncclCommInitRank and the others, split,
//! shrink, grow) are deferred as in NCCL, so one thread can create several ranks: the call
//! layer builds each one on a worker thread at once (`call::create`) and the handle is written,
//! and the outermost ncclGroupEnd waits for all of them (each is bounded by `OXCCL_TIMEOUT_MS`) before running the queued calls.

use super::*;

/// Opens a group (groups nest; only the outermost end runs the operations).
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    boundary("ncclGroupStart", || {
        crate::call::start_group();
        Ok(())
    })
}

/// Closes a group; the outermost end runs every operation queued since its start.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    boundary("ncclGroupEnd", crate::call::end_group)
}
