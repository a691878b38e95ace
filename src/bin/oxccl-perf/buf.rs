//! The benchmark's buffers: page-aligned heap memory, or shareable host memory (`-R 1`).

use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of the heap buffers (a page, as nccl-tests' buffers).
const ALIGN: usize = 4096;

/// A 4096-byte aligned, zero-initialised heap buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// How it was allocated: the heap (this layout) or shareable host memory (`-R 1`).
    from: Alloc,
}

/// How an [`AlignedBuf`] was allocated.
enum Alloc {
    /// The heap, with this layout.
    Heap(Layout),
    /// Kept until the buffer drops (it frees itself).
    Shared { _owner: oxccl::SharedBuffer },
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (at least 1): shareable host memory when `shared`.
    pub fn new(len: usize, shared: bool) -> Result<AlignedBuf, String> {
        if shared {
            let b = oxccl::SharedBuffer::new(len).map_err(|e| format!("shareable buffer of {len} bytes: {e}"))?;
            let ptr = NonNull::new(b.as_ptr()).ok_or("shareable buffer at NULL")?;
            return Ok(AlignedBuf { ptr, len: len.max(1), from: Alloc::Shared { _owner: b } });
        }
        let layout = Layout::from_size_align(len.max(1), ALIGN).map_err(|e| format!("buffer of {len} bytes: {e}"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr)
            .map(|ptr| AlignedBuf { ptr, len: layout.size(), from: Alloc::Heap(layout) })
            .ok_or_else(|| format!("cannot allocate {len} bytes"))
    }
    /// The first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// The whole buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation is initialised (zeroed: the heap's alloc_zeroed, a fresh
        // memfd) and at least `len` bytes long, and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    /// The whole buffer, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Alloc::Heap(layout) = self.from {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
        // A shared buffer frees itself when `from` drops.
    }
}
