//! Files shared between the processes of a host: every one (pair segments, the host arena,
//! `ncclMemAlloc` buffers, the CUDA IPC flag pages) is an anonymous memfd made here, sized, then
//! sealed against any change of size ([`SEALS`]), with a random cookie in it; a peer opens one
//! only through `open_peer`, which checks the process, the file's type, seals, size and
//! cookie before anything is mapped.
//!
//! **Why seals.** A process of the same user can open a rank's memfd through
//! `/proc/<pid>/fd/<n>`; were the file not sealed, a `ftruncate` by it (or by the owner) would
//! make every rank that maps the file die of `SIGBUS` at its next access. With
//! `F_SEAL_SHRINK | F_SEAL_GROW` nobody can change the size any more (`EPERM`), and
//! `F_SEAL_SEAL` stops anyone from adding or lifting seals. Checking the seals before the size
//! closes the race between the check and a later change.
//!
//! **Why a cookie.** A descriptor names a file by (pid, descriptor number), which any process
//! may reuse for another file; the random cookie, written in the file by its creator and sent
//! in the descriptor, proves that the file opened is the one the descriptor was made for.

use crate::error::{Error, Result};
use std::os::fd::RawFd;

/// The seals every shared file carries: no change of size, no change of seals.
pub const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
/// Bytes of a file's random cookie.
pub const COOKIE_LEN: usize = 16;

/// The last OS error, with what failed.
pub(crate) fn os_err(what: &str) -> Error {
    Error::from_io(what, std::io::Error::last_os_error())
}

/// A fresh random cookie, from `getrandom(2)` (no descriptor: an allocation must not fail for
/// want of one).
pub(crate) fn cookie() -> Result<[u8; COOKIE_LEN]> {
    let mut c = [0u8; COOKIE_LEN];
    let mut got = 0;
    while got < COOKIE_LEN {
        // SAFETY: writes at most `COOKIE_LEN - got` bytes into the rest of `c`.
        let n = unsafe { libc::getrandom(c[got..].as_mut_ptr().cast(), COOKIE_LEN - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::from_io("getrandom for a shared-memory cookie", e));
        }
        got += n as usize;
    }
    Ok(c)
}

/// A fresh memfd named `name` (close-on-exec) of `len` bytes with `cookie` written at offset
/// `cookie_at` (when given), sealed with [`SEALS`]. The caller maps and closes it.
pub(crate) fn create(name: &std::ffi::CStr, len: usize, cookie: Option<(u64, &[u8; COOKIE_LEN])>) -> Result<RawFd> {
    let what = name.to_string_lossy();
    // SAFETY: `name` is NUL-terminated.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(os_err(&format!("memfd_create of {what}")));
    }
    let fail = |e: Error| {
        close_fd(fd);
        Err(e)
    };
    // SAFETY: `fd` is our fresh memfd.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        return fail(os_err(&format!("ftruncate of {what} to {len} bytes")));
    }
    if let Some((at, c)) = cookie {
        // SAFETY: `c` holds COOKIE_LEN readable bytes; `fd` is ours.
        let n = unsafe { libc::pwrite(fd, c.as_ptr().cast(), COOKIE_LEN, at as libc::off_t) };
        if n != COOKIE_LEN as isize {
            return fail(os_err(&format!("writing the cookie of {what}")));
        }
    }
    // SAFETY: `fd` is our memfd, created with MFD_ALLOW_SEALING.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, SEALS) } != 0 {
        return fail(os_err(&format!("sealing {what}")));
    }
    Ok(fd)
}

/// What a peer's shared file must be for [`open_peer`] to open it.
pub(crate) struct Expect<'a> {
    /// The owner's process id.
    pub pid: u32,
    /// The file's descriptor number in the owner.
    pub fd: u32,
    /// The file's size in bytes.
    pub len: u64,
    /// The cookie and its offset in the file (`None`: the caller checks none).
    pub cookie: Option<(u64, &'a [u8; COOKIE_LEN])>,
    /// The process ids of the communicator's ranks (`None`: the caller knows none yet).
    pub members: Option<&'a [u32]>,
    /// The file, for errors ("the peer's segment").
    pub what: &'a str,
}

