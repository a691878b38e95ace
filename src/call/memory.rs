//! Buffer memory and device facts the API layers report: `ncclMemAlloc` / `ncclMemFree`,
//! a communicator's GPU and the GPU memory it holds.

use crate::comm::Communicator;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// Allocates `size` bytes for buffers: device memory of the current context's GPU when the
/// application uses CUDA (as NCCL), page-aligned shareable host memory otherwise (the other
/// ranks of the host read buffers in it where they lie, `OXCCL_LOCAL_REGISTER`).
pub fn alloc(size: usize) -> Result<*mut c_void> {
    if let Some(d) = crate::device::mem::alloc(size)? {
        return Ok(d as *mut c_void);
    }
    Ok(crate::transport::shm::hostmem::alloc(size)?.cast())
}

/// Frees memory from [`alloc`] (NULL is a no-op; any other pointer is an error).
pub fn free(ptr: *mut c_void) -> Result<()> {
    if ptr.is_null() || crate::device::mem::free(ptr as u64)? {
        return Ok(());
    }
    if !crate::transport::shm::hostmem::free(ptr.cast()) {
        return Err(Error::invalid_argument(format!(
            "{ptr:p} was not allocated by ncclMemAlloc (or was freed already)"
        )));
    }
    Ok(())
}

/// The GPU of `comm`'s device calls, else the device of the calling thread's current CUDA
/// context; `None` for a host-memory communicator.
pub fn comm_device(comm: &Arc<Communicator>) -> Option<i32> {
    crate::device::mem::comm_device(comm)
}

/// The bytes of GPU memory `comm` holds (its CUDA IPC region, once a device call made one).
pub fn device_bytes(comm: &Arc<Communicator>) -> u64 {
    crate::device::memory(comm).0
}

/// Drops the cached classification of the allocation holding `ptr` (a buffer deregistered with
/// `ncclCommDeregister`, whose memory the application may free and reuse next).
pub fn forget_buffer(ptr: *mut c_void) {
    crate::device::forget(ptr as u64);
}
