//! Shareable host memory: what `ncclMemAlloc` returns when no GPU is in use. Each allocation
//! is an anonymous memfd mapped shared, so that the other ranks on the host can map the same
//! pages (`/proc/<pid>/fd/<n>`, as the pair segments and the arena are opened) and read a
//! rank's buffers in place: the host arena (`crate::engine::arena`) then reduces straight out
//! of the ranks' own buffers and copies results straight out of them, instead of copying every
//! input into the arena and every result through it.
//!
//! **Identity.** Every allocation has a process-unique id and a random cookie. A rank names a
//! buffer to its peers as (pid, descriptor number, id, allocation length, offset, cookie); a
//! peer keeps its mappings keyed by (pid, id) ([`PeerMaps`]). A descriptor number is reused
//! only after `ncclMemFree` closed it; a peer that sees a known (pid, descriptor) with a new id
//! drops the old mapping once no call uses it.
//!
//! **Checks.** The memfd is the allocation's bytes and one tail page holding the cookie, sealed
//! against any change of size (`super::sealed`): nobody, the owner included, can truncate it
//! under a peer's mapping. A peer maps it only when the pid is one of the communicator's ranks
//! and the file is sealed, of the described size and holds the described cookie.
//!
//! **Descriptors.** Each allocation keeps its memfd open (a peer opens it through `/proc`), one
//! descriptor per allocation. When none can be made (the process's limit), the allocation is
//! private memory instead, with a warning: it works as any buffer and is copied like one.
//!
//! **Lifetime.** A peer's mapping holds the pages even after the owner freed them. The
//! mappings a call looked up stay mapped until that call ends ([`PeerMaps::begin`],
//! [`PeerMaps::end`]); between calls [`PeerMaps`] keeps at most `max(MAX_PEER_MAPS,
//! 2 (n - 1))` of them (least recently used go first) and unmaps all when the communicator's
//! arena goes.

use super::sealed::{self, close_fd, mmap, open_peer, Expect, COOKIE_LEN};
use super::segment::map;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

/// Most peer allocations a communicator keeps mapped.
pub const MAX_PEER_MAPS: usize = 16;

/// Bytes of the file behind an allocation past its memory: a page that holds the cookie.
const TAIL: usize = 4096;

/// One allocation of this process.
struct Alloc {
    len: usize,
    /// Its memfd; `None` for private memory (no descriptor could be made: never shared).
    fd: Option<RawFd>,
    id: u64,
    /// Random bytes in the file's tail page (at offset `len`), named in its descriptors.
    cookie: [u8; COOKIE_LEN],
}

/// A sealed memfd of `len` bytes and a tail page holding `cookie`, its first `len` bytes
/// mapped shared: the descriptor and the mapping.
fn shareable(len: usize, cookie: &[u8; COOKIE_LEN]) -> Result<(RawFd, *mut u8)> {
    let fd = sealed::create(c"oxccl-mem", len + TAIL, Some((len as u64, cookie)))?;
    match map(fd, len) {
        Ok(base) => Ok((fd, base)),
        Err(e) => {
            close_fd(fd);
            Err(e)
        }
    }
}

fn allocations() -> &'static Mutex<BTreeMap<usize, Alloc>> {
    static A: OnceLock<Mutex<BTreeMap<usize, Alloc>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn lock() -> std::sync::MutexGuard<'static, BTreeMap<usize, Alloc>> {
    crate::sync::lock(allocations())
}

/// Allocates `size` bytes (at least one page, page-aligned, zeroed) of shareable host memory.
pub fn alloc(size: usize) -> Result<*mut u8> {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let len = size
        .max(1)
        .checked_next_multiple_of(4096)
        .ok_or_else(|| Error::invalid_argument(format!("cannot allocate {size} bytes: the size overflows")))?;
    let cookie = sealed::cookie()?;
    let (fd, base) = match shareable(len, &cookie) {
        Ok((fd, base)) => (Some(fd), base),
        Err(e) => {
            // Out of descriptors (one per allocation) or no memfd: private memory, which
            // works as any buffer and is copied like one.
            let private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
            let Ok(p) = mmap(len, libc::PROT_READ | libc::PROT_WRITE, private, -1, "private memory") else {
                return Err(e);
            };
            crate::warn!("ncclMemAlloc: {e}; {len} bytes of private memory instead (not read in place by other ranks)");
            (None, p)
        }
    };
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    lock().insert(base as usize, Alloc { len, fd, id, cookie });
    Ok(base)
}

