//! Collective and point-to-point entry points (`ncclAllReduce` ... `ncclRecv`), with NCCL
//! 2.x's exact signatures: each converts and validates its arguments into a
//! [`crate::call::Call`] and submits it ([`crate::call::submit`]), which decides where it runs
//! (host or device buffers), runs it or adds it to the thread's open group. Host memory: a call
//! outside a group returns when it is complete; a non-null `stream` is synchronised first when
//! CUDA is present. Device buffers are enqueued on `stream`.

use super::*;
use crate::call::{Call, Collective};
use crate::types::DataType;
use std::ffi::c_void;
use std::os::raw::c_int;

/// A root or peer argument: non-negative (the communicator checks the upper bound).
fn rank_arg(v: c_int, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid_argument(format!("{what} {v} is out of range")))
}

/// The body shared by every entry point: validates the handle, type and operator, then submits
/// the call.
#[allow(clippy::too_many_arguments)]
fn submit(
    name: &str,
    comm: ncclComm_t,
    coll: impl FnOnce() -> Result<Collective>,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: Option<ncclRedOpRaw>,
    stream: cudaStream_t,
) -> ncclResult_t {
    boundary(name, || {
        let c = lookup(comm)?;
        let dtype = DataType::from_raw(datatype)?;
        // SAFETY: a PreMulSum operator's host scalar stays valid while the operator is used
        // (NCCL's contract for ncclRedOpCreatePreMulSum).
        let reduction = unsafe { premul::reduction(comm, op, dtype) }?;
        let call = Call { coll: coll()?, send, recv, count, dtype, reduction, stream: stream.cast() };
        // SAFETY: the C caller guarantees the buffers hold what NCCL's contract says for this
        // collective until the call (in a group: the outermost ncclGroupEnd; device buffers:
        // the stream) has run it, and that `stream` is NULL or a valid stream.
        unsafe { crate::call::submit(&c, &call) }
    })
}

/// All-reduce `count` elements from `sendbuff` into `recvbuff` on every rank (in place when
/// they are equal).
#[no_mangle]
pub extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    submit("ncclAllReduce", comm, || Ok(Collective::AllReduce), sendbuff, recvbuff, count, datatype, Some(op), stream)
}

/// Copies `count` elements of `root`'s `sendbuff` into every rank's `recvbuff` (`sendbuff`
/// only matters at the root; in place when equal).
#[no_mangle]
pub extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Broadcast { root: rank_arg(root, "root")? });
    submit("ncclBroadcast", comm, coll, sendbuff, recvbuff, count, datatype, None, stream)
}

/// In-place broadcast (the legacy form of `ncclBroadcast`): `buff` of `root` into every `buff`.
#[no_mangle]
pub extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Broadcast { root: rank_arg(root, "root")? });
    submit("ncclBcast", comm, coll, buff, buff, count, datatype, None, stream)
}

/// Reduces every rank's `count` elements of `sendbuff` into `root`'s `recvbuff` (`recvbuff`
/// only matters at the root).
#[no_mangle]
pub extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Reduce { root: rank_arg(root, "root")? });
    submit("ncclReduce", comm, coll, sendbuff, recvbuff, count, datatype, Some(op), stream)
}

/// Gathers `sendcount` elements from every rank into every `recvbuff` (`nranks * sendcount`
/// elements, in rank order); in place when `sendbuff == recvbuff + rank * sendcount`.
#[no_mangle]
pub extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: ncclDataTypeRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    submit("ncclAllGather", comm, || Ok(Collective::AllGather), sendbuff, recvbuff, sendcount, datatype, None, stream)
}

/// Reduces every rank's `sendbuff` (`nranks * recvcount` elements) and leaves block `rank` of
/// the result in `recvbuff`; in place when `recvbuff == sendbuff + rank * recvcount`.
#[no_mangle]
pub extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: ncclDataTypeRaw,
    op: ncclRedOpRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    submit(
        "ncclReduceScatter",
        comm,
        || Ok(Collective::ReduceScatter),
        sendbuff,
        recvbuff,
        recvcount,
        datatype,
        Some(op),
        stream,
    )
}

/// Sends `count` elements to `peer`, which must post a matching `ncclRecv`. Group the sends
/// and receives of an exchange (and any send to oneself) between `ncclGroupStart`/`End`.
#[no_mangle]
pub extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Send { peer: rank_arg(peer, "peer")? });
    submit("ncclSend", comm, coll, sendbuff, std::ptr::null_mut(), count, datatype, None, stream)
}

/// Receives `count` elements from `peer` into `recvbuff`.
#[no_mangle]
pub extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    peer: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Recv { peer: rank_arg(peer, "peer")? });
    submit("ncclRecv", comm, coll, std::ptr::null(), recvbuff, count, datatype, None, stream)
}

/// Sends block `p` (`count` elements) of `sendbuff` to rank `p` and receives block `p` of
/// `recvbuff` from it, for every rank `p`.
#[no_mangle]
pub extern "C" fn ncclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    submit("ncclAlltoAll", comm, || Ok(Collective::AllToAll), sendbuff, recvbuff, count, datatype, None, stream)
}

/// Gathers every rank's `count` elements into block `rank` of `root`'s `recvbuff` (which only
/// matters at the root); in place when `sendbuff == recvbuff + root * count` at the root.
#[no_mangle]
pub extern "C" fn ncclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Gather { root: rank_arg(root, "root")? });
    submit("ncclGather", comm, coll, sendbuff, recvbuff, count, datatype, None, stream)
}

/// Sends block `p` (`count` elements) of `root`'s `sendbuff` (which only matters at the root)
/// to rank `p`'s `recvbuff`; in place when `recvbuff == sendbuff + root * count` at the root.
#[no_mangle]
pub extern "C" fn ncclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: ncclDataTypeRaw,
    root: c_int,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let coll = || Ok(Collective::Scatter { root: rank_arg(root, "root")? });
    submit("ncclScatter", comm, coll, sendbuff, recvbuff, count, datatype, None, stream)
}
