//! oxccl's own C extensions (named `oxccl*`; not part of NCCL's API).

use super::*;
use std::ffi::c_int;

/// oxccl extension: bounds every later operation of `comm` by `timeoutMs` milliseconds
/// without progress (failing with `ncclTimeout`), in place of `OXCCL_TIMEOUT_MS` for this
/// communicator only. `timeoutMs` must be at least 1. Operations already running keep the
/// bound they started with.
#[no_mangle]
pub extern "C" fn oxcclCommSetTimeout(comm: ncclComm_t, timeoutMs: u64) -> ncclResult_t {
    boundary("oxcclCommSetTimeout", || {
        if timeoutMs == 0 {
            return Err(Error::invalid_argument("timeoutMs must be at least 1 ms"));
        }
        lookup(comm)?.set_timeout(std::time::Duration::from_millis(timeoutMs));
        Ok(())
    })
}

/// oxccl extension: turns fixed-order reductions on (`on != 0`) or off for later operations of
/// `comm`, in place of `OXCCL_DETERMINISTIC` for this communicator only. On, every all-reduce,
/// reduce and reduce-scatter (host and device buffers) gives each element as the left fold of
/// the ranks' inputs in rank order, bit for bit the same whatever the algorithm settings, chunk
/// size, message size, links or placement (docs/DETERMINISM.md). Every rank must make the same
/// setting before its next collective on `comm`.
#[no_mangle]
pub extern "C" fn oxcclCommSetDeterministic(comm: ncclComm_t, on: c_int) -> ncclResult_t {
    boundary("oxcclCommSetDeterministic", || {
        let c = lookup(comm)?;
        let mut t = c.tuning();
        t.deterministic = Some(on != 0);
        c.set_tuning(t);
        Ok(())
    })
}

/// oxccl extension: writes 1 to `*on` when `comm`'s reductions are fixed-order
/// (`OXCCL_DETERMINISTIC` or [`oxcclCommSetDeterministic`]), else 0.
#[no_mangle]
pub extern "C" fn oxcclCommGetDeterministic(comm: ncclComm_t, on: *mut c_int) -> ncclResult_t {
    boundary("oxcclCommGetDeterministic", || {
        let c = lookup(comm)?;
        if on.is_null() {
            return Err(Error::invalid_argument("on is NULL"));
        }
        // SAFETY: checked non-NULL; the caller passes a writable int.
        unsafe { *on = c_int::from(c.deterministic()) };
        Ok(())
    })
}
