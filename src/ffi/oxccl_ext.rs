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

/// [`oxcclCommSetCompression`] mode: exact (no compression; the default).
pub const OXCCL_COMPRESS_OFF: c_int = 0;
/// [`oxcclCommSetCompression`] mode: bfloat16 on the wire between hosts.
pub const OXCCL_COMPRESS_BF16: c_int = 1;
/// [`oxcclCommSetCompression`] mode: fp8 e4m3 with one f32 scale per 256 elements.
pub const OXCCL_COMPRESS_FP8: c_int = 2;
/// [`oxcclCommSetCompression`] mode: int8 with one f32 scale per 256 elements.
pub const OXCCL_COMPRESS_INT8: c_int = 3;

/// oxccl extension: the wire encoding between hosts of `comm`'s later `ncclFloat32` sum and
/// average all-reduces, reduce-scatters and reduces (`OXCCL_COMPRESS_OFF`, `_BF16`, `_FP8`,
/// `_INT8`), in place of
/// `OXCCL_COMPRESS` for this communicator only. Links within a host stay exact; other types,
/// operators and collectives are unchanged; every rank ends with the same bits
/// (docs/COMPRESSION.md gives the error bound). Every rank must make the same setting before its
/// next collective on `comm`. An unknown mode is `ncclInvalidArgument` and changes nothing.
#[no_mangle]
pub extern "C" fn oxcclCommSetCompression(comm: ncclComm_t, mode: c_int) -> ncclResult_t {
    boundary("oxcclCommSetCompression", || {
        let c = lookup(comm)?;
        c.set_compression(mode.try_into().map_err(Error::invalid_argument)?);
        Ok(())
    })
}

/// oxccl extension: writes `comm`'s compression mode ([`oxcclCommSetCompression`]) to `*mode`.
#[no_mangle]
pub extern "C" fn oxcclCommGetCompression(comm: ncclComm_t, mode: *mut c_int) -> ncclResult_t {
    boundary("oxcclCommGetCompression", || {
        let c = lookup(comm)?;
        if mode.is_null() {
            return Err(Error::invalid_argument("mode is NULL"));
        }
        // SAFETY: checked non-NULL; the caller passes a writable int.
        unsafe { *mode = c.compression() as c_int };
        Ok(())
    })
}
