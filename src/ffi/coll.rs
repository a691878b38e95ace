//! Collective entry points.

use super::*;
use crate::types::{DataType, ReduceOp};

/// Checks buffer pointers: NULL is only allowed when `count` is 0.
pub(crate) fn check_buf(p: *const std::ffi::c_void, count: usize, name: &str) -> Result<()> {
    if p.is_null() && count > 0 {
        return Err(Error::invalid_argument(format!("{name} is NULL with count {count}")));
    }
    Ok(())
}

/// All-reduce `count` elements from `sendbuff` into `recvbuff` on every rank (in place when
/// they are equal). Host memory: returns when complete (a non-null `stream` is synchronised
/// first). Device memory: enqueued on `stream`, returns at once (see `device::all_reduce`).
#[no_mangle]
pub extern "C" fn ncclAllReduce(
    sendbuff: *const std::ffi::c_void,
    recvbuff: *mut std::ffi::c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    boundary("ncclAllReduce", || {
        let c = lookup(comm)?;
        let dtype = DataType::from_raw(datatype)?;
        let op = ReduceOp::from_raw(op)?;
        check_buf(sendbuff, count, "sendbuff")?;
        check_buf(recvbuff, count, "recvbuff")?;
        // SAFETY (both arms): the C caller guarantees both buffers hold `count` elements and
        // that `stream` is a valid stream or NULL (the NCCL contract); pointers were checked
        // for NULL.
        match crate::device::route(sendbuff, recvbuff, stream.cast())? {
            crate::device::Route::Host => unsafe { c.all_reduce_raw(sendbuff.cast(), recvbuff.cast(), count, dtype, op) },
            crate::device::Route::Device { ordinal } => unsafe {
                crate::device::all_reduce(&c, sendbuff as u64, recvbuff as u64, count, dtype, op, ordinal, stream.cast())
            },
        }
    })
}
