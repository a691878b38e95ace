//! The shared-memory row of the transport table ([`crate::transport::table`]): its set-up
//! phases and the link it makes. The lower rank of each pair creates the segment and sends its
//! [`Descriptor`]; the higher rank maps it and answers ok or why not; a refusal leaves the
//! handshake to TCP (`why_not` says why).

use super::{Descriptor, Segment, ShmLink, COOKIE_LEN};
use crate::error::Result;
use crate::net::wire::{self, Reader, Writer};
use crate::transport::select::{Handshake, Setup, MAX_FRAME};
use crate::transport::Link;

/// First byte of a descriptor or an answer: it worked.
pub(crate) const OK: u8 = 0;
/// First byte of a descriptor or an answer: it failed; a message follows.
pub(crate) const FAILED: u8 = 1;

/// The shared-memory row's set-up over every handshake that offered it: (2) the lower rank
/// of each pair creates the segment, (3) the higher rank maps it and answers, (4) the creator
/// learns whether the peer mapped it.
pub fn setup(cx: &Setup, ps: &mut [Handshake]) -> Result<()> {
    let me = cx.me;
    let here = crate::wait::ranks_here(cx.hosts, me);
    let ring = cx.cfg.shm_ring.unwrap_or_else(|| super::default_ring(here, crate::wait::crowded(here)));
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        create(ring, p)?;
    }
    for p in ps.iter_mut().filter(|p| p.shm && me > p.peer) {
        map(cx, p)?;
    }
    // Then nobody needs the descriptor.
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, cx.deadline)
            .map_err(|e| e.context(format!("rank {me}: shared-memory setup with rank {}", p.peer)))?;
        let mut r = Reader::new(&f);
        if r.bytes(1)? != [OK] {
            p.shm = false;
            p.why_not = Some(format!("the peer could not map the segment: {}", r.str(MAX_FRAME).unwrap_or_default()));
            p.seg = None;
        } else if let Some(s) = p.seg.as_mut() {
            s.close_fd();
        }
    }
    Ok(())
}

/// Phase 2: creates a segment of `ring` bytes per direction and sends its descriptor, or why not.
fn create(ring: usize, p: &mut Handshake) -> Result<()> {
    let mut w = Writer::default();
    match Segment::create(ring) {
        Ok((seg, d)) => {
            w.bytes(&[OK]).u32(d.pid).u32(d.fd).u64(d.len).bytes(&d.cookie);
            p.seg = Some(seg);
        }
        Err(e) => {
            w.bytes(&[FAILED]).str(e.message());
            p.shm = false;
            p.why_not = Some(format!("creating the segment failed: {}", e.message()));
        }
    }
    wire::write_frame(&mut p.sock, &w.0)
}

/// Phase 3: maps the peer's segment and answers (no answer when the peer could not create one).
fn map(cx: &Setup, p: &mut Handshake) -> Result<()> {
    let f = wire::read_frame(&mut p.sock, MAX_FRAME, cx.deadline)
        .map_err(|e| e.context(format!("rank {}: shared-memory setup with rank {}", cx.me, p.peer)))?;
    let mut w = Writer::default();
    match parse_descriptor(&f).and_then(|d| d.map(|d| Segment::open(&d)).transpose()) {
        Ok(Some(seg)) => {
            w.bytes(&[OK]);
            p.seg = Some(seg);
        }
        Ok(None) => {
            p.shm = false;
            p.why_not = Some("the peer could not create a segment".into());
            return Ok(());
        }
        Err(e) => {
            w.bytes(&[FAILED]).str(e.message());
            p.shm = false;
            p.why_not = Some(format!("mapping the peer's segment failed: {}", e.message()));
        }
    }
    wire::write_frame(&mut p.sock, &w.0)
}

/// Parses the creator's message: `Some(descriptor)`, or `None` when it reports a failure.
pub(crate) fn parse_descriptor(f: &[u8]) -> Result<Option<Descriptor>> {
    let mut r = Reader::new(f);
    if r.bytes(1)? != [OK] {
        return Ok(None);
    }
    let (pid, fd, len) = (r.u32()?, r.u32()?, r.u64()?);
    let mut cookie = [0u8; COOKIE_LEN];
    cookie.copy_from_slice(r.bytes(COOKIE_LEN)?);
    r.finish()?;
    Ok(Some(Descriptor { pid, fd, len, cookie }))
}

/// The shared-memory link of a handshake whose segment both ends mapped.
pub fn connect(cx: &Setup, p: Handshake) -> Result<Box<dyn Link>> {
    let seg = p.seg.ok_or_else(|| crate::error::Error::internal("a shared-memory link without a segment"))?;
    crate::info!("rank {}: rank {} via shared memory ({} KiB per direction)", cx.me, p.peer, seg.capacity() >> 10);
    Ok(Box::new(ShmLink::new(seg, cx.me < p.peer, p.sock, p.peer)?))
}
