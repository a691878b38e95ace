//! Page-locked host memory mapped into the GPU's address space (`cuMemHostAlloc` with
//! `DEVICEMAP | PORTABLE`): staging buffers for the proxy path and the flags that the GPU
//! writes and waits on with stream memory operations.

use super::check;
use crate::error::Result;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU32, Ordering};

/// A pinned, device-mapped host allocation.
pub(crate) struct Pinned {
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory owned by this value; synchronisation of its contents is the users' job
// (flags are accessed atomically, staging bytes are handed over through those flags).
unsafe impl Send for Pinned {}
// SAFETY: as above.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// Allocates `len` zeroed bytes (a context must be current).
    pub(crate) fn new(len: usize) -> Result<Pinned> {
        let len = len.max(64);
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // Relaxed (`capture.rs`): staging memory is never part of a graph, and a proxy may grow it
        // while a user's stream captures.
        // SAFETY: writes the new allocation's address into `p`.
        let r = super::capture::relaxed(|| unsafe { sys::cuMemHostAlloc(&mut p, len, flags) });
        check(r, &format!("cuMemHostAlloc({len} bytes)"))?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` was just allocated with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) };
        if let Err(e) = check(r, "cuMemHostGetDevicePointer") {
            // SAFETY: allocated above and not used since.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(e);
        }
        // SAFETY: `len` writable bytes at `p`.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(Pinned { host: p.cast(), dev, len })
    }

    /// Host address.
    pub(crate) fn host(&self) -> *mut u8 {
        self.host
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The `i`-th 32-bit flag of this allocation, for host-side atomic access.
    pub(crate) fn flag(&self, i: usize) -> &AtomicU32 {
        assert!((i + 1) * 4 <= self.len, "flag {i} outside a {}-byte allocation", self.len);
        // SAFETY: in bounds (checked), 4-byte aligned (page-aligned base), and only ever
        // accessed atomically by the host (the GPU's stream memory operations are atomic
        // 32-bit accesses too).
        unsafe { &*(self.host.add(i * 4) as *const AtomicU32) }
    }

    /// Device address of flag `i`.
    pub(crate) fn flag_dev(&self, i: usize) -> u64 {
        self.dev + (i * 4) as u64
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; owners make sure no GPU work still
        // uses it (they wait for their release flags first).
        unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// True when `got` has reached `want` in wrapping sequence order (as `CU_STREAM_WAIT_VALUE_GEQ`
/// compares: `(int32_t)(got - want) >= 0`).
pub(crate) fn reached(got: u32, want: u32) -> bool {
    (got.wrapping_sub(want) as i32) >= 0
}

/// Reads a flag with acquire ordering.
pub(crate) fn load(f: &AtomicU32) -> u32 {
    f.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sequence_order_wraps() {
        use super::reached;
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(1, u32::MAX) && !reached(u32::MAX, 1));
    }
}
