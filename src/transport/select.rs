//! Choosing the transport of each peer: shared memory for ranks on the same host, TCP otherwise.
//!
//! Every pair first gets an authenticated TCP connection (bootstrap). On it both ends then
//! *offer* shared memory when the peer's host identity (hostname + boot id + network namespace, or `OXCCL_HOSTID`)
//! equals theirs and `OXCCL_TRANSPORT` is not `tcp`. When both offer, the lower rank creates
//! the segment and sends its [`Descriptor`]; the higher rank maps it and answers ok or why not.
//! A refusal (e.g. /proc of the peer not accessible) falls back to TCP with an INFO line,
//! unless `OXCCL_TRANSPORT=shm` demands shared memory, which makes it an error, as does a peer
//! on another host.
//!
//! The handshake runs in phases over all new connections at once (send every offer, read every
//! offer, send every descriptor, answer every descriptor, read every answer): every read waits
//! only for bytes the peer sends before its own first read of that phase, so ranks building
//! several links in different orders cannot wait on each other in a cycle.

use super::shm::{self, Descriptor, Segment, ShmLink, COOKIE_LEN};
use super::tcp::TcpLink;
use super::Link;
use crate::bootstrap::wire::{self, Reader, Writer};
use crate::error::{Error, Result};
use std::net::TcpStream;
use std::time::Instant;

/// What `OXCCL_TRANSPORT` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Shared memory with peers on this host, TCP with the others (default).
    Auto,
    /// TCP with everyone.
    Tcp,
    /// Shared memory with everyone; a peer on another host is an error.
    Shm,
}

/// Reads `OXCCL_TRANSPORT` (`tcp`, `shm`, or unset/`auto`).
pub fn mode() -> Result<Mode> {
    match crate::config::env("TRANSPORT").map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        None | Some("auto") => Ok(Mode::Auto),
        Some("tcp") | Some("socket") => Ok(Mode::Tcp),
        Some("shm") => Ok(Mode::Shm),
        Some(other) => Err(Error::invalid_argument(format!("OXCCL_TRANSPORT={other} is not one of tcp, shm, auto"))),
    }
}

const OFFER: u8 = b'O';
const VERSION: u8 = 1;
const OK: u8 = 0;
const FAILED: u8 = 1;
const MAX_FRAME: usize = 4096;

/// One new connection going through the handshake.
struct Pending {
    peer: usize,
    sock: TcpStream,
    shm: bool,
    seg: Option<Segment>,
    why_not: Option<String>,
}

/// Turns freshly authenticated connections `(peer, stream)` of rank `me` into links, choosing
/// each one's transport (see the module docs). `hosts` is every rank's host identity.
pub fn build(
    me: usize,
    conns: Vec<(usize, TcpStream)>,
    hosts: &[String],
    deadline: Instant,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    if conns.is_empty() {
        return Ok(Vec::new());
    }
    let mode = mode()?;
    let mut ps: Vec<Pending> =
        conns.into_iter().map(|(peer, sock)| Pending { peer, sock, shm: false, seg: None, why_not: None }).collect();
    // 1. Offers.
    for p in &mut ps {
        let same = hosts.get(p.peer).is_some_and(|h| *h == hosts[me]);
        p.shm = same && mode != Mode::Tcp;
        wire::write_frame(&mut p.sock, &[OFFER, VERSION, u8::from(p.shm)])?;
        if !same && mode == Mode::Shm {
            return Err(Error::invalid_usage(format!(
                "rank {me}: OXCCL_TRANSPORT=shm, but rank {} is on host {:?} and this rank on {:?}",
                p.peer,
                hosts.get(p.peer).map(String::as_str).unwrap_or("?"),
                hosts[me]
            )));
        }
    }
    for p in &mut ps {
        let f = wire::read_frame(&mut p.sock, 3, deadline)
            .map_err(|e| e.context(format!("rank {me}: transport handshake with rank {}", p.peer)))?;
        if f.len() != 3 || f[0] != OFFER || f[1] != VERSION {
            return Err(Error::remote(format!("rank {}: malformed transport offer", p.peer)));
        }
        if p.shm && f[2] == 0 {
            p.shm = false;
            p.why_not = Some("the peer did not offer shared memory (OXCCL_TRANSPORT=tcp there?)".into());
        }
    }
    // 2. The lower rank of each pair creates the segment.
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        let mut w = Writer::default();
        match Segment::create(shm::ring_capacity()) {
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
        wire::write_frame(&mut p.sock, &w.0)?;
    }
    // 3. The higher rank maps it and answers.
    for p in ps.iter_mut().filter(|p| p.shm && me > p.peer) {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, deadline)
            .map_err(|e| e.context(format!("rank {me}: shared-memory setup with rank {}", p.peer)))?;
        let mut w = Writer::default();
        match parse_descriptor(&f).and_then(|d| d.map(|d| Segment::open(&d)).transpose()) {
            Ok(Some(seg)) => {
                w.bytes(&[OK]);
                p.seg = Some(seg);
            }
            Ok(None) => {
                p.shm = false;
                p.why_not = Some("the peer could not create a segment".into());
                continue;
            }
            Err(e) => {
                w.bytes(&[FAILED]).str(e.message());
                p.shm = false;
                p.why_not = Some(format!("mapping the peer's segment failed: {}", e.message()));
            }
        }
        wire::write_frame(&mut p.sock, &w.0)?;
    }
    // 4. The creator learns whether the peer mapped it; then nobody needs the descriptor.
    for p in ps.iter_mut().filter(|p| p.shm && me < p.peer) {
        let f = wire::read_frame(&mut p.sock, MAX_FRAME, deadline)
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
    ps.into_iter().map(|p| finish(me, mode, p)).collect()
}

