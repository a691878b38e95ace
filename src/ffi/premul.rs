//! `ncclRedOpCreatePreMulSum` / `ncclRedOpDestroy`: user reduction operators that multiply
//! each rank's input by a scalar before summing. This file keeps the table of operator numbers
//! per communicator handle; what an operator does is [`crate::call::premul`].

#![allow(non_camel_case_types)]

use super::*;
use crate::call::premul::{PreMulSum, Residence};
use crate::call::Reduction;
use crate::types::{DataType, ReduceOp};
use std::ffi::c_void;
use std::os::raw::c_int;

/// Where the scalar of `ncclRedOpCreatePreMulSum` lives (`ncclScalarResidence_t`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ncclScalarResidence_t {
    /// The scalar is read when each collective runs.
    ncclScalarDevice = 0,
    /// The scalar is read once, when the operator is created.
    ncclScalarHostImmediate = 1,
}

/// An `ncclScalarResidence_t` as received over the ABI: any `int`, validated before use.
pub type ncclScalarResidenceRaw = c_int;

fn ops() -> &'static Mutex<HashMap<(usize, c_int), PreMulSum>> {
    static O: OnceLock<Mutex<HashMap<(usize, c_int), PreMulSum>>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The reduction of a call on `dtype` with operator argument `op` of `comm` (`None`: a
/// collective that does not reduce).
///
/// # Safety
/// The scalar pointer given to `ncclRedOpCreatePreMulSum` for `op` (host-resident scalars)
/// must still point to one element of its type (NCCL's contract while the operator is used).
pub(crate) unsafe fn reduction(comm: ncclComm_t, op: Option<c_int>, dtype: DataType) -> Result<Reduction> {
    let Some(op) = op else { return Ok(Reduction::Builtin(ReduceOp::Sum)) };
    if (0..crate::types::NUM_OPS as c_int).contains(&op) {
        return ReduceOp::from_raw(op).map(Reduction::Builtin);
    }
    let p = crate::sync::lock(ops()).get(&(comm as usize, op)).copied();
    let p = p.ok_or_else(|| {
        Error::invalid_argument(format!(
            "invalid reduction op {op}: not built in, nor a live operator of this communicator"
        ))
    })?;
    if p.dtype() != dtype {
        return Err(Error::invalid_argument(format!(
            "op {op} was created for {} but the call is on {}",
            p.dtype().name(),
            dtype.name()
        )));
    }
    // SAFETY: forwarded from this function's contract.
    Ok(unsafe { p.reduction() })
}

/// Drops the operators of a destroyed communicator.
pub(crate) fn forget(comm: ncclComm_t) {
    crate::sync::lock(ops()).retain(|&(c, _), _| c != comm as usize);
}

/// Creates a PreMulSum operator for `comm`: `sum(scalar * x_r)` over ranks `r`.
#[no_mangle]
pub extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut ncclRedOpRaw,
    scalar: *mut c_void,
    datatype: ncclDataTypeRaw,
    residence: ncclScalarResidenceRaw,
    comm: ncclComm_t,
) -> ncclResult_t {
    boundary("ncclRedOpCreatePreMulSum", || {
        lookup(comm)?;
        // SAFETY: the C caller passes NULL or a pointer writable for the call (NCCL's contract).
        let dst = unsafe { out(op, "op") }?;
        let dtype = DataType::from_raw(datatype)?;
        if scalar.is_null() {
            return Err(Error::invalid_argument("scalar is NULL"));
        }
        let residence = match residence {
            0 => Residence::AtCall,
            1 => Residence::Immediate,
            r => return Err(Error::invalid_argument(format!("invalid scalar residence {r}"))),
        };
        // SAFETY: the C caller passes a pointer to one element of `datatype`, valid while the
        // operator is used for a scalar read at each call (NCCL's contract); NULL is refused.
        let scalar = unsafe { PreMulSum::new(dtype, scalar, residence) }?;
        // Operator numbers are never reused (a destroyed one stays invalid): a process-wide
        // counter above the built-in operators.
        static NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(crate::types::NUM_OPS);
        let id = NEXT
            .fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |n| {
                n.checked_add(1)
            })
            .map_err(|_| Error::internal("every PreMulSum operator number of this process was used"))?;
        crate::sync::lock(ops()).insert((comm as usize, id), scalar);
        dst.write(id);
        Ok(())
    })
}

/// Destroys an operator made by `ncclRedOpCreatePreMulSum` on `comm`.
#[no_mangle]
pub extern "C" fn ncclRedOpDestroy(op: ncclRedOpRaw, comm: ncclComm_t) -> ncclResult_t {
    boundary("ncclRedOpDestroy", || {
        lookup(comm)?;
        if (0..crate::types::NUM_OPS as c_int).contains(&op) {
            return Err(Error::invalid_argument(format!("op {op} is built in and cannot be destroyed")));
        }
        crate::sync::lock(ops())
            .remove(&(comm as usize, op))
            .map(|_| ())
            .ok_or_else(|| Error::invalid_argument(format!("op {op} is not a live operator of this communicator")))
    })
}
