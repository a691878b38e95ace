//! Host-shared flag pages for the CUDA IPC path.
//!
//! Each rank owns one page-rounded `memfd` mapping of 32-bit words, registered with CUDA
//! (`cuMemHostRegister`, device-mapped) so that streams write and wait on its words with stream
//! memory operations, while host threads read and write the same words directly. Peers in other
//! processes map it through `/proc/<pid>/fd/<n>` (as the shm transport does) and register their
//! own mapping. Because the flags live in host memory, a host thread can always release a stream
//! waiting on them (abort, timeout, dead peer) without a CUDA call and without depending on a
//! GPU queue that may be blocked behind the very wait it wants to release.

use super::check;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};

/// A mapped and CUDA-registered flag page.
pub(crate) struct FlagPage {
    host: *mut u8,
    len: usize,
    dev: u64,
    /// The memfd (kept open by the owner so that peers can open it through /proc).
    fd: Option<RawFd>,
    /// False for a page of a same-process peer: owned (and unregistered) by that peer.
    owned: bool,
}

// SAFETY: process-wide shared memory whose words are only accessed atomically.
unsafe impl Send for FlagPage {}
// SAFETY: as above.
unsafe impl Sync for FlagPage {}

fn os_err(what: &str) -> Error {
    Error::from_io(what, std::io::Error::last_os_error())
}

impl FlagPage {
    /// Creates a zeroed page of at least `words` words (the GPU's context must be current).
    pub(crate) fn create(words: usize) -> Result<FlagPage> {
        let len = (words * 4).next_multiple_of(4096);
        // SAFETY: plain system call; the name is NUL-terminated.
        let fd = unsafe { libc::memfd_create(c"oxccl-cuda-flags".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create for CUDA IPC flags"));
        }
        // SAFETY: `fd` is our fresh memfd.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = os_err("ftruncate of the CUDA IPC flags");
            // SAFETY: closes the descriptor opened above.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Self::map(fd, len, true).inspect_err(|_| {
            // SAFETY: closes the descriptor opened above (the mapping failed).
            unsafe { libc::close(fd) };
        })
    }

    /// Maps the page that process `pid` exported as descriptor `fd` (another process).
    pub(crate) fn open(pid: u32, fd: i32, len: usize) -> Result<FlagPage> {
        let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no NUL");
        // SAFETY: plain system call on a NUL-terminated path.
        let mine = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if mine < 0 {
            return Err(os_err(&format!("opening the CUDA IPC flags of process {pid}")));
        }
        let r = Self::map(mine, len, false);
        // SAFETY: the mapping (if any) keeps the memory; the descriptor is not needed any more.
        unsafe { libc::close(mine) };
        r.map(|mut p| {
            p.fd = None;
            p
        })
    }

    /// A same-process peer's page, addressed directly (not owned).
    pub(crate) fn borrowed(host: u64, len: usize, dev: u64) -> FlagPage {
        FlagPage { host: host as *mut u8, len, dev, fd: None, owned: false }
    }

    fn map(fd: RawFd, len: usize, zero: bool) -> Result<FlagPage> {
        // SAFETY: a fresh shared mapping of a descriptor we hold; the kernel picks the address.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap of the CUDA IPC flags"));
        }
        if zero {
            // SAFETY: `len` writable bytes just mapped.
            unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        }
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: registers the mapping just made (unregistered in Drop).
        let r = check(unsafe { sys::cuMemHostRegister_v2(p, len, flags) }, "cuMemHostRegister(CUDA IPC flags)");
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: the range was registered device-mapped just above.
        let r = r.and_then(|()| {
            check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) }, "cuMemHostGetDevicePointer(flags)")
        });
        if let Err(e) = r {
            // SAFETY: unmaps the mapping made above (registration, if any, is dropped with it).
            unsafe {
                sys::cuMemHostUnregister(p);
                libc::munmap(p, len);
            }
            return Err(e);
        }
        Ok(FlagPage { host: p.cast(), len, dev, fd: Some(fd), owned: true })
    }

    /// Address of word `i` (bounds-checked).
    fn word(&self, i: usize) -> *mut u32 {
        assert!((i + 1) * 4 <= self.len, "flag {i} outside a {}-byte page", self.len);
        self.host.wrapping_add(i * 4).cast()
    }

    /// Reads word `i` (acquire).
    pub(crate) fn load(&self, i: usize) -> u32 {
        // SAFETY: in bounds (checked), 4-byte aligned (page-aligned base), mapped while `self`
        // lives, and only ever accessed atomically (host atomics here, 32-bit stream memory
        // operations on the GPU); the atomic view does not outlive this call.
        unsafe { AtomicU32::from_ptr(self.word(i)) }.load(Ordering::Acquire)
    }

    /// Writes word `i` (release).
    pub(crate) fn store(&self, i: usize, v: u32) {
        // SAFETY: as in `load`.
        unsafe { AtomicU32::from_ptr(self.word(i)) }.store(v, Ordering::Release)
    }

    /// Device address of word `i`.
    pub(crate) fn dev(&self, i: usize) -> u64 {
        self.dev + (i * 4) as u64
    }

    /// Host address of the page (published to same-process peers).
    pub(crate) fn host_addr(&self) -> u64 {
        self.host as u64
    }

    /// Device address of the page.
    pub(crate) fn dev_addr(&self) -> u64 {
        self.dev
    }

    /// The memfd number peers open through /proc (-1 when not the owner).
    pub(crate) fn fd(&self) -> i32 {
        self.fd.unwrap_or(-1)
    }
}

impl Drop for FlagPage {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: registered and mapped in `map`; the owner drops it only after its streams no
        // longer use it (drained or leaked by the caller otherwise).
        unsafe {
            sys::cuMemHostUnregister(self.host.cast());
            libc::munmap(self.host.cast(), self.len);
            if let Some(fd) = self.fd {
                libc::close(fd);
            }
        }
    }
}
