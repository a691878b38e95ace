//! C types of the ABI, laid out and numbered exactly as in NVIDIA's `nccl.h`.
//!
//! Functions take data types and operators as plain `int` (`ncclDataTypeRaw`,
//! `ncclRedOpRaw`, printed as `ncclDataType_t` / `ncclRedOp_t` in the header) and validate
//! them: a C caller may pass any integer, and user-created operators are numbered above
//! `ncclNumOps`, so turning such a value into a Rust enum would be undefined behaviour.
#![allow(non_camel_case_types, non_upper_case_globals)]

use std::os::raw::{c_char, c_int};

/// Result of every call (`ncclResult_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclResult_t {
    /// The call succeeded.
    ncclSuccess = 0,
    /// A CUDA call failed.
    ncclUnhandledCudaError = 1,
    /// A system call failed.
    ncclSystemError = 2,
    /// Internal check failed (a bug, or an unimplemented path).
    ncclInternalError = 3,
    /// Bad argument.
    ncclInvalidArgument = 4,
    /// Call not allowed here.
    ncclInvalidUsage = 5,
    /// A remote process failed or misbehaved.
    ncclRemoteError = 6,
    /// A nonblocking operation is still running.
    ncclInProgress = 7,
    /// An operation timed out.
    ncclTimeout = 8,
    /// Number of results.
    ncclNumResults = 9,
}

impl ncclResult_t {
    /// Maps an `ncclResult_t` code to the enum through [`crate::error::RESULT_CODES`] (unknown
    /// codes become `ncclInternalError`).
    pub fn from_code(c: i32) -> ncclResult_t {
        match crate::error::result_code(c) {
            Some(r) => r.kind.map_or(ncclResult_t::ncclSuccess, ncclResult_t::from),
            None => ncclResult_t::ncclInternalError,
        }
    }
}

impl From<crate::error::ErrorKind> for ncclResult_t {
    /// The C value of an error kind (the same number: see [`crate::error::RESULT_CODES`]).
    fn from(k: crate::error::ErrorKind) -> ncclResult_t {
        use crate::error::ErrorKind as K;
        match k {
            K::UnhandledCuda => ncclResult_t::ncclUnhandledCudaError,
            K::System => ncclResult_t::ncclSystemError,
            K::Internal => ncclResult_t::ncclInternalError,
            K::InvalidArgument => ncclResult_t::ncclInvalidArgument,
            K::InvalidUsage => ncclResult_t::ncclInvalidUsage,
            K::Remote => ncclResult_t::ncclRemoteError,
            K::InProgress => ncclResult_t::ncclInProgress,
            K::Timeout => ncclResult_t::ncclTimeout,
        }
    }
}

/// Data types (`ncclDataType_t`); `ncclChar`, `ncclInt`, `ncclHalf`, `ncclFloat`, `ncclDouble`
/// are the same values under their other names.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclDataType_t {
    /// 8-bit signed integer.
    ncclInt8 = 0,
    /// 8-bit unsigned integer.
    ncclUint8 = 1,
    /// 32-bit signed integer.
    ncclInt32 = 2,
    /// 32-bit unsigned integer.
    ncclUint32 = 3,
    /// 64-bit signed integer.
    ncclInt64 = 4,
    /// 64-bit unsigned integer.
    ncclUint64 = 5,
    /// IEEE half precision.
    ncclFloat16 = 6,
    /// IEEE single precision.
    ncclFloat32 = 7,
    /// IEEE double precision.
    ncclFloat64 = 8,
    /// bfloat16.
    ncclBfloat16 = 9,
    /// 8-bit float E4M3.
    ncclFloat8e4m3 = 10,
    /// 8-bit float E5M2.
    ncclFloat8e5m2 = 11,
    /// Number of types.
    ncclNumTypes = 12,
}

/// Alias of `ncclInt8`.
pub const ncclChar: ncclDataType_t = ncclDataType_t::ncclInt8;
/// Alias of `ncclInt32`.
pub const ncclInt: ncclDataType_t = ncclDataType_t::ncclInt32;
/// Alias of `ncclFloat16`.
pub const ncclHalf: ncclDataType_t = ncclDataType_t::ncclFloat16;
/// Alias of `ncclFloat32`.
pub const ncclFloat: ncclDataType_t = ncclDataType_t::ncclFloat32;
/// Alias of `ncclFloat64`.
pub const ncclDouble: ncclDataType_t = ncclDataType_t::ncclFloat64;

/// Reduction operators (`ncclRedOp_t`); user-created operators take values from `ncclNumOps`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclRedOp_t {
    /// Sum.
    ncclSum = 0,
    /// Product.
    ncclProd = 1,
    /// Maximum.
    ncclMax = 2,
    /// Minimum.
    ncclMin = 3,
    /// Average (sum / nranks).
    ncclAvg = 4,
    /// Number of built-in operators.
    ncclNumOps = 5,
    /// Forces the enum to int size, as NCCL's header does.
    ncclMaxRedOp = 0x7fffffff,
}

/// An `ncclDataType_t` as received over the ABI: any `int`, validated before use.
pub type ncclDataTypeRaw = c_int;
/// An `ncclResult_t` as received over the ABI (`ncclGetErrorString`): any `int`.
pub type ncclResultRaw = c_int;
/// An `ncclRedOp_t` as received over the ABI: any `int`, validated before use.
pub type ncclRedOpRaw = c_int;

/// Bytes in a unique id.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// Opaque bootstrap token (`ncclUniqueId`), passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    /// Opaque bytes.
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// Opaque communicator object.
pub struct ncclComm {
    _private: [u8; 0],
}

/// Communicator handle (`typedef struct ncclComm* ncclComm_t`).
pub type ncclComm_t = *mut ncclComm;

/// CUDA stream object (opaque; the same tag as `cuda_runtime.h`).
#[repr(C)]
pub struct CUstream_st {
    _private: [u8; 0],
}

/// CUDA stream handle (`cudaStream_t`), compatible with `cuda_runtime.h`.
pub type cudaStream_t = *mut CUstream_st;

/// NCCL major version implemented (see `NCCL_VERSION_CODE`).
pub const NCCL_MAJOR: c_int = 2;
/// NCCL minor version implemented.
pub const NCCL_MINOR: c_int = 23;
/// NCCL patch version implemented.
pub const NCCL_PATCH: c_int = 4;
/// NCCL API level implemented, as `ncclGetVersion` returns it: 2.23.4 is 22304.
///
/// Chosen below 2.28 because nccl-tests switches on `nccl_device.h` device APIs from 2.28,
/// which oxccl does not provide.
pub const NCCL_VERSION_CODE: c_int = NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH;
