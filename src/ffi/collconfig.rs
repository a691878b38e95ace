//! The per-call-config collectives of NCCL 2.32 (`ncclAllReduceConfig` ... `ncclScatterConfig`):
//! the config is checked (NULL, or a struct with `NCCL_API_MAGIC`) and its GPU tuning fields
//! are ignored; the call then runs exactly as its plain counterpart.
#![allow(clippy::too_many_arguments)]

use super::coll::*;
use super::config::NCCL_API_MAGIC;
use super::*;
use std::ffi::c_void;
use std::os::raw::c_int;

/// Per-call options (`ncclCollConfig_t`), laid out as NCCL 2.32's `ncclCollConfig_v23200`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclCollConfig_t {
    /// `sizeof(ncclCollConfig_t)` of the caller's header.
    pub size: usize,
    /// Must be `NCCL_API_MAGIC`.
    pub magic: u32,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: u32,
    /// Vendor extension list (ignored).
    pub ext: *mut c_void,
    /// GPU tuning (ignored).
    pub minCTAs: c_int,
    /// GPU tuning (ignored).
    pub maxCTAs: c_int,
    /// GPU tuning (ignored).
    pub nvlsCTAs: c_int,
    /// GPU tuning (ignored).
    pub cgaClusterSize: c_int,
    /// Algorithm selection string (ignored; use OXCCL_ALGO).
    pub algSelection: *const c_char,
    /// Whether an unsatisfiable selection is an error (ignored).
    pub forceAlgSelection: c_int,
    /// CTA policy (ignored).
    pub CTAPolicy: c_int,
    /// Profiler tag (ignored).
    pub userProfilerTag: u64,
    /// CUDA event recorded at launch completion (ignored).
    pub launchCompletionEvent: *mut c_void,
}

/// Checks `config`, then runs `call`.
fn with_config(name: &str, config: *const ncclCollConfig_t, call: impl FnOnce() -> ncclResult_t) -> ncclResult_t {
    let r = boundary(name, || {
        if config.is_null() {
            return Ok(());
        }
        // SAFETY: non-null; every version of the struct starts with size, magic, version.
        let magic = unsafe { std::ptr::read_unaligned(std::ptr::addr_of!((*config).magic)) };
        if magic != NCCL_API_MAGIC {
            return Err(Error::invalid_argument(format!(
                "collective config magic is {magic:#x}, not {NCCL_API_MAGIC:#x}"
            )));
        }
        Ok(())
    });
    if r != ncclResult_t::ncclSuccess {
        return r;
    }
    call()
}

/// `ncclAllReduce` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclAllReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclAllReduceConfig", config, || ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream))
}

/// `ncclBroadcast` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclBroadcastConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclBroadcastConfig", config, || {
        ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
    })
}

/// `ncclReduce` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclReduceConfig", config, || ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream))
}

/// `ncclAllGather` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclAllGatherConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataTypeRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclAllGatherConfig", config, || ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream))
}

/// `ncclReduceScatter` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclReduceScatterConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclReduceScatterConfig", config, || {
        ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
    })
}

/// `ncclAlltoAll` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclAlltoAllConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclAlltoAllConfig", config, || ncclAlltoAll(sendbuff, recvbuff, count, datatype, comm, stream))
}

/// `ncclGather` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclGatherConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclGatherConfig", config, || ncclGather(sendbuff, recvbuff, count, datatype, root, comm, stream))
}

/// `ncclScatter` with a per-call config.
#[no_mangle]
pub extern "C" fn ncclScatterConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
    config: *const ncclCollConfig_t,
) -> ncclResult_t {
    with_config("ncclScatterConfig", config, || ncclScatter(sendbuff, recvbuff, count, datatype, root, comm, stream))
}