/// Frees an allocation of [`alloc`] given its start; `false` when `ptr` is not one.
pub fn free(ptr: *mut u8) -> bool {
    let Some(a) = lock().remove(&(ptr as usize)) else { return false };
    // SAFETY: `ptr`/`a.len` is the mapping made in `alloc`, unmapped once (removed above).
    unsafe { libc::munmap(ptr.cast(), a.len) };
    if let Some(fd) = a.fd {
        close_fd(fd);
    }
    true
}

/// A block of shareable host memory (what `ncclMemAlloc` returns on the host: zeroed,
/// page-aligned), freed when dropped. Collectives on buffers inside it let the other ranks of
/// the host read them where they lie (the host arena, `OXCCL_ARENA`).
#[derive(Debug)]
pub struct SharedBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the memory is a process-wide shared mapping owned by the value; it hands out only
// its address.
unsafe impl Send for SharedBuffer {}
// SAFETY: as above; `&SharedBuffer` gives only the address and length.
unsafe impl Sync for SharedBuffer {}

impl SharedBuffer {
    /// Allocates `len` bytes (at least one page).
    pub fn new(len: usize) -> Result<SharedBuffer> {
        let p = alloc(len)?;
        let ptr = std::ptr::NonNull::new(p).ok_or_else(|| Error::internal("mmap returned NULL"))?;
        Ok(SharedBuffer { ptr, len })
    }

    /// The start of the memory (`len()` bytes, readable and writable while `self` lives).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        free(self.ptr.as_ptr());
    }
}

/// How a peer finds `len` bytes of a buffer of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BufDesc {
    /// The owner's process id.
    pub pid: u32,
    /// The allocation's memfd number in the owner.
    pub fd: u32,
    /// The allocation's id (0: no shareable buffer).
    pub id: u64,
    /// The allocation's length.
    pub alloc_len: u64,
    /// The buffer's offset in the allocation.
    pub off: u64,
    /// The allocation's random cookie (also in its file, past the memory).
    pub cookie: [u8; COOKIE_LEN],
}

/// Bytes of an encoded [`BufDesc`].
pub const DESC_LEN: usize = 32 + COOKIE_LEN;

impl BufDesc {
    /// The descriptor as bytes.
    pub fn encode(&self) -> [u8; DESC_LEN] {
        let mut b = [0u8; DESC_LEN];
        b[0..4].copy_from_slice(&self.pid.to_le_bytes());
        b[4..8].copy_from_slice(&self.fd.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.alloc_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.off.to_le_bytes());
        b[32..].copy_from_slice(&self.cookie);
        b
    }

    /// Decodes [`BufDesc::encode`]'s bytes.
    pub fn decode(b: &[u8; DESC_LEN]) -> BufDesc {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        BufDesc {
            pid: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            fd: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            id: u64_at(8),
            alloc_len: u64_at(16),
            off: u64_at(24),
            cookie: b[32..].try_into().expect("cookie bytes"),
        }
    }

    /// Whether it names a buffer.
    pub fn is_some(&self) -> bool {
        self.id != 0
    }
}

/// The descriptor of the `len` bytes at `ptr` when they lie inside one allocation of
/// [`alloc`]; `None` otherwise (or for no bytes).
pub fn find(ptr: *const u8, len: usize) -> Option<BufDesc> {
    let p = ptr as usize;
    if len == 0 {
        return None;
    }
    let allocs = lock();
    let (&base, a) = allocs.range(..=p).next_back()?;
    let end = p.checked_add(len)?;
    let fd = a.fd?;
    (end <= base + a.len).then(|| BufDesc {
        pid: std::process::id(),
        fd: fd as u32,
        id: a.id,
        alloc_len: a.len as u64,
        off: (p - base) as u64,
        cookie: a.cookie,
    })
}

