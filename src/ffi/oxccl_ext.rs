//! oxccl's own C extensions (named `oxccl*`; not part of NCCL's API).

use super::*;

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
