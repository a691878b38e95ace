//! The shared segment of a shm link: an anonymous memfd mapped by both ranks, a header page
//! (magic, cookie, ring capacity, the single-copy header), the two pages of the small-message
//! lane (`super::lane`) and two rings behind them.

use super::super::cma::{self, Header};
use super::super::ring;
use super::sealed::{self, close_fd, mmap, open_peer, Expect};
use crate::error::{Error, Result};
use std::os::fd::RawFd;

/// Magic at the start of a segment.
const MAGIC: &[u8; 8] = b"OXSHM\0\0\x02";
/// Bytes of the segment header (magic, cookie, ring capacity) in front of the two rings.
const SEG_HEADER: usize = 4096;
/// Bytes in front of the rings: the header page and the lane's pages.
const FRONT: usize = SEG_HEADER + super::lane::BYTES;
/// Length of the random cookie that proves the peer mapped the right memory.
pub use sealed::COOKIE_LEN;
/// Offset of the cookie in the header.
const COOKIE_AT: u64 = 8;

/// A mapped segment: header page, lane pages, ring 0 (creator → opener), ring 1 (opener →
/// creator).
pub struct Segment {
    base: *mut u8,
    len: usize,
    pub(super) cap: usize,
    fd: Option<RawFd>,
    /// The opener's single-copy verdict for ring 0, with its reason (for the log).
    pub(super) cma_why: String,
}

// SAFETY: the mapping is process-wide memory; the rings built on it synchronise through atomics.
unsafe impl Send for Segment {}
// SAFETY: as above; `Segment` itself only hands out its base address.
unsafe impl Sync for Segment {}

/// Maps `len` bytes of `fd` shared, read-write, pre-faulted.
pub(super) fn map(fd: RawFd, len: usize) -> Result<*mut u8> {
    mmap(
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED | libc::MAP_POPULATE,
        fd,
        "the shared-memory segment",
    )
}

/// A fresh sealed memfd named `name` of `len` bytes with `cookie` at its offset
/// ([`sealed::create`]), mapped shared: its descriptor and the mapping's start (the caller
/// unmaps `len` bytes and closes the descriptor).
pub(super) fn memfd(
    name: &std::ffi::CStr,
    len: usize,
    cookie: Option<(u64, &[u8; COOKIE_LEN])>,
) -> Result<(RawFd, *mut u8)> {
    let fd = sealed::create(name, len, cookie)?;
    match map(fd, len) {
        Ok(base) => Ok((fd, base)),
        Err(e) => {
            close_fd(fd);
            Err(e)
        }
    }
}

/// What the creator tells the peer so it can open the segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// Creator's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the creator.
    pub fd: u32,
    /// Segment length in bytes.
    pub len: u64,
    /// Random bytes written in the header.
    pub cookie: [u8; COOKIE_LEN],
}

impl Segment {
    /// Creates a segment with two rings of `cap` data bytes each (a power of two); the memfd
    /// stays open (for the peer to open through /proc) until [`Segment::close_fd`].
    pub fn create(cap: usize) -> Result<(Segment, Descriptor)> {
        assert!(cap.is_power_of_two() && cap >= 4096, "ring capacity must be a power of two >= 4096");
        let len = FRONT + 2 * ring::ring_bytes(cap);
        let cookie = sealed::cookie()?;
        let (fd, base) = memfd(c"oxccl-shm", len, Some((COOKIE_AT, &cookie)))?;
        let mut seg = Segment { base, len, cap, fd: Some(fd), cma_why: String::new() };
        let hdr = seg.header_mut();
        hdr[24..32].copy_from_slice(&(cap as u64).to_le_bytes());
        for r in 0..2 {
            // SAFETY: each ring's memory lies inside the fresh mapping; no end exists yet.
            unsafe { ring::init(seg.ring_base(r), cap) };
        }
        seg.cma_header().publish_self(0);
        // The magic goes last: a header with it is complete.
        seg.header_mut()[..8].copy_from_slice(MAGIC);
        let desc = Descriptor { pid: std::process::id(), fd: fd as u32, len: len as u64, cookie };
        Ok((seg, desc))
    }

    /// Opens and maps the segment another process created, checking its size, magic and cookie.
    pub fn open(d: &Descriptor) -> Result<Segment> {
        Segment::open_with(d, cma::setting())
    }

    /// [`Segment::open`] with single copy set up as `set` says.
    pub(super) fn open_with(d: &Descriptor, set: Option<crate::config::CmaSetting>) -> Result<Segment> {
        if d.len < (FRONT + 2 * ring::ring_bytes(4096)) as u64 {
            return Err(Error::remote(format!("the peer's segment of {} bytes is too small", d.len)));
        }
        let e = Expect {
            pid: d.pid,
            fd: d.fd,
            len: d.len,
            cookie: Some((COOKIE_AT, &d.cookie)),
            members: None,
            what: "the peer's segment",
        };
        let fd = open_peer(&e, true)?;
        let mapped = map(fd, d.len as usize);
        close_fd(fd);
        let mut seg = Segment { base: mapped?, len: d.len as usize, cap: 0, fd: None, cma_why: String::new() };
        let hdr = seg.header();
        let cap = u64::from_le_bytes(hdr[24..32].try_into().expect("8 bytes")) as usize;
        if &hdr[..8] != MAGIC || hdr[8..8 + COOKIE_LEN] != d.cookie {
            return Err(Error::remote("the peer's segment has the wrong magic or cookie"));
        }
        if !cap.is_power_of_two() || cap < 4096 || FRONT + 2 * ring::ring_bytes(cap) != seg.len {
            return Err(Error::remote(format!("the peer's segment has an inconsistent ring capacity {cap}")));
        }
        seg.cap = cap;
        // This side reads ring 0 (creator to opener): it decides now whether it can read the
        // creator's memory directly, and tells the creator where its own header is.
        let h = seg.cma_header();
        h.publish_self(1);
        let (_, why) = h.probe(0, 0, set);
        seg.cma_why = why;
        Ok(seg)
    }

    /// Closes the creator's descriptor (once the peer has mapped the segment, or gave up).
    pub fn close_fd(&mut self) {
        if let Some(fd) = self.fd.take() {
            close_fd(fd);
        }
    }

    fn header(&self) -> &[u8] {
        // SAFETY: the header page is inside the mapping; it is written only by the creator
        // during `create`, before the descriptor is sent, and only read afterwards.
        unsafe { std::slice::from_raw_parts(self.base, SEG_HEADER) }
    }

    fn header_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `header`; `&mut self` during `create` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.base, SEG_HEADER) }
    }

    pub(super) fn ring_base(&self, r: usize) -> *mut u8 {
        // SAFETY: ring r starts inside the mapping (see `create`'s length).
        unsafe { self.base.add(FRONT + r * ring::ring_bytes(self.cap)) }
    }

    /// The lane page of direction `d` (0: creator to opener), zeroed at creation (memfd).
    pub(super) fn lane_page(&self, d: usize) -> *mut u8 {
        // SAFETY: both lane pages lie between the header page and the rings (`create`).
        unsafe { self.base.add(SEG_HEADER + d * super::lane::DIR) }
    }

    pub(super) fn cma_header(&self) -> Header {
        // SAFETY: the header page is the start of the mapping, which outlives the link's ends.
        unsafe { Header::new(self.base) }
    }

    /// Data bytes per ring.
    pub fn capacity(&self) -> usize {
        self.cap
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.close_fd();
        // SAFETY: `base`/`len` are the mapping made in `create`/`open`, unmapped once; the
        // rings built on it are owned by the same link and dropped with it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