/// A peer allocation mapped into this process (read-only).
struct PeerMap {
    pid: u32,
    fd: u32,
    id: u64,
    base: *mut u8,
    len: usize,
    /// The call that used it last ([`PeerMaps::begin`]'s number): pinned while that call runs.
    used: u64,
    /// Its descriptor number now names another allocation: unmapped when the call ends.
    stale: bool,
}

/// The peers' allocations this process mapped (one set per communicator's arena).
///
/// A call brackets its look-ups with [`PeerMaps::begin`] and [`PeerMaps::end`]: every mapping
/// it looked up stays mapped until `end` (its addresses are in use until then), whatever the
/// bound; between calls at most [`PeerMaps::bound`] mappings are kept, least recently used
/// going first.
#[derive(Default)]
pub struct PeerMaps {
    maps: Vec<PeerMap>,
    /// The number of the call in flight (or of the last one).
    call: u64,
    /// Most mappings kept between calls.
    bound: usize,
}

// SAFETY: the mappings are process-wide memory; `PeerMaps` hands out addresses only.
unsafe impl Send for PeerMaps {}

impl PeerMaps {
    /// Starts a call on `nranks` ranks: the mappings it looks up are pinned until
    /// [`PeerMaps::end`]. Between calls at least `2 (nranks - 1)` mappings are kept (one call's
    /// send and receive buffers of every peer) and at least [`MAX_PEER_MAPS`].
    pub fn begin(&mut self, nranks: usize) {
        self.call += 1;
        self.bound = MAX_PEER_MAPS.max(2 * nranks.saturating_sub(1));
    }

    /// Ends the call: unmaps the mappings whose descriptor was reused and, least recently used
    /// first, those beyond the bound. The addresses the call got are invalid from here on.
    pub fn end(&mut self) {
        self.maps.retain(|m| {
            if m.stale {
                unmap(m);
            }
            !m.stale
        });
        while self.maps.len() > self.bound {
            let oldest = (0..self.maps.len()).min_by_key(|&i| self.maps[i].used).expect("not empty");
            unmap(&self.maps.swap_remove(oldest));
        }
    }

    /// Most mappings kept between calls (set by [`PeerMaps::begin`]).
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// The address in this process of the buffer `d` names, `need` bytes long, readable, valid
    /// until [`PeerMaps::end`]: the peer's allocation is mapped (read-only) on first use and
    /// kept. Fails when the allocation cannot be opened or is not as described (see
    /// `super::sealed::open_peer`), or the bytes lie outside it. `members`: the process ids of the
    /// communicator's ranks; `d.pid` must be one of them.
    pub fn resolve(&mut self, d: &BufDesc, need: usize, members: &[u32]) -> Result<*const u8> {
        let inside = d.off.checked_add(need as u64).is_some_and(|e| e <= d.alloc_len);
        if !inside {
            return Err(Error::remote(format!(
                "a peer's buffer ({need} bytes at offset {}) lies outside its {}-byte allocation",
                d.off, d.alloc_len
            )));
        }
        // A reused descriptor number means the allocation it named was freed: its mapping goes
        // now, or at the end of the call when this call uses it.
        let call = self.call;
        self.maps.retain_mut(|m| {
            let stale = m.pid == d.pid && m.fd == d.fd && m.id != d.id;
            if stale && m.used != call {
                unmap(m);
                return false;
            }
            m.stale |= stale;
            true
        });
        if let Some(m) = self.maps.iter_mut().find(|m| m.pid == d.pid && m.id == d.id && !m.stale) {
            if m.len as u64 != d.alloc_len {
                return Err(Error::remote(format!(
                    "a peer's buffer names a {}-byte allocation that is {} bytes",
                    d.alloc_len, m.len
                )));
            }
            m.used = call;
            // SAFETY: `off + need <= alloc_len == m.len` (checked above).
            return Ok(unsafe { m.base.add(d.off as usize) }.cast_const());
        }
        let (base, len) = open(d, members)?;
        self.maps.push(PeerMap { pid: d.pid, fd: d.fd, id: d.id, base, len, used: call, stale: false });
        // SAFETY: as above: the mapping is `alloc_len` bytes.
        Ok(unsafe { base.add(d.off as usize) }.cast_const())
    }

