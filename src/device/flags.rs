//! Host-shared flag pages for the CUDA IPC path.
//!
//! Each rank owns one page-rounded `memfd` mapping of 32-bit words, registered with CUDA
//! (`cuMemHostRegister`, device-mapped) so that streams write and wait on its words with stream
//! memory operations, while host threads read and write the same words directly. Peers in other
//! processes map it through `/proc/<pid>/fd/<n>` (as the shm transport does) and register their
//! own mapping. Because the flags live in host memory, a host thread can always release a stream
//! waiting on them (abort, timeout, dead peer) without a CUDA call and without depending on a
//! GPU queue that may be blocked behind the very wait it wants to release.
//!
//! **Checks.** The memfd is sealed against any change of size at creation and carries a random
//! cookie in its last bytes (published in the rank's card), and a peer opens it only through the
//! shared-memory opener (`crate::transport::shm::sealed`: a regular file, sealed, of the page's
//! size, holding the card's cookie), so nobody can truncate a page under a mapping (no `SIGBUS`)
//! and a wrong or reused descriptor number is refused. Peers
//! map each other's pages read-write because the protocol needs it: barriers write into the
//! peer's flags, and the watchdog writes the abort and closing words into every peer's page.
//! A page is taken as a same-process peer's only when its address is one of the pages this
//! process made and still holds ([`FlagPage::borrowed`]), whatever the card that names it says.

use super::check;
use crate::error::{Error, Result};
use crate::transport::shm::sealed::{self, Expect, COOKIE_LEN};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// The pages this process made and holds: (host address, length, device address).
static OWN: Mutex<Vec<(u64, usize, u64)>> = Mutex::new(Vec::new());

fn own() -> std::sync::MutexGuard<'static, Vec<(u64, usize, u64)>> {
    crate::sync::lock(&OWN)
}

/// A mapped and CUDA-registered flag page.
pub(crate) struct FlagPage {
    host: *mut u8,
    len: usize,
    dev: u64,
    /// The memfd (kept open by the owner so that peers can open it through /proc).
    fd: Option<RawFd>,
    /// False for a page of a same-process peer: owned (and unregistered) by that peer.
    owned: bool,
    /// The random cookie in the file's last [`COOKIE_LEN`] bytes (zero when not the owner).
    cookie: [u8; COOKIE_LEN],
}

/// Bytes of a flag page of `words` 32-bit words: the words, then the cookie, page-rounded.
pub(crate) fn page_len(words: usize) -> usize {
    (words * 4 + COOKIE_LEN).next_multiple_of(4096)
}

// SAFETY: process-wide shared memory whose words are only accessed atomically.
unsafe impl Send for FlagPage {}
// SAFETY: as above.
unsafe impl Sync for FlagPage {}

impl FlagPage {
    /// Creates a page of at least `words` words ([`page_len`]), zero as every fresh memfd is,
    /// with a fresh cookie and sealed against any change of size (the GPU's context must be
    /// current).
    pub(crate) fn create(words: usize) -> Result<FlagPage> {
        let len = page_len(words);
        let cookie = sealed::cookie()?;
        let fd = sealed::create(c"oxccl-cuda-flags", len, Some(((len - COOKIE_LEN) as u64, &cookie)))?;
        let mut page = Self::map(fd, len).inspect_err(|_| sealed::close_fd(fd))?;
        page.cookie = cookie;
        own().push((page.host as u64, page.len, page.dev));
        Ok(page)
    }

    /// Maps the page that process `pid` exported as descriptor `fd` (another process), once the
    /// opener checked that it is a sealed shared-memory file of `len` bytes holding `cookie` in
    /// its last bytes.
    pub(crate) fn open(pid: u32, fd: i32, len: usize, cookie: &[u8; COOKIE_LEN]) -> Result<FlagPage> {
        let what = format!("the CUDA IPC flags of process {pid}");
        let Ok(fd) = u32::try_from(fd) else {
            return Err(Error::remote(format!("{what}: no descriptor ({fd})")));
        };
        if len < COOKIE_LEN {
            return Err(Error::remote(format!("{what}: a {len}-byte page has no room for its cookie")));
        }
        let at = (len - COOKIE_LEN) as u64;
        let e = Expect { pid, fd, len: len as u64, cookie: Some((at, cookie)), members: None, what: &what };
        let mine = sealed::open_peer(&e, true)?;
        let r = Self::map(mine, len);
        // The mapping (if any) keeps the memory; the descriptor is not needed any more.
        sealed::close_fd(mine);
        r.map(|mut p| {
            p.fd = None;
            p
        })
    }

