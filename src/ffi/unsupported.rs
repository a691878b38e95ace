//! Every NCCL 2.32 function for a feature oxccl does not have: memory windows and one-sided
//! signals (NVLink/NVLS), device communicators (`nccl_device.h`), suspend/resume of GPU
//! memory, revoke/grow, encryption, the parameter API and group simulation.
//!
//! Each is exported with NCCL's exact signature so that programs link and load, and returns
//! `ncclInvalidUsage` with `ncclGetLastError` naming the function as unsupported (and why).
//! docs/COMPATIBILITY.md lists them.
#![allow(non_camel_case_types)]

use super::*;
use std::ffi::c_void;
use std::os::raw::c_int;

/// Opaque memory-window object (`struct ncclWindow_vidmem`).
pub struct ncclWindow_vidmem {
    _private: [u8; 0],
}

/// Memory-window handle (`ncclWindow_t`).
pub type ncclWindow_t = *mut ncclWindow_vidmem;

/// Opaque parameter object (`struct ncclParamHandle`).
pub struct ncclParamHandle {
    _private: [u8; 0],
}

/// Parameter handle (`ncclParamHandle_t`).
pub type ncclParamHandle_t = *mut ncclParamHandle;

/// One wait of `ncclWaitSignal` (`ncclWaitSignalDesc_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclWaitSignalDesc_t {
    /// Number of signal operations to wait for.
    pub opCnt: c_int,
    /// Peer to wait for.
    pub peer: c_int,
    /// Signal index.
    pub sigIdx: c_int,
    /// Context.
    pub ctx: c_int,
}

/// Result of `ncclGroupSimulateEnd` (`ncclSimInfo_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclSimInfo_t {
    /// `sizeof(ncclSimInfo_t)`.
    pub size: usize,
    /// `0x74685283`.
    pub magic: u32,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: u32,
    /// Estimated time in microseconds.
    pub estimatedTime: f32,
}

/// Transport encryption settings (`ncclEncryptionConfig_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclEncryptionConfig_t {
    /// `sizeof(ncclEncryptionConfig_t)`.
    pub size: usize,
    /// `NCCL_API_MAGIC`.
    pub magic: u32,
    /// The caller's `NCCL_VERSION_CODE`.
    pub version: u32,
    /// `ncclEncryptionMode_t`.
    pub mode: c_int,
    /// Pre-shared key.
    pub psk: *const c_char,
}

/// The result of every function here: `ncclInvalidUsage`, with the reason as last error.
fn unsupported(name: &str, why: &str) -> ncclResult_t {
    set_last_error(&format!("{name}: unsupported by oxccl: {why}"));
    ncclResult_t::ncclInvalidUsage
}

/// Unsupported: revoking a communicator's ongoing operations (fault tolerance API of NCCL 2.29+) is not implemented; use ncclCommAbort.
#[no_mangle]
pub extern "C" fn ncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
    let _ = (comm, revokeFlags);
    unsupported("ncclCommRevoke", "revoking a communicator's ongoing operations (fault tolerance API of NCCL 2.29+) is not implemented; use ncclCommAbort")
}

/// Unsupported: suspending GPU memory is a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclCommSuspend(comm: ncclComm_t, flags: c_int) -> ncclResult_t {
    let _ = (comm, flags);
    unsupported("ncclCommSuspend", "suspending GPU memory is a GPU feature oxccl does not have")
}

/// Unsupported: suspending GPU memory is a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclCommResume(comm: ncclComm_t) -> ncclResult_t {
    let _ = (comm,);
    unsupported("ncclCommResume", "suspending GPU memory is a GPU feature oxccl does not have")
}

/// Unsupported: symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    winFlags: c_int,
) -> ncclResult_t {
    let _ = (comm, buff, size, win, winFlags);
    unsupported(
        "ncclCommWindowRegister",
        "symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have",
    )
}

/// Unsupported: symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
    let _ = (comm, win);
    unsupported(
        "ncclCommWindowDeregister",
        "symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have",
    )
}

/// Unsupported: symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, outUserPtr: *mut *mut c_void) -> ncclResult_t {
    let _ = (comm, win, outUserPtr);
    unsupported("ncclWinGetUserPtr", "symmetric memory windows (NVLink/NVLS) are a GPU feature oxccl does not have")
}

/// Unsupported: one-sided put/signal needs memory windows, a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    peer: c_int,
    peerWin: ncclWindow_t,
    peerWinOffset: usize,
    sigIdx: c_int,
    ctx: c_int,
    flags: u32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let _ = (localbuff, count, datatype, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, comm, stream);
    unsupported("ncclPutSignal", "one-sided put/signal needs memory windows, a GPU feature oxccl does not have")
}

/// Unsupported: one-sided signals need memory windows, a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclSignal(
    peer: c_int,
    sigIdx: c_int,
    ctx: c_int,
    flags: u32,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let _ = (peer, sigIdx, ctx, flags, comm, stream);
    unsupported("ncclSignal", "one-sided signals need memory windows, a GPU feature oxccl does not have")
}

/// Unsupported: one-sided signals need memory windows, a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclWaitSignal(
    nDesc: c_int,
    signalDescs: *mut ncclWaitSignalDesc_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let _ = (nDesc, signalDescs, comm, stream);
    unsupported("ncclWaitSignal", "one-sided signals need memory windows, a GPU feature oxccl does not have")
}

