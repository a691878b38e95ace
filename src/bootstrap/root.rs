//! The bootstrap root: collects every rank's hello and sends back the table of all ranks.
//!
//! Each connection is handled on its own short-lived thread with a bounded handshake, so a
//! stranger that connects and sends nothing (or garbage, or a wrong secret) is dropped with a
//! log line and never delays the ranks. The root gives up after `OXCCL_TIMEOUT_MS`.

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

fn serve(listener: TcpListener, secret: Secret) -> Result<()> {
    let deadline = Instant::now() + crate::config::timeout();
    let (tx, rx) = mpsc::channel::<Hello>();
    let mut got: Vec<Option<Hello>> = Vec::new();
    let mut count = 0;
    let mut expect = 0usize;
    listener.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    while expect == 0 || count < expect {
        if Instant::now() > deadline {
            let missing: Vec<usize> = got.iter().enumerate().filter(|(_, h)| h.is_none()).map(|(i, _)| i).collect();
            let msg = format!("bootstrap root timed out: {count} of {expect} ranks arrived; missing ranks {missing:?}");
            for h in got.iter_mut().flatten() {
                reply(&mut h.stream, REPLY_TIMEOUT, &msg);
            }
            return Err(Error::timeout(msg));
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
            if expect == 0 {
                expect = h.nranks;
                got.resize_with(expect, || None);
            }
            if h.nranks != expect {
                reply_error(
                    &mut h.stream,
                    &format!("rank {} says nranks={} but rank(s) before it said nranks={expect}", h.rank, h.nranks),
                );
                continue;
            }
            if h.rank >= expect || got[h.rank].is_some() {
                reply_error(
                    &mut h.stream,
                    &format!("rank {} joined twice (or is out of range for nranks={expect})", h.rank),
                );
                continue;
            }
            let r = h.rank;
            got[r] = Some(h);
            count += 1;
        }
    }
    let mut w = wire::Writer::default();
    w.bytes(&[REPLY_OK]).u32(expect as u32);
    for h in got.iter().flatten() {
        w.str(&h.addr.to_string()).str(&h.host);
    }
    for h in got.iter_mut().flatten() {
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
            return Err(Error::invalid_usage(format!("bootstrap root refused this rank: {}", r.str(MAX_STR * 4)?)))
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
