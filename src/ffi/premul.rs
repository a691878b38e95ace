//! `ncclRedOpCreatePreMulSum` / `ncclRedOpDestroy`: user reduction operators that multiply
//! each rank's input by a scalar before summing.
//!
//! A PreMulSum call is run as an `ncclSum` of a pre-scaled copy of this rank's send buffer
//! (one scratch copy scaled once per call), so every reducing collective and algorithm
//! supports it unchanged. The copy lives until the call completes: at once outside a group,
//! at the outermost `ncclGroupEnd` inside one.
//!
//! Scalar residence: `ncclScalarHostImmediate` reads the scalar at creation;
//! `ncclScalarDevice` reads it at every call, as NCCL does: host memory when the call is made,
//! GPU memory in stream order by calls on device buffers (calls on host buffers with a scalar
//! in GPU memory are `ncclInvalidUsage`).

#![allow(non_camel_case_types)]

use super::*;
use crate::algo::Collective;
use crate::device::Scale;
use crate::types::DataType;
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

#[derive(Clone, Copy)]
enum Scalar {
    Value(f64),
    AtCall(usize),
    /// A scalar in GPU memory: read in stream order by device calls.
    Device(u64),
}

#[derive(Clone, Copy)]
struct PreMul {
    dtype: DataType,
    scalar: Scalar,
}

fn ops() -> &'static Mutex<HashMap<(usize, c_int), PreMul>> {
    static O: OnceLock<Mutex<HashMap<(usize, c_int), PreMul>>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
}

thread_local! {
    static SCRATCH: RefCell<Vec<Vec<u64>>> = const { RefCell::new(Vec::new()) };
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

/// The factor of a PreMulSum operator `op` of `comm` for a call on `dtype`, or `None` when `op`
/// is a built-in operator.
///
/// # Safety
/// The scalar pointer given to `ncclRedOpCreatePreMulSum` for `op` (host-resident scalars)
/// must still point to one element of its type (NCCL's contract while the operator is used).
pub(crate) unsafe fn factor(comm: ncclComm_t, op: c_int, dtype: DataType) -> Result<Option<Scale>> {
    if (0..crate::types::NUM_OPS as c_int).contains(&op) {
        return Ok(None);
    }
    let p = ops().lock().unwrap_or_else(|e| e.into_inner()).get(&(comm as usize, op)).copied();
    let p = p.ok_or_else(|| {
        Error::invalid_argument(format!(
            "invalid reduction op {op}: not built in, nor a live operator of this communicator"
        ))
    })?;
    if p.dtype != dtype {
        return Err(Error::invalid_argument(format!(
            "op {op} was created for {} but the call is on {}",
            p.dtype.name(),
            dtype.name()
        )));
    }
    Ok(Some(match p.scalar {
        Scalar::Value(v) => Scale::Host(v),
        // SAFETY: forwarded from this function's contract.
        Scalar::AtCall(ptr) => Scale::Host(unsafe { read_scalar(dtype, ptr) }),
        Scalar::Device(ptr) => Scale::Device(ptr),
    }))
}

/// Copies this rank's send buffer of `coll`, scales it by `factor` and returns the copy's
/// address; the copy is kept until [`release`].
///
/// # Safety
/// `send`, when not NULL, must be readable for this rank's send count of `coll` in `dtype`.
pub(crate) unsafe fn prescale(
    c: &Communicator,
    coll: Collective,
    send: *const c_void,
    count: usize,
    dtype: DataType,
    factor: f64,
) -> Result<*const c_void> {
    let (sc, _) = coll.buffer_counts(c.rank(), c.size(), count);
    let bytes = crate::comm::byte_len(sc, dtype)?;
    if send.is_null() && bytes > 0 {
        return Err(Error::invalid_argument(format!("sendbuff is NULL with count {count}")));
    }
    let mut v = vec![0u64; bytes.div_ceil(8)];
    let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes];
    if bytes > 0 {
        // SAFETY: non-NULL here; readable for `bytes` per this function's contract.
        buf.copy_from_slice(unsafe { std::slice::from_raw_parts(send as *const u8, bytes) });
    }
    crate::reduce::scale(dtype, buf, factor);
    let p = v.as_ptr() as *const c_void;
    SCRATCH.with(|s| s.borrow_mut().push(v));
    Ok(p)
}

/// Frees this thread's pre-scaled copies (after the calls that used them completed).
pub(crate) fn release() {
    SCRATCH.with(|s| s.borrow_mut().clear());
}

/// Drops the operators of a destroyed communicator.
pub(crate) fn forget(comm: ncclComm_t) {
    ops().lock().unwrap_or_else(|e| e.into_inner()).retain(|&(c, _), _| c != comm as usize);
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
        let scalar = match residence {
            // SAFETY: the C caller passes a pointer to one element of `datatype` (checked
            // non-NULL above); an immediate scalar is read now, once.
            1 => Scalar::Value(unsafe { read_scalar(dtype, scalar as usize) }),
            0 => {
                if crate::device::classify(scalar)?.is_host() {
                    Scalar::AtCall(scalar as usize)
                } else {
                    Scalar::Device(scalar as u64)
                }
            }
            r => return Err(Error::invalid_argument(format!("invalid scalar residence {r}"))),
        };
        // Operator numbers are never reused (a destroyed one stays invalid): a process-wide
        // counter above the built-in operators.
        static NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(crate::types::NUM_OPS);
        let id = NEXT
            .fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |n| {
                n.checked_add(1)
            })
            .map_err(|_| Error::internal("every PreMulSum operator number of this process was used"))?;
        ops().lock().unwrap_or_else(|e| e.into_inner()).insert((comm as usize, id), PreMul { dtype, scalar });
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
        ops()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(comm as usize, op))
            .map(|_| ())
            .ok_or_else(|| Error::invalid_argument(format!("op {op} is not a live operator of this communicator")))
    })
}
