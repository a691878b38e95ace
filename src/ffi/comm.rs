//! Communicator lifecycle and queries: ncclGetVersion, ncclGetUniqueId, ncclCommInitRank,
//! ncclCommDestroy, ncclCommAbort, ncclCommCount, ncclCommUserRank, ncclCommCuDevice,
//! ncclGetErrorString, ncclGetLastError, ncclCommGetAsyncError.

use super::*;
use crate::call::UniqueId;
use std::os::raw::c_int;

/// Reports the NCCL API level oxccl implements (`NCCL_VERSION_CODE`, e.g. 22304).
#[no_mangle]
pub extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    boundary("ncclGetVersion", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        unsafe { out(version, "version") }?.write(crate::NCCL_VERSION_CODE);
        Ok(())
    })
}

/// Creates a unique id and starts its rendezvous root in this process.
#[no_mangle]
pub extern "C" fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
    boundary("ncclGetUniqueId", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(uniqueId, "uniqueId") }?;
        let id = UniqueId::new()?;
        dst.write(ncclUniqueId { internal: id.bytes.map(|b| b as c_char) });
        Ok(())
    })
}

/// Joins communicator `commId` as `rank` of `nranks` (blocking until all ranks arrive).
#[no_mangle]
pub extern "C" fn ncclCommInitRank(
    comm: *mut ncclComm_t,
    nranks: c_int,
    commId: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    boundary("ncclCommInitRank", || {
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(comm, "comm") }?;
        if nranks < 1 {
            return Err(Error::invalid_argument(format!("nranks must be at least 1 (got {nranks})")));
        }
        if rank < 0 || rank >= nranks {
            return Err(Error::invalid_argument(format!("rank {rank} is out of range for nranks {nranks}")));
        }
        let mut bytes = [0u8; 128];
        for (d, s) in bytes.iter_mut().zip(commId.internal) {
            *d = s as u8;
        }
        let (n, r) = (nranks as usize, rank as usize);
        // Blocking; inside a group, deferred to the group's end (see src/call/thread.rs).
        dst.write(config::create(true, move || Communicator::init_rank(n, &UniqueId { bytes }, r))?.0);
        Ok(())
    })
}

/// Destroys a communicator, closing its connections. NULL is accepted (no-op); destroying the
/// same handle twice returns `ncclInvalidArgument` (the handle is no longer live).
#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclCommDestroy", || {
        if comm.is_null() || config::cancel_pending(comm) {
            return Ok(());
        }
        drop(unregister(comm)?);
        Ok(())
    })
}

/// Aborts a communicator: interrupts collectives running on other threads (they return an
/// error within the engine's poll interval), closes connections, frees the handle.
#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclCommAbort", || {
        if comm.is_null() || config::cancel_pending(comm) {
            return Ok(());
        }
        let c = unregister(comm)?;
        c.abort();
        Ok(())
    })
}

/// Number of ranks in the communicator.
#[no_mangle]
pub extern "C" fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    boundary("ncclCommCount", || {
        let c = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        unsafe { out(count, "count") }?.write(c.size() as c_int);
        Ok(())
    })
}

/// This rank's index in the communicator.
#[no_mangle]
pub extern "C" fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    boundary("ncclCommUserRank", || {
        let c = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        unsafe { out(rank, "rank") }?.write(c.rank() as c_int);
        Ok(())
    })
}

/// CUDA device of the communicator: the GPU of its device calls, else the device of the
/// calling thread's current CUDA context; a host-memory communicator has none (`*device = -1`).
#[no_mangle]
pub extern "C" fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    boundary("ncclCommCuDevice", || {
        let c = lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        unsafe { out(device, "device") }?.write(crate::call::memory::comm_device(&c).unwrap_or(-1));
        Ok(())
    })
}

/// Static text for a result code. The hint after an error says where its details are: in the
/// log lines already printed when that level is on, else which variable to set (the spelling
/// the user set, `NCCL_DEBUG` or `OXCCL_DEBUG`).
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: ncclResultRaw) -> *const c_char {
    static TEXTS: std::sync::OnceLock<Vec<std::ffi::CString>> = std::sync::OnceLock::new();
    let texts = TEXTS.get_or_init(|| {
        (0..=crate::error::RESULT_CODES.len() as i32)
            .map(|code| {
                let text = crate::error::result_text(code).to_string_lossy();
                let hint = crate::log::detail_level(code).map(crate::log::detail_hint).unwrap_or_default();
                std::ffi::CString::new(format!("{text}{hint}")).unwrap_or_default()
            })
            .collect()
    });
    let last = texts.len() - 1; // the "unknown result code" entry
    let i = usize::try_from(result).ok().filter(|&i| i < last).unwrap_or(last);
    texts[i].as_ptr()
}

/// The last error message: of `comm` when it is a live communicator with one, else the
/// process-wide last error. The text stays valid until the next call on this thread.
#[no_mangle]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    let text = std::panic::catch_unwind(|| {
        let own =
            if comm.is_null() { None } else { lookup(comm).ok().map(|c| c.last_error()).filter(|s| !s.is_empty()) };
        own.unwrap_or_else(last_error_text)
    })
    .unwrap_or_default();
    thread_cstr(&text)
}