    /// A same-process peer's page at `host` (`len` bytes), addressed directly (not owned):
    /// refused unless `host` is a page this process made and still holds, of that length.
    /// The device address is this process's own record of it, not the caller's.
    pub(crate) fn borrowed(host: u64, len: usize) -> Result<FlagPage> {
        let Some(&(_, _, dev)) = own().iter().find(|&&(h, l, _)| h == host && l == len) else {
            return Err(Error::remote(format!(
                "a peer's CUDA IPC flags at {host:#x} ({len} bytes) are not a page of this process"
            )));
        };
        Ok(FlagPage { host: host as *mut u8, len, dev, fd: None, owned: false, cookie: [0; COOKIE_LEN] })
    }

    fn map(fd: RawFd, len: usize) -> Result<FlagPage> {
        let p: *mut c_void =
            sealed::mmap(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, "the CUDA IPC flags")?.cast();
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
        Ok(FlagPage { host: p.cast(), len, dev, fd: Some(fd), owned: true, cookie: [0; COOKIE_LEN] })
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

    /// Reads the 64-bit word at 32-bit word `i` (even; acquire).
    pub(crate) fn load64(&self, i: usize) -> u64 {
        assert!(i % 2 == 0 && (i + 2) * 4 <= self.len, "64-bit flag {i} outside a {}-byte page", self.len);
        // SAFETY: in bounds and 8-byte aligned (checked; page-aligned base), mapped while `self`
        // lives, only ever accessed atomically; the atomic view does not outlive this call.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.word(i).cast()) }.load(Ordering::Acquire)
    }

    /// Writes the 64-bit word at 32-bit word `i` (even; release).
    pub(crate) fn store64(&self, i: usize, v: u64) {
        assert!(i % 2 == 0 && (i + 2) * 4 <= self.len, "64-bit flag {i} outside a {}-byte page", self.len);
        // SAFETY: as in `load64`.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.word(i).cast()) }.store(v, Ordering::Release)
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

    /// The page's cookie, which peers check before mapping it (zero when not the owner).
    pub(crate) fn cookie(&self) -> [u8; COOKIE_LEN] {
        self.cookie
    }
}

impl Drop for FlagPage {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        own().retain(|&(h, _, _)| h != self.host as u64);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A memfd of `len` bytes, sealed or not (closed by the caller).
    fn memfd(len: usize, seal: bool) -> RawFd {
        if seal {
            return sealed::create(c"oxccl-test-flags", len, None).unwrap();
        }
        // SAFETY: plain system calls on a fresh descriptor.
        unsafe {
            let fd = libc::memfd_create(c"oxccl-test-flags".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0 && libc::ftruncate(fd, len as libc::off_t) == 0);
            fd
        }
    }

    #[test]
    fn a_peer_page_is_opened_only_when_sealed_of_its_size_and_with_its_cookie() {
        // These are refused before anything is mapped or registered with CUDA.
        let me = std::process::id();
        let bare = memfd(8192, false);
        let c = [7u8; COOKIE_LEN];
        let e = FlagPage::open(me, bare, 8192, &c).err().expect("an unsealed file");
        assert!(e.message().contains("is not a sealed shared-memory file"), "{e}");
        let short = memfd(4096, true);
        let e = FlagPage::open(me, short, 8192, &c).err().expect("a short file");
        assert!(e.message().contains("is not a 8192-byte shared-memory file"), "{e}");
        let e = FlagPage::open(me, -1, 8192, &c).err().expect("no descriptor");
        assert!(e.message().contains("no descriptor"), "{e}");
        // Sealed and of the right size, but another page's cookie (a reused descriptor number).
        let other =
            sealed::create(c"oxccl-test-flags", 8192, Some((8192 - COOKIE_LEN as u64, &[9; COOKIE_LEN]))).unwrap();
        let e = FlagPage::open(me, other, 8192, &c).err().expect("a wrong cookie");
        assert!(e.message().contains("wrong cookie"), "{e}");
        sealed::close_fd(bare);
        sealed::close_fd(short);
        sealed::close_fd(other);
    }

    #[test]
    fn a_page_is_borrowed_only_when_this_process_made_it() {
        // Any address a card names (a peer's, or made up) that is not a page of this process.
        let mut x = [0u32; 1024];
        let e = FlagPage::borrowed(x.as_mut_ptr() as u64, 4096).err().expect("not a page of this process");
        assert!(e.message().contains("not a page of this process"), "{e}");
    }
}