/// Unsupported: simulating a group (GPU time estimate) is not implemented.
#[no_mangle]
pub extern "C" fn ncclGroupSimulateEnd(simInfo: *mut ncclSimInfo_t) -> ncclResult_t {
    let _ = (simInfo,);
    unsupported("ncclGroupSimulateEnd", "simulating a group (GPU time estimate) is not implemented")
}

/// Unsupported: encrypted transport is not implemented (oxccl authenticates connections with HMAC but does not encrypt).
#[no_mangle]
pub extern "C" fn ncclSetEncryption(config: *const ncclEncryptionConfig_t) -> ncclResult_t {
    let _ = (config,);
    unsupported(
        "ncclSetEncryption",
        "encrypted transport is not implemented (oxccl authenticates connections with HMAC but does not encrypt)",
    )
}

/// Unsupported: NCCL's parameter API is not implemented; oxccl reads OXCCL_*/NCCL_* environment variables.
#[no_mangle]
pub extern "C" fn ncclParamBind(out: *mut ncclParamHandle_t, key: *const c_char) -> ncclResult_t {
    let _ = (out, key);
    unsupported(
        "ncclParamBind",
        "NCCL's parameter API is not implemented; oxccl reads OXCCL_*/NCCL_* environment variables",
    )
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetI8(h: ncclParamHandle_t, out: *mut i8) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetI8", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetI16(h: ncclParamHandle_t, out: *mut i16) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetI16", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetI32(h: ncclParamHandle_t, out: *mut i32) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetI32", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetI64(h: ncclParamHandle_t, out: *mut i64) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetI64", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetU8(h: ncclParamHandle_t, out: *mut u8) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetU8", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetU16(h: ncclParamHandle_t, out: *mut u16) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetU16", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetU32(h: ncclParamHandle_t, out: *mut u32) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetU32", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetU64(h: ncclParamHandle_t, out: *mut u64) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetU64", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetStr(h: ncclParamHandle_t, out: *mut *const c_char) -> ncclResult_t {
    let _ = (h, out);
    unsupported("ncclParamGetStr", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGet(h: ncclParamHandle_t, out: *mut c_void, maxLen: c_int, len: *mut c_int) -> ncclResult_t {
    let _ = (h, out, maxLen, len);
    unsupported("ncclParamGet", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetParameter(
    key: *const c_char,
    value: *mut *const c_char,
    valueLen: *mut c_int,
) -> ncclResult_t {
    let _ = (key, value, valueLen);
    unsupported("ncclParamGetParameter", "NCCL's parameter API is not implemented")
}

/// Unsupported: NCCL's parameter API is not implemented.
#[no_mangle]
pub extern "C" fn ncclParamGetAllParameterKeys(table: *mut *mut *const c_char, tableLen: *mut c_int) -> ncclResult_t {
    let _ = (table, tableLen);
    unsupported("ncclParamGetAllParameterKeys", "NCCL's parameter API is not implemented")
}

/// Unsupported: device communicators (nccl_device.h) are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclDevCommCreate(comm: ncclComm_t, reqs: *const c_void, outDevComm: *mut c_void) -> ncclResult_t {
    let _ = (comm, reqs, outDevComm);
    unsupported("ncclDevCommCreate", "device communicators (nccl_device.h) are a GPU feature oxccl does not have")
}

/// Unsupported: device communicators (nccl_device.h) are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclDevCommDestroy(comm: ncclComm_t, devComm: *const c_void) -> ncclResult_t {
    let _ = (comm, devComm);
    unsupported("ncclDevCommDestroy", "device communicators (nccl_device.h) are a GPU feature oxccl does not have")
}

/// Unsupported: device communicator properties (nccl_device.h) are not implemented.
#[no_mangle]
pub extern "C" fn ncclCommQueryProperties(comm: ncclComm_t, props: *mut c_void) -> ncclResult_t {
    let _ = (comm, props);
    unsupported("ncclCommQueryProperties", "device communicator properties (nccl_device.h) are not implemented")
}

/// Unsupported: multimem (NVLS) pointers are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclGetLsaMultimemDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, outPtr);
    unsupported("ncclGetLsaMultimemDevicePointer", "multimem (NVLS) pointers are a GPU feature oxccl does not have")
}

/// Unsupported: memory windows are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclGetLsaDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    lsaRank: c_int,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, lsaRank, outPtr);
    unsupported("ncclGetLsaDevicePointer", "memory windows are a GPU feature oxccl does not have")
}

/// Unsupported: memory windows are a GPU feature oxccl does not have.
#[no_mangle]
pub extern "C" fn ncclGetPeerDevicePointer(
    window: ncclWindow_t,
    offset: usize,
    peer: c_int,
    outPtr: *mut *mut c_void,
) -> ncclResult_t {
    let _ = (window, offset, peer, outPtr);
    unsupported("ncclGetPeerDevicePointer", "memory windows are a GPU feature oxccl does not have")
}

/// Prints NCCL's parameters: oxccl has no parameter table (see OXCCL_* variables): no-op.
#[no_mangle]
pub extern "C" fn ncclParamDumpAll() {}
