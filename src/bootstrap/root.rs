//! The bootstrap root: collects every rank's hello and sends back the table of all ranks.
//!
//! Each connection is handled on its own short-lived thread with a bounded handshake, so a
//! stranger that connects and sends nothing (or garbage, or a wrong secret) is dropped with a
//! log line and never delays the ranks. The root gives up after `OXCCL_TIMEOUT_MS`.
//!
//! Both ends prove the secret, the root first: root -> rank `nonce_r`; rank -> root `nonce_k`;
//! root -> rank `HMAC(secret, ROOT_LABEL, nonce_k, nonce_r)`; only then does the rank send its
//! hello (`HMAC(secret, HELLO_LABEL, nonce_r, nranks|rank)`, its address and host) and trust
//! the table that comes back. A process that holds the root's port without the secret gets
//! no hello and no proof to guess the secret from, and the rank fails naming the address.

use super::auth::{self, Secret, NONCE_LEN, PROOF_LEN};
use super::{wire, PeerInfo, HELLO_LABEL, MAX_STR};
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Most ranks one communicator may have.
pub const MAX_RANKS: usize = 1 << 20;
/// How long a connection may take to present its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

const REPLY_OK: u8 = 0;
const REPLY_ERR: u8 = 1;
/// As `REPLY_ERR`, for a root that timed out waiting for ranks (becomes `ncclTimeout`).
const REPLY_TIMEOUT: u8 = 2;

struct Hello {
    nranks: usize,
    rank: usize,
    addr: SocketAddr,
    host: String,
    stream: TcpStream,
}

/// Label of the root's proof to a rank (mutual authentication of the rendezvous).
pub const ROOT_LABEL: &[u8] = b"oxccl-bootstrap-root";

/// Context bound into the hello proof.
pub fn hello_context(nranks: u32, rank: u32) -> [u8; 8] {
    let mut c = [0u8; 8];
    c[..4].copy_from_slice(&nranks.to_be_bytes());
    c[4..].copy_from_slice(&rank.to_be_bytes());
    c
}

/// Starts the root on `listener` in a background thread.
pub fn spawn(listener: TcpListener, secret: Secret) -> Result<()> {
    std::thread::Builder::new()
        .name("oxccl-root".into())
        .spawn(move || {
            if let Err(e) = serve(listener, secret) {
                crate::warn!("bootstrap root: {e}");
            }
        })
        .map(|_| ())
        .map_err(|e| Error::from_io("spawning the bootstrap root thread", e))
}

