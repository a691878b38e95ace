//! PreMulSum: `sum(scalar * x_r)` over ranks `r`, for every reducing collective.
//!
//! A call on host buffers runs as an `ncclSum` of a pre-scaled copy of this rank's send buffer
//! (`scaled_send`: one copy, scaled once per call, owned by the call until it has run), so
//! every algorithm supports it unchanged. A call on device buffers carries its factor to the
//! device executors ([`crate::device::DevOp::scale`]), which scale the staged bytes or the
//! kernel's input.
//!
//! Scalar residence ([`Residence`]), as NCCL has it: an immediate scalar is read when the
//! operator is made; a scalar given by address is read at every call: host memory when the call
//! is made, GPU memory in stream order by calls on device buffers (calls on host buffers with a
//! scalar in GPU memory are `ncclInvalidUsage`).

use super::{Call, Reduction, Scalar};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::DataType;
use std::ffi::c_void;

/// Where the scalar of a PreMulSum operator lives (NCCL's `ncclScalarResidence_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    /// Read at every call, from host or GPU memory (`ncclScalarDevice`).
    AtCall,
    /// Read once, when the operator is made (`ncclScalarHostImmediate`).
    Immediate,
}

#[derive(Clone, Copy, Debug)]
enum Source {
    Value(f64),
    /// Host memory, read when each call is made.
    HostAt(usize),
    /// GPU memory, read in stream order by device calls.
    DeviceAt(u64),
}

/// A PreMulSum operator (`ncclRedOpCreatePreMulSum`): its element type and scalar.
#[derive(Clone, Copy, Debug)]
pub struct PreMulSum {
    dtype: DataType,
    source: Source,
}

/// The element of `dtype` at address `p`, as f64.
///
/// # Safety
/// `p` must be readable for one element of `dtype`.
unsafe fn read_scalar(dtype: DataType, p: usize) -> f64 {
    // SAFETY: forwarded from this function's contract.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, dtype.size()) };
    crate::reduce::to_f64(dtype, bytes)[0]
}

impl PreMulSum {
    /// An operator multiplying by the element of `dtype` at `scalar` (classified as host or GPU
    /// memory when read at each call).
    ///
    /// # Safety
    /// `scalar` must point to one element of `dtype`; with [`Residence::AtCall`], for as long
    /// as the operator is used (NCCL's contract).
    pub unsafe fn new(dtype: DataType, scalar: *const c_void, residence: Residence) -> Result<PreMulSum> {
        if scalar.is_null() {
            return Err(Error::invalid_argument("scalar is NULL"));
        }
        let source = match residence {
            // SAFETY: non-NULL, one element of `dtype` (this function's contract).
            Residence::Immediate => Source::Value(unsafe { read_scalar(dtype, scalar as usize) }),
            Residence::AtCall if crate::device::classify(scalar)?.is_host() => Source::HostAt(scalar as usize),
            Residence::AtCall => Source::DeviceAt(scalar as u64),
        };
        Ok(PreMulSum { dtype, source })
    }

    /// An operator multiplying by `factor`, for calls on `dtype`.
    pub fn value(dtype: DataType, factor: f64) -> PreMulSum {
        PreMulSum { dtype, source: Source::Value(factor) }
    }

    /// The element type the operator was made for.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The reduction of one call: reads a host scalar given by address now.
    ///
    /// # Safety
    /// As [`PreMulSum::new`]: a host scalar given by address still points to one element.
    pub unsafe fn reduction(&self) -> Reduction {
        Reduction::PreMulSum(match self.source {
            Source::Value(v) => Scalar::Host(v),
            // SAFETY: forwarded from this function's contract.
            Source::HostAt(p) => Scalar::Host(unsafe { read_scalar(self.dtype, p) }),
            Source::DeviceAt(p) => Scalar::Device(p),
        })
    }
}

/// The error of a PreMulSum scalar in GPU memory on a call with host buffers.
pub(crate) fn device_scalar_on_host() -> Error {
    Error::invalid_usage("a PreMulSum scalar in GPU memory (ncclScalarDevice) needs device buffers")
}

/// The send buffer a host call runs with: `call.send`, or for PreMulSum a copy of the bytes
/// this rank sends, scaled by the factor (returned with the copy, which must outlive the run).
///
/// # Safety
/// `call.send`, when not NULL, must be readable for this rank's send count of the collective.
pub(crate) unsafe fn scaled_send(comm: &Communicator, call: &Call) -> Result<(*const u8, Option<Vec<u64>>)> {
    let factor = match call.reduction {
        Reduction::Builtin(_) => return Ok((call.send.cast(), None)),
        Reduction::PreMulSum(Scalar::Host(f)) => f,
        Reduction::PreMulSum(Scalar::Device(_)) => return Err(device_scalar_on_host()),
    };
    let (sc, _) = call.coll.buffer_counts(comm.rank(), comm.size(), call.count);
    let bytes = crate::comm::byte_len(sc, call.dtype)?;
    if call.send.is_null() && bytes > 0 {
        return Err(Error::invalid_argument(format!("sendbuff is NULL with count {}", call.count)));
    }
    let mut v = vec![0u64; bytes.div_ceil(8)];
    let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes];
    if bytes > 0 {
        // SAFETY: non-NULL here; readable for `bytes` per this function's contract.
        buf.copy_from_slice(unsafe { std::slice::from_raw_parts(call.send as *const u8, bytes) });
    }
    crate::reduce::scale(call.dtype, buf, factor);
    Ok((v.as_ptr().cast(), Some(v)))
}
