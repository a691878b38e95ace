//! What `ncclCommCuDevice` and `ncclMemAlloc` / `ncclMemFree` answer when CUDA is in use.
//!
//! NCCL binds a communicator to the device current at init and allocates device memory in
//! `ncclMemAlloc`. oxccl's communicators are host objects that take a GPU on their first device
//! call, so: the device is the one of that first call, else the device of the calling thread's
//! current context (what NCCL would have bound at init), else none (-1, a host communicator).
//! `ncclMemAlloc` allocates device memory in the current context when the application uses CUDA
//! (has loaded the driver and made a context current), host memory otherwise.

use super::{available, check, driver_loaded};
use crate::comm::Communicator;
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The device of the calling thread's current context, if CUDA is in use and one is current.
fn current_device() -> Option<i32> {
    if !driver_loaded() || !available() {
        return None;
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one int; fails cleanly (INVALID_CONTEXT) when no context is current.
    (unsafe { sys::cuCtxGetDevice(&mut dev) } == sys::CUresult::CUDA_SUCCESS).then_some(dev)
}

/// `ncclCommCuDevice`: the GPU of `comm`'s device calls, else of the current context, else none.
pub fn comm_device(comm: &Arc<Communicator>) -> Option<i32> {
    super::state::ordinal_of(comm).or_else(current_device)
}

/// Device allocations made by [`alloc`], with their GPU (freed only through [`free`]).
fn allocations() -> &'static Mutex<HashMap<u64, i32>> {
    static A: OnceLock<Mutex<HashMap<u64, i32>>> = OnceLock::new();
    A.get_or_init(Default::default)
}

/// `ncclMemAlloc`: `size` bytes of device memory of the current context's GPU, or `None` when
/// the application uses no CUDA context (the caller then allocates host memory).
pub fn alloc(size: usize) -> Result<Option<u64>> {
    let Some(ordinal) = current_device() else { return Ok(None) };
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: allocation in the current context; writes the address.
    check(unsafe { sys::cuMemAlloc_v2(&mut p, size.max(1)) }, &format!("cuMemAlloc({size} bytes)"))?;
    crate::sync::lock(allocations()).insert(p, ordinal);
    Ok(Some(p))
}

/// `ncclMemFree` of device memory: true when `ptr` came from [`alloc`] (and is now freed).
pub fn free(ptr: u64) -> Result<bool> {
    let Some(ordinal) = crate::sync::lock(allocations()).remove(&ptr) else {
        return Ok(false);
    };
    super::forget(ptr);
    let gpu = super::gpu(ordinal)?;
    let _ctx = gpu.enter()?;
    // SAFETY: allocated by `alloc` on this GPU and removed from the table, so freed once.
    check(unsafe { sys::cuMemFree_v2(ptr) }, "cuMemFree")?;
    Ok(true)
}