/// How often the root says which ranks it still waits for.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// Whether a rank that sent its hello has gone since (ranks send nothing more until the table
/// comes, so anything readable on the stream is its end or garbage).
fn departed(s: &TcpStream) -> bool {
    let mut p = [0u8; 1];
    s.set_nonblocking(true).is_ok() && !matches!(s.peek(&mut p), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

fn serve(listener: TcpListener, secret: Secret) -> Result<()> {
    let start = Instant::now();
    let timeout = crate::config::timeout();
    let deadline = start + timeout;
    let (tx, rx) = mpsc::channel::<Hello>();
    let mut got: Vec<Option<Hello>> = Vec::new();
    let mut count = 0;
    let mut expect = 0usize;
    // Once the rendezvous cannot succeed, every rank (waiting or arriving later) gets this.
    let mut failed: Option<String> = None;
    let mut next_progress = start + PROGRESS_EVERY;
    let mut last_check = start;
    listener.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    while failed.is_some() || expect == 0 || count < expect {
        let now = Instant::now();
        if now > deadline {
            if let Some(why) = failed {
                return Err(Error::invalid_usage(why));
            }
            let missing: Vec<usize> = got.iter().enumerate().filter(|(_, h)| h.is_none()).map(|(i, _)| i).collect();
            let msg = format!(
                "bootstrap root timed out after {} s (OXCCL_TIMEOUT_MS): {count} of {expect} ranks arrived; missing ranks {missing:?}",
                timeout.as_secs()
            );
            for h in got.iter_mut().flatten() {
                reply(&mut h.stream, REPLY_TIMEOUT, &msg);
            }
            return Err(Error::timeout(msg));
        }
        if failed.is_none() && now >= next_progress {
            next_progress += PROGRESS_EVERY;
            let missing: Vec<usize> = got.iter().enumerate().filter(|(_, h)| h.is_none()).map(|(i, _)| i).collect();
            if expect == 0 {
                let (waited, total) = (now.duration_since(start).as_secs(), timeout.as_secs());
                crate::warn!("bootstrap root: no rank has arrived yet: {waited} of {total} s");
            } else {
                crate::warn!(
                    "bootstrap root: waiting for ranks {missing:?}: {} of {} s ({count} of {expect} arrived)",
                    now.duration_since(start).as_secs(),
                    timeout.as_secs()
                );
            }
        }
        if let Ok((s, peer)) = listener.accept() {
            let tx = tx.clone();
            let _ =
                std::thread::Builder::new().name("oxccl-root-conn".into()).spawn(move || match handshake(s, &secret) {
                    Ok(h) => {
                        let _ = tx.send(h);
                    }
                    Err(e) => crate::warn!("bootstrap root: dropped connection from {peer}: {e}"),
                });
        }
        while let Ok(mut h) = rx.recv_timeout(Duration::from_millis(5)) {
            if let Some(why) = &failed {
                reply_error(&mut h.stream, why);
                continue;
            }
            if expect == 0 {
                expect = h.nranks;
                got.resize_with(expect, || None);
            }
            let refusal = if h.nranks != expect {
                Some(format!(
                    "rank {} ({}) says nranks={} but the ranks before it said nranks={expect}",
                    h.rank, h.addr, h.nranks
                ))
            } else if got[h.rank].is_some() {
                Some(format!(
                    "rank {} joined twice (from {} and from {})",
                    h.rank,
                    got[h.rank].as_ref().map_or(h.addr, |g| g.addr),
                    h.addr
                ))
            } else {
                None
            };
            if let Some(why) = refusal {
                // The job cannot start: everyone hears why now, not at the timeout.
                crate::warn!("bootstrap root: {why}; every rank is told");
                reply_error(&mut h.stream, &why);
                for g in got.iter_mut().flatten() {
                    reply_error(&mut g.stream, &why);
                }
                got.iter_mut().for_each(|g| *g = None);
                failed = Some(why);
                continue;
            }
            let r = h.rank;
            got[r] = Some(h);
            count += 1;
        }
        // A rank that arrived and then died (or closed) fails the rendezvous at once.
        if failed.is_none() && now.duration_since(last_check) >= Duration::from_millis(20) {
            last_check = now;
            if let Some(r) = (0..got.len()).find(|&r| got[r].as_ref().is_some_and(|h| departed(&h.stream))) {
                let gone = got[r].take().map(|h| h.addr.to_string()).unwrap_or_default();
                let why = format!("rank {r} ({gone}) left before all {expect} ranks joined (its process exited or closed the connection)");
                crate::warn!("bootstrap root: {why}; every rank is told");
                for g in got.iter_mut().flatten() {
                    reply_error(&mut g.stream, &why);
                }
                got.iter_mut().for_each(|g| *g = None);
                failed = Some(why);
            }
        }
    }
    let mut w = wire::Writer::default();
    w.bytes(&[REPLY_OK]).u32(expect as u32);
    for h in got.iter().flatten() {
        w.str(&h.addr.to_string()).str(&h.host);
    }
    for h in got.iter_mut().flatten() {
        let _ = h.stream.set_nonblocking(false);
        let _ = wire::write_frame(&mut h.stream, &w.0);
    }
    Ok(())
}

fn reply_error(s: &mut TcpStream, msg: &str) {
    reply(s, REPLY_ERR, msg)
}

fn reply(s: &mut TcpStream, kind: u8, msg: &str) {
    let mut w = wire::Writer::default();
    w.bytes(&[kind]).str(msg);
    let _ = wire::write_frame(s, &w.0);
}

fn handshake(mut s: TcpStream, secret: &Secret) -> Result<Hello> {
    s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let nonce = auth::nonce()?;
    wire::write_frame(&mut s, &nonce)?;
    // The rank's own challenge: the root proves the secret first, so a process that took the
    // root's port without it learns no proof from any rank.
    let theirs = wire::read_frame(&mut s, NONCE_LEN, deadline)?;
    wire::write_frame(&mut s, &auth::prove(secret, ROOT_LABEL, &theirs, &nonce))?;
    let msg = wire::read_frame(&mut s, PROOF_LEN + 8 + 2 * (MAX_STR + 4), deadline)?;
    let h = parse_hello(&msg, secret, &nonce)?;
    Ok(Hello { nranks: h.0, rank: h.1, addr: h.2, host: h.3, stream: s })
}

/// Parses and authenticates a hello message (public for fuzzing).
pub fn parse_hello(msg: &[u8], secret: &Secret, nonce: &[u8; NONCE_LEN]) -> Result<(usize, usize, SocketAddr, String)> {
    let mut r = wire::Reader::new(msg);
    let proof = r.bytes(PROOF_LEN)?;
    let nranks = r.u32()?;
    let rank = r.u32()?;
    if !auth::verify(secret, HELLO_LABEL, nonce, &hello_context(nranks, rank), proof) {
        return Err(Error::remote("hello failed authentication (wrong secret or corrupted)"));
    }
    let addr = r.str(MAX_STR)?;
    let host = r.str(MAX_STR)?;
    r.finish()?;
    let (nranks, rank) = (nranks as usize, rank as usize);
    if nranks == 0 || nranks > MAX_RANKS || rank >= nranks {
        return Err(Error::remote(format!("hello has rank {rank} of nranks {nranks}")));
    }
    let addr = addr.parse().map_err(|_| Error::remote(format!("hello has a bad address {addr:?}")))?;
    Ok((nranks, rank, addr, host))
}

/// Parses the root's reply: the table of all ranks, or the root's error.
pub fn parse_table(msg: &[u8], nranks: usize) -> Result<Vec<PeerInfo>> {
    let mut r = wire::Reader::new(msg);
    match r.bytes(1)?[0] {
        REPLY_OK => {}
        REPLY_ERR => {
            return Err(Error::invalid_usage(format!(
                "the bootstrap root ended the rendezvous: {}",
                r.str(MAX_STR * 4)?
            )))
        }
        REPLY_TIMEOUT => return Err(Error::timeout(r.str(MAX_STR * 4)?.to_string())),
        t => return Err(Error::remote(format!("bootstrap root sent unknown reply type {t}"))),
    }
    let n = r.u32()? as usize;
    if n != nranks {
        return Err(Error::remote(format!("bootstrap table has {n} ranks, expected {nranks}")));
    }
    let mut peers = Vec::with_capacity(n);
    for _ in 0..n {
        let addr = r.str(MAX_STR)?;
        let host = r.str(MAX_STR)?;
        let addr = addr.parse().map_err(|_| Error::remote(format!("bootstrap table has a bad address {addr:?}")))?;
        peers.push(PeerInfo { addr, host });
    }
    r.finish()?;
    Ok(peers)
}