/// Opens descriptor `e.fd` of process `e.pid` through `/proc` (read-write or read-only) and
/// checks, in order: the pid is a member's; the size is sane; the file is a regular file
/// sealed with [`SEALS`]; its size is `e.len`; the cookie is in it. The caller maps it and
/// closes the descriptor; the file's size cannot change any more.
pub(crate) fn open_peer(e: &Expect<'_>, write: bool) -> Result<RawFd> {
    let what = e.what;
    if let Some(m) = e.members {
        if !m.contains(&e.pid) {
            return Err(Error::remote(format!(
                "{what}: process {} is not a rank of this communicator (expected one of {m:?})",
                e.pid
            )));
        }
    }
    let cookie_end = e.cookie.map_or(Some(0), |(at, _)| at.checked_add(COOKIE_LEN as u64));
    if e.len == 0 || e.len > isize::MAX as u64 || cookie_end.is_none_or(|end| end > e.len) {
        return Err(Error::remote(format!("{what}: a size of {} bytes is not valid", e.len)));
    }
    let path = format!("/proc/{}/fd/{}\0", e.pid, e.fd);
    let flags = if write { libc::O_RDWR } else { libc::O_RDONLY };
    // SAFETY: `path` is NUL-terminated.
    let fd = unsafe { libc::open(path.as_ptr().cast(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(os_err(&format!("opening {what} {}", path.trim_end_matches('\0'))));
    }
    match check(fd, e) {
        Ok(()) => Ok(fd),
        Err(err) => {
            close_fd(fd);
            Err(err)
        }
    }
}

/// The checks of [`open_peer`] on the descriptor it opened.
fn check(fd: RawFd, e: &Expect<'_>) -> Result<()> {
    let what = e.what;
    // SAFETY: plain system call on our descriptor.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 || seals & SEALS != SEALS {
        return Err(Error::remote(format!("{what} is not a sealed shared-memory file (seals {seals:#x})")));
    }
    // SAFETY: a zeroed stat is a valid out-parameter; `fd` is ours.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG;
    if !ok || st.st_size as u64 != e.len {
        return Err(Error::remote(format!("{what} is not a {}-byte shared-memory file ({} bytes)", e.len, st.st_size)));
    }
    if let Some((at, want)) = e.cookie {
        let mut got = [0u8; COOKIE_LEN];
        // SAFETY: `got` holds COOKIE_LEN writable bytes; `fd` is ours.
        let n = unsafe { libc::pread(fd, got.as_mut_ptr().cast(), COOKIE_LEN, at as libc::off_t) };
        if n != COOKIE_LEN as isize || got != *want {
            return Err(Error::remote(format!("{what} has the wrong cookie (not the file its descriptor names)")));
        }
    }
    Ok(())
}

/// A fresh mapping of `len` bytes of `fd` (`-1` with `MAP_ANONYMOUS`) with `prot` and `flags`;
/// `what` names it in the error.
pub(crate) fn mmap(len: usize, prot: libc::c_int, flags: libc::c_int, fd: RawFd, what: &str) -> Result<*mut u8> {
    // SAFETY: a fresh mapping (of a descriptor the caller holds, or anonymous); the kernel
    // picks the address, so no existing memory is replaced.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(os_err(&format!("mmap of {what}")));
    }
    Ok(p.cast())
}

/// Closes a descriptor this module (or its caller) opened, once.
pub(crate) fn close_fd(fd: RawFd) {
    // SAFETY: `fd` is a descriptor the caller owns and closes once.
    unsafe { libc::close(fd) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        std::process::id()
    }

    fn expect<'a>(fd: RawFd, len: u64, cookie: &'a [u8; COOKIE_LEN], members: Option<&'a [u32]>) -> Expect<'a> {
        Expect { pid: me(), fd: fd as u32, len, cookie: Some((64, cookie)), members, what: "the test file" }
    }

    #[test]
    fn a_sealed_file_opens_and_cannot_change_size() {
        let c = cookie().unwrap();
        let fd = create(c"oxccl-test", 8192, Some((64, &c))).unwrap();
        let members = [1, me()];
        let peer = open_peer(&expect(fd, 8192, &c, Some(&members)), true).expect("the file as described");
        for f in [fd, peer] {
            // SAFETY: plain system calls on our descriptors.
            unsafe {
                assert_ne!(libc::ftruncate(f, 4096), 0, "shrinking a sealed file");
                assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
                assert_ne!(libc::ftruncate(f, 16384), 0, "growing a sealed file");
                assert_ne!(libc::fcntl(f, libc::F_ADD_SEALS, libc::F_SEAL_WRITE), 0, "the seals are sealed");
            }
        }
        close_fd(peer);
        close_fd(fd);
    }

    #[test]
    fn the_opener_refuses_a_wrong_cookie_size_seal_or_pid() {
        let c = cookie().unwrap();
        let fd = create(c"oxccl-test", 8192, Some((64, &c))).unwrap();
        let msg = |e: &Expect<'_>| open_peer(e, false).map(close_fd).expect_err("refused").message().to_string();
        let wrong = [c[0] ^ 1; COOKIE_LEN];
        assert!(msg(&expect(fd, 8192, &wrong, None)).contains("wrong cookie"));
        assert!(msg(&expect(fd, 4096, &c, None)).contains("not a 4096-byte shared-memory file"));
        assert!(msg(&expect(fd, 0, &c, None)).contains("not valid"));
        let others = [1u32, 2];
        assert!(msg(&expect(fd, 8192, &c, Some(&others))).contains("is not a rank of this communicator"));
        // An unsealed memfd of the right size and cookie, and a memfd that allows no sealing.
        for flags in [libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING, libc::MFD_CLOEXEC] {
            // SAFETY: plain system calls; the descriptor is closed below.
            let bare = unsafe { libc::memfd_create(c"oxccl-bare".as_ptr(), flags) };
            assert!(bare >= 0);
            // SAFETY: as above.
            unsafe {
                assert_eq!(libc::ftruncate(bare, 8192), 0);
                assert_eq!(libc::pwrite(bare, c.as_ptr().cast(), COOKIE_LEN, 64), COOKIE_LEN as isize);
            }
            assert!(msg(&expect(bare, 8192, &c, None)).contains("is not a sealed shared-memory file"));
            close_fd(bare);
        }
        // Not a descriptor of that process at all.
        assert!(msg(&expect(-5i32, 8192, &c, None)).contains("opening the test file"));
        close_fd(fd);
    }
}