/// Parses the creator's message: `Some(descriptor)`, or `None` when it reports a failure.
fn parse_descriptor(f: &[u8]) -> Result<Option<Descriptor>> {
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

fn finish(me: usize, mode: Mode, p: Pending) -> Result<(usize, Box<dyn Link>)> {
    match p.seg {
        Some(seg) if p.shm => {
            crate::info!("rank {me}: rank {} via shared memory ({} KiB per direction)", p.peer, seg.capacity() >> 10);
            Ok((p.peer, Box::new(ShmLink::new(seg, me < p.peer, p.sock, p.peer)?)))
        }
        _ => {
            let why = p.why_not.unwrap_or_else(|| "another host, or OXCCL_TRANSPORT=tcp".into());
            if mode == Mode::Shm {
                return Err(Error::system(format!(
                    "rank {me}: OXCCL_TRANSPORT=shm, but shared memory with rank {} failed: {why}",
                    p.peer
                )));
            }
            crate::info!("rank {me}: rank {} via TCP ({why})", p.peer);
            Ok((p.peer, Box::new(TcpLink::new(p.sock, p.peer)?)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected pair of blocking loopback streams.
    fn streams() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// Rank 0 runs `build` against a hand-played rank 1 on the same host; returns rank 0's link.
    fn against(peer: impl FnOnce(&mut TcpStream) + Send) -> Box<dyn Link> {
        assert!(mode().unwrap() == Mode::Auto, "these tests expect OXCCL_TRANSPORT unset");
        let (a, mut b) = streams();
        let hosts = vec!["h".to_string(), "h".to_string()];
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            s.spawn(move || peer(&mut b));
            let mut links = build(0, vec![(1, a)], &hosts, deadline).unwrap();
            links.pop().unwrap().1
        })
    }

    fn offer(s: &mut TcpStream, shm: bool) {
        wire::write_frame(s, &[OFFER, VERSION, u8::from(shm)]).unwrap();
        let theirs = wire::read_frame(s, 3, Instant::now() + Duration::from_secs(10)).unwrap();
        assert_eq!(theirs, [OFFER, VERSION, 1], "same host: rank 0 offers shared memory");
    }

    #[test]
    fn a_peer_that_cannot_map_the_segment_gets_tcp() {
        let link = against(|s| {
            offer(s, true);
            let d = wire::read_frame(s, MAX_FRAME, Instant::now() + Duration::from_secs(10)).unwrap();
            assert!(parse_descriptor(&d).unwrap().is_some(), "rank 0 sent a descriptor");
            let mut w = Writer::default();
            w.bytes(&[FAILED]).str("refused for the test");
            wire::write_frame(s, &w.0).unwrap();
        });
        assert!(!link.describe().contains("shared memory"), "{}", link.describe());
        assert!(!link.supports_in_place());
    }

    #[test]
    fn a_peer_that_does_not_offer_gets_tcp_and_one_that_maps_gets_shm() {
        let link = against(|s| offer(s, false));
        assert!(!link.describe().contains("shared memory"), "{}", link.describe());
        let link = against(|s| {
            offer(s, true);
            let d = wire::read_frame(s, MAX_FRAME, Instant::now() + Duration::from_secs(10)).unwrap();
            let seg = Segment::open(&parse_descriptor(&d).unwrap().unwrap()).unwrap();
            assert!(seg.capacity() >= 4096);
            wire::write_frame(s, &[OK]).unwrap();
        });
        assert!(link.describe().contains("shared memory"), "{}", link.describe());
    }
}
