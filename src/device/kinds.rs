//! The classification of device buffers, cached per allocation so that a device call asks the
//! driver one `cuMemGetAddressRange` per buffer instead of two or three `cuPointerGetAttribute`.
//!
//! The key is the allocation's base address and size as `cuMemGetAddressRange` reports them
//! (caching allocators hand out many buffers inside one allocation; all share one entry). Only
//! device and managed memory are cached: for anything else (pageable or pinned host memory,
//! which that call does not describe) the full classification runs every time, as before.
//!
//! Invalidation. An entry is dropped when its range is freed through oxccl (`ncclMemFree`) or
//! deregistered (`ncclCommDeregister`); an entry whose base now reports another size is
//! replaced. A user's `cudaFree` is invisible here, so the cache relies on this: a range the
//! driver reports again at the same base and size is again device memory; when the process
//! holds more than one GPU context, a hit also needs the calling thread's current context to be
//! the cached GPU's (else the buffer is classified afresh and the entry replaced), which catches
//! a range freed on one GPU and reallocated on another. The cache holds at most [`CAP`] entries
//! (it is emptied when full).

use super::{classify, retained_gpus, MemKind};
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Most allocations remembered.
const CAP: usize = 4096;

/// Allocation base -> (size, kind).
fn cache() -> std::sync::MutexGuard<'static, HashMap<u64, (usize, MemKind)>> {
    static C: OnceLock<Mutex<HashMap<u64, (usize, MemKind)>>> = OnceLock::new();
    crate::sync::lock(C.get_or_init(Default::default))
}

/// The allocation holding `ptr` (base, size), when the driver describes one.
fn range_of(ptr: *const c_void) -> Option<(u64, usize)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the driver only looks the address up; writes two values.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr as sys::CUdeviceptr) };
    (r == sys::CUresult::CUDA_SUCCESS && size > 0).then_some((base, size))
}

/// True when the calling thread's current context is GPU `ordinal`'s primary context, or the
/// process holds one GPU context at most (a reused range then cannot belong to another GPU).
fn context_agrees(ordinal: i32) -> bool {
    let gpus = retained_gpus();
    if gpus.len() <= 1 {
        return true;
    }
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes the current context handle (NULL when none).
    let ok = unsafe { sys::cuCtxGetCurrent(&mut cur) } == sys::CUresult::CUDA_SUCCESS;
    ok && gpus.iter().any(|g| g.ordinal == ordinal && g.context() == cur)
}

/// [`classify`] through the cache (the driver is loaded and sees a GPU).
pub(super) fn classify_cached(ptr: *const c_void) -> Result<MemKind> {
    if ptr.is_null() {
        return Ok(MemKind::Host);
    }
    let Some((base, size)) = range_of(ptr) else { return classify(ptr) };
    let hit = cache().get(&base).copied();
    if let Some((len, kind)) = hit {
        if len == size && kind.ordinal().is_some_and(context_agrees) {
            return Ok(kind);
        }
    }
    let kind = classify(ptr)?;
    let mut c = cache();
    if kind.ordinal().is_some() {
        if c.len() >= CAP {
            c.clear();
        }
        c.insert(base, (size, kind));
    } else {
        c.remove(&base);
    }
    Ok(kind)
}

/// Forgets the allocation holding `ptr` (freed or deregistered through oxccl).
pub(crate) fn forget(ptr: u64) {
    cache().retain(|&base, &mut (len, _)| !(ptr >= base && ptr - base < len as u64));
}

/// Allocations remembered (for tests).
pub fn cached() -> usize {
    cache().len()
}