    /// Peer allocations mapped now.
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// Whether none is mapped.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

impl Drop for PeerMaps {
    fn drop(&mut self) {
        for m in &self.maps {
            unmap(m);
        }
    }
}

fn unmap(m: &PeerMap) {
    // SAFETY: `base`/`len` is a mapping made in `open`, unmapped once (its entry goes with it).
    unsafe { libc::munmap(m.base.cast(), m.len) };
}

/// Maps the allocation `d` names, read-only, once [`open_peer`] checked that `d.pid` is one
/// of `members` and that the file is sealed, of the allocation's size plus its tail page, and
/// holds `d.cookie` there.
fn open(d: &BufDesc, members: &[u32]) -> Result<(*mut u8, usize)> {
    let file = d.alloc_len.checked_add(TAIL as u64).filter(|_| d.alloc_len > 0);
    let Some(file) = file else {
        return Err(Error::remote(format!("a peer's buffer names a {}-byte allocation", d.alloc_len)));
    };
    let e = Expect {
        pid: d.pid,
        fd: d.fd,
        len: file,
        cookie: Some((d.alloc_len, &d.cookie)),
        members: Some(members),
        what: "a peer's buffer",
    };
    let fd = open_peer(&e, false)?;
    let len = d.alloc_len as usize;
    // Read-only: peers only read each other's buffers; a bug here cannot write into the owner's.
    let p = mmap(len, libc::PROT_READ, libc::MAP_SHARED, fd, "a peer's buffer");
    close_fd(fd);
    Ok((p?, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_mapping_sees_the_owners_bytes_and_follows_reallocation() {
        let a = alloc(10_000).unwrap();
        // SAFETY: `a` holds 12288 bytes (rounded up to pages).
        unsafe { *a.add(5000) = 42 };
        let d = find(a.cast_const().wrapping_add(4096), 2000).expect("inside the allocation");
        assert_eq!((d.off, d.alloc_len), (4096, 12288));
        assert_eq!(BufDesc::decode(&d.encode()), d);
        assert!(find(a.cast_const().wrapping_add(12000), 1000).is_none(), "past the end");
        assert!(find(a.cast_const(), 0).is_none());
        let mut maps = PeerMaps::default();
        let me = [std::process::id()];
        maps.begin(2);
        let p = maps.resolve(&d, 2000, &me).unwrap();
        // SAFETY: `p` maps offset 4096 of the allocation (read-only); 904 bytes in is offset
        // 5000, 905 is 5001.
        unsafe {
            assert_eq!(*p.add(904), 42);
            *a.add(5001) = 7;
            assert_eq!(*p.add(905), 7, "the mapping shows the owner's later writes");
        }
        assert!(maps.resolve(&d, 9000, &me).is_err(), "bytes outside the allocation are refused");
        maps.end();
        assert!(free(a));
        assert!(!free(a), "a second free is refused");
        // A new allocation may reuse the descriptor number: the old mapping goes.
        let b = alloc(4096).unwrap();
        let e = find(b, 4096).unwrap();
        assert_ne!(e.id, d.id);
        maps.begin(2);
        maps.resolve(&e, 4096, &me).unwrap();
        maps.end();
        if e.fd == d.fd {
            assert_eq!(maps.len(), 1);
        }
        let mut fresh = PeerMaps::default();
        fresh.begin(2);
        let bad = BufDesc { alloc_len: 8192, ..e };
        assert!(fresh.resolve(&bad, 10, &me).is_err(), "a wrong length is refused");
        let bad = BufDesc { cookie: [7; COOKIE_LEN], ..e };
        let err = fresh.resolve(&bad, 10, &me).expect_err("a wrong cookie is refused");
        assert!(err.message().contains("wrong cookie"), "{err}");
        let err = fresh.resolve(&e, 10, &[1]).expect_err("a pid outside the communicator is refused");
        assert!(err.message().contains("not a rank of this communicator"), "{err}");
        // The owner cannot truncate its own allocation under a peer's mapping.
        let fd = e.fd as RawFd;
        // SAFETY: plain system calls on this process's memfd of `b`.
        unsafe {
            assert_ne!(libc::ftruncate(fd, 0), 0);
            assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        }
        assert!(free(b));
    }

    /// The body of [`without_descriptors_memory_is_private_and_never_shared`], in a child
    /// process of its own (the descriptor limit is the process's).
    #[test]
    fn fd_child() {
        if crate::config::environ::var("OXCCL_TEST_FD_CHILD").is_none() {
            return;
        }
        let low = libc::rlimit { rlim_cur: 64, rlim_max: 64 };
        // SAFETY: `low` is a valid limit; this process runs this test alone.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        let mut held = Vec::new();
        let mut private = None;
        for _ in 0..200 {
            match alloc(4096) {
                Ok(p) if find(p, 1).is_some() => held.push(p),
                Ok(p) => {
                    private = Some(p);
                    break;
                }
                Err(e) => panic!("no fallback: {e}"),
            }
        }
        let p = private.expect("the descriptor limit was reached");
        // SAFETY: a page of the private allocation.
        unsafe {
            *p.add(4095) = 3;
            assert_eq!(*p.add(4095), 3);
        }
        assert!(find(p, 1).is_none(), "private memory is not shared");
        assert!(free(p));
        let shared = held.len();
        for p in held {
            assert!(free(p));
        }
        println!("FD_CHILD_OK after {shared} shared allocations");
    }

    #[test]
    fn without_descriptors_memory_is_private_and_never_shared() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "transport::shm::hostmem::tests::fd_child", "--nocapture", "--test-threads=1"])
            .env("OXCCL_TEST_FD_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("FD_CHILD_OK"), "{text}");
    }

    #[test]
    fn mappings_a_call_uses_stay_until_it_ends_and_are_bounded_between_calls() {
        let me = [std::process::id()];
        let n = MAX_PEER_MAPS + 7;
        let bufs: Vec<*mut u8> = (0..n).map(|_| alloc(4096).unwrap()).collect();
        for (i, &b) in bufs.iter().enumerate() {
            // SAFETY: each allocation holds a page.
            unsafe { *b = i as u8 };
        }
        // One call on 4 ranks (bound 16) looks up more allocations than the bound: every
        // address it got still shows its allocation's bytes until the call ends.
        let mut maps = PeerMaps::default();
        maps.begin(4);
        let got: Vec<*const u8> = bufs.iter().map(|&b| maps.resolve(&find(b, 1).unwrap(), 1, &me).unwrap()).collect();
        assert_eq!(maps.len(), n, "nothing is unmapped during the call");
        for (i, &p) in got.iter().enumerate() {
            // SAFETY: `p` is mapped until `end`.
            assert_eq!(unsafe { *p }, i as u8, "allocation {i} seen through its own mapping");
        }
        maps.end();
        assert_eq!(maps.len(), MAX_PEER_MAPS, "the bound applies between calls");
        // A call on 16 ranks keeps 2 (16 - 1) mappings between calls.
        maps.begin(16);
        assert_eq!(maps.bound(), 30);
        for &b in &bufs {
            maps.resolve(&find(b, 1).unwrap(), 1, &me).unwrap();
        }
        maps.end();
        assert_eq!(maps.len(), n);
        // A reused (pid, descriptor) with a new id: the old mapping stays while the call that
        // used it runs, and goes at its end.
        maps.begin(16);
        let d = find(bufs[0], 1).unwrap();
        let old = maps.resolve(&d, 1, &me).unwrap();
        let twin = BufDesc { id: d.id + 1_000_000, ..d };
        let _ = maps.resolve(&twin, 1, &me).unwrap();
        // SAFETY: the call is still in flight: `old` is mapped.
        assert_eq!(unsafe { *old }, 0, "the call's mapping stays while it runs");
        let before = maps.len();
        maps.end();
        assert_eq!(maps.len(), before - 1, "the stale mapping goes when the call ends");
        for b in bufs {
            assert!(free(b));
        }
    }
}
