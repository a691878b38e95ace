//! The bootstrap root: collects every rank's hello and sends back the table of all ranks.
//!
//! One thread serves every connection without blocking ([`super::pending`]): a stranger that
//! connects and sends nothing (or garbage, or a wrong secret) holds one of a bounded number of
//! handshake slots ([`MAX_HANDSHAKES`], fewer under a low descriptor limit) for at most
//! [`HELLO_TIMEOUT`], is dropped with a log line, and never delays the ranks. The root gives
//! up after `OXCCL_TIMEOUT_MS`.
//!
//! The side that connects proves the secret first, and the root proves it back only to a rank
//! that did:
//!
//! ```text
//! root -> rank: nonce_r
//! rank -> root: HMAC(secret, HELLO_LABEL, nonce_r, body) | body
//!               body = WIRE_VERSION | nonce_k | nranks | rank | address | host
//! root -> rank: HMAC(secret, REPLY_LABEL, nonce_k, nonce_r | reply) | reply
//!               reply = the table of every rank's address and host, or the root's error
//! ```
//!
//! A stranger that connects learns a nonce and nothing it could test guesses of the secret
//! against; the MACs cover every field the other side acts on (a rank's address and host,
//! the whole table), so a relay on the path can neither redirect peers nor forge an error.

use super::auth::{self, Secret, NONCE_LEN, PROOF_LEN};
use super::pending::{handshake_cap, Challenged, Pool};
use super::{wire, PeerInfo, HELLO_LABEL, MAX_STR};
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Most ranks one communicator may have.
pub const MAX_RANKS: usize = 1 << 20;
/// How long a connection may take to present its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections in handshake at once (a rank answers within a round trip, so this bounds
/// what strangers cost, not how many ranks may join).
pub const MAX_HANDSHAKES: usize = 48;
/// Version of the rendezvous messages; a hello of another version is refused by name.
pub const WIRE_VERSION: u32 = 5;
/// Label of the root's reply MAC.
pub const REPLY_LABEL: &[u8] = b"oxccl-bootstrap-reply-3";
/// Largest hello accepted.
const MAX_HELLO: usize = PROOF_LEN + 4 + NONCE_LEN + 8 + 2 * (MAX_STR + 4);

const REPLY_OK: u8 = 0;
const REPLY_ERR: u8 = 1;
/// As `REPLY_ERR`, for a root that timed out waiting for ranks (becomes `ncclTimeout`).
const REPLY_TIMEOUT: u8 = 2;

/// A hello's fields, authenticated.
#[derive(Debug)]
pub struct HelloFields {
    /// The communicator size the rank was given.
    pub nranks: usize,
    /// The rank.
    pub rank: usize,
    /// Where it accepts data connections.
    pub addr: SocketAddr,
    /// Its host identity.
    pub host: String,
    /// Its challenge to the root (the reply's MAC answers it).
    pub nonce: [u8; NONCE_LEN],
}

struct Hello {
    f: HelloFields,
    stream: TcpStream,
    /// The root's challenge to this rank.
    ours: [u8; NONCE_LEN],
}

/// A rank's hello answering the root's `challenge` (see the module documentation).
pub fn hello_message(
    secret: &Secret,
    challenge: &[u8],
    nonce: &[u8; NONCE_LEN],
    nranks: u32,
    rank: u32,
    addr: &str,
    host: &str,
) -> Vec<u8> {
    let mut body = wire::Writer::default();
    body.u32(WIRE_VERSION).bytes(nonce).u32(nranks).u32(rank).str(addr).str(host);
    let mut w = wire::Writer::default();
    w.bytes(&auth::prove(secret, HELLO_LABEL, challenge, &body.0)).bytes(&body.0);
    w.0
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

/// Logs a dropped connection (the first few, then every 100th).
fn log_drop(count: &mut usize, h: &Challenged, why: &str) {
    *count += 1;
    if *count <= 8 || *count % 100 == 0 {
        crate::warn!("bootstrap root: dropped connection #{count} from {}: {why}", h.who());
    }
}

/// The hellos that completed in `pool` this round (handshakes that failed or ran out of time
/// are dropped and logged).
fn arrivals(pool: &mut Pool, secret: &Secret, now: Instant, drops: &mut usize) -> Vec<Hello> {
    let mut arrived = Vec::new();
    let mut i = 0;
    while i < pool.hs.len() {
        match pool.hs[i].step().and_then(|m| m.map(|m| parse_hello(&m, secret, &pool.hs[i].nonce)).transpose()) {
            Ok(None) if !pool.hs[i].expired(now) => i += 1,
            Ok(None) => log_drop(drops, &pool.hs.swap_remove(i), "sent no hello within the limit"),
            Err(e) => log_drop(drops, &pool.hs.swap_remove(i), e.message()),
            Ok(Some(f)) => {
                let p = pool.hs.swap_remove(i);
                arrived.push(Hello { f, stream: p.s, ours: p.nonce });
            }
        }
    }
    arrived
}

/// The roll of one rendezvous, as the root keeps it: the ranks that arrived, how many are
/// expected (0 until the first hello), and why it failed, if it did (then every rank, waiting
/// or arriving later, hears why).
struct Roll<'a> {
    secret: &'a Secret,
    got: Vec<Option<Hello>>,
    count: usize,
    expect: usize,
    failed: Option<String>,
}

impl Roll<'_> {
    /// Whether every expected rank arrived and nothing failed.
    fn complete(&self) -> bool {
        self.failed.is_none() && self.expect > 0 && self.count == self.expect
    }

    /// The ranks not arrived yet.
    fn missing(&self) -> Vec<usize> {
        self.got.iter().enumerate().filter(|(_, h)| h.is_none()).map(|(i, _)| i).collect()
    }

    /// Logs who is still missing, `waited` into `timeout`.
    fn log_progress(&self, waited: Duration, timeout: Duration) {
        let (waited, total) = (waited.as_secs(), timeout.as_secs());
        if self.expect == 0 {
            crate::warn!("bootstrap root: no rank has arrived yet: {waited} of {total} s");
        } else {
            let (missing, count, expect) = (self.missing(), self.count, self.expect);
            crate::warn!(
                "bootstrap root: waiting for ranks {missing:?}: {waited} of {total} s ({count} of {expect} arrived)"
            );
        }
    }

    /// Why `h` cannot join: another number of ranks than the first hello's, or a rank that
    /// joined already.
    fn refusal(&self, h: &Hello) -> Option<String> {
        let expect = self.expect;
        if h.f.nranks != expect {
            return Some(format!(
                "rank {} ({}) says nranks={} but the ranks before it said nranks={expect}",
                h.f.rank, h.f.addr, h.f.nranks
            ));
        }
        let first = self.got[h.f.rank].as_ref()?;
        Some(format!("rank {} joined twice (from {} and from {})", h.f.rank, first.f.addr, h.f.addr))
    }

    /// Takes in a rank's hello: told the failure if the rendezvous failed; refused (and the
    /// rendezvous failed: the job cannot start, everyone hears why now, not at the timeout);
    /// or kept until every rank is here.
    fn admit(&mut self, mut h: Hello) {
        if let Some(why) = &self.failed {
            reply_error(&mut h, self.secret, why);
            return;
        }
        if self.expect == 0 {
            self.expect = h.f.nranks;
            self.got.resize_with(self.expect, || None);
        }
        if let Some(why) = self.refusal(&h) {
            reply_error(&mut h, self.secret, &why);
            self.fail(why);
            return;
        }
        let r = h.f.rank;
        self.got[r] = Some(h);
        self.count += 1;
    }

    /// Fails the rendezvous: every rank waiting hears `why`, and so will every later one.
    fn fail(&mut self, why: String) {
        crate::warn!("bootstrap root: {why}; every rank is told");
        for g in self.got.iter_mut().flatten() {
            reply_error(g, self.secret, &why);
        }
        self.got.iter_mut().for_each(|g| *g = None);
        self.failed = Some(why);
    }

    /// A rank that arrived and then died (or closed) fails the rendezvous at once.
    fn check_departed(&mut self) {
        let got = &mut self.got;
        if let Some(r) = (0..got.len()).find(|&r| got[r].as_ref().is_some_and(|h| departed(&h.stream))) {
            let gone = got[r].take().map(|h| h.f.addr.to_string()).unwrap_or_default();
            let expect = self.expect;
            self.fail(format!(
                "rank {r} ({gone}) left before all {expect} ranks joined (its process exited or closed the connection)"
            ));
        }
    }

    /// The rendezvous' error at its deadline: the failure, or a timeout that every rank
    /// waiting hears.
    fn time_out(&mut self, timeout: Duration) -> Error {
        if let Some(why) = self.failed.take() {
            return Error::invalid_usage(why);
        }
        let msg = format!(
            "bootstrap root timed out after {} s (OXCCL_TIMEOUT_MS): {} of {} ranks arrived; missing ranks {:?}",
            timeout.as_secs(),
            self.count,
            self.expect,
            self.missing()
        );
        for h in self.got.iter_mut().flatten() {
            reply(h, self.secret, REPLY_TIMEOUT, &msg);
        }
        Error::timeout(msg)
    }

    /// Sends every rank the table of all ranks' addresses and hosts.
    fn finish(&mut self) {
        let mut w = wire::Writer::default();
        w.bytes(&[REPLY_OK]).u32(self.expect as u32);
        for h in self.got.iter().flatten() {
            w.str(&h.f.addr.to_string()).str(&h.f.host);
        }
        for h in self.got.iter_mut().flatten() {
            send_reply(h, self.secret, &w.0);
        }
    }
}

/// The root's loop: accepts connections, steps their handshakes, admits the hellos, until
/// every rank arrived (then sends them the table), the rendezvous failed and its deadline
/// passed, or the deadline passed.
fn serve(listener: TcpListener, secret: Secret) -> Result<()> {
    let start = Instant::now();
    let timeout = crate::config::timeout();
    let deadline = start + timeout;
    let mut pool = Pool::new(handshake_cap(MAX_HANDSHAKES), HELLO_TIMEOUT, MAX_HELLO);
    let mut drops = 0usize;
    let mut rv = Roll { secret: &secret, got: Vec::new(), count: 0, expect: 0, failed: None };
    let mut next_progress = start + PROGRESS_EVERY;
    let mut last_check = start;
    listener.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    while rv.failed.is_some() || rv.expect == 0 || rv.count < rv.expect {
        let now = Instant::now();
        if rv.failed.is_none() && now >= next_progress {
            next_progress += PROGRESS_EVERY;
            rv.log_progress(now.duration_since(start), timeout);
        }
        if let Err(e) = pool.accept(&listener, &mut |h, why| log_drop(&mut drops, &h, why)) {
            // A failed accept (other than for want of descriptors, handled in the pool) costs
            // this round only; the wait below paces the retries.
            crate::warn!("bootstrap root: {e}");
        }
        for h in arrivals(&mut pool, &secret, now, &mut drops) {
            rv.admit(h);
        }
        if rv.complete() {
            break;
        }
        if rv.failed.is_none() && now.duration_since(last_check) >= Duration::from_millis(20) {
            last_check = now;
            rv.check_departed();
        }
        // Checked after the pool has been stepped: a rank whose hello is already here hears
        // the timeout (with the others) rather than a closed connection.
        if now > deadline {
            return Err(rv.time_out(timeout));
        }
        pool.wait(&listener, Duration::from_millis(20));
    }
    rv.finish();
    Ok(())
}

/// The MAC of a reply to a rank whose challenge was `theirs`, after the root's `ours`.
fn reply_mac(secret: &Secret, theirs: &[u8], ours: &[u8], payload: &[u8]) -> [u8; PROOF_LEN] {
    auth::prove(secret, REPLY_LABEL, theirs, &[ours, payload].concat())
}

/// The root's reply carrying `table` (every rank's address and host, by rank) to a rank whose
/// challenge was `theirs`, after the root's `ours`: the frame's payload, MAC in front (public
/// for tests that play the root).
pub fn table_reply(secret: &Secret, theirs: &[u8], ours: &[u8], table: &[(String, String)]) -> Vec<u8> {
    let mut w = wire::Writer::default();
    w.bytes(&[REPLY_OK]).u32(table.len() as u32);
    for (addr, host) in table {
        w.str(addr).str(host);
    }
    let mut frame = reply_mac(secret, theirs, ours, &w.0).to_vec();
    frame.extend_from_slice(&w.0);
    frame
}

/// Sends `payload` to a rank that proved the secret, with the root's MAC in front.
fn send_reply(h: &mut Hello, secret: &Secret, payload: &[u8]) {
    let mut frame = reply_mac(secret, &h.f.nonce, &h.ours, payload).to_vec();
    frame.extend_from_slice(payload);
    let _ = h.stream.set_nonblocking(false);
    let _ = h.stream.set_write_timeout(Some(Duration::from_secs(10)));
    let _ = wire::write_frame(&mut h.stream, &frame);
}

fn reply_error(h: &mut Hello, secret: &Secret, msg: &str) {
    reply(h, secret, REPLY_ERR, msg)
}

fn reply(h: &mut Hello, secret: &Secret, kind: u8, msg: &str) {
    let mut w = wire::Writer::default();
    w.bytes(&[kind]).str(msg);
    send_reply(h, secret, &w.0);
}

/// Checks the root's MAC on a reply (the frame's payload) to a rank that sent `mine` after the
/// root's `challenge`; the reply itself for [`parse_table`].
pub fn open_reply<'a>(msg: &'a [u8], secret: &Secret, mine: &[u8], challenge: &[u8]) -> Result<&'a [u8]> {
    if msg.len() < PROOF_LEN {
        return Err(Error::remote("the bootstrap root's reply is truncated"));
    }
    let (mac, payload) = msg.split_at(PROOF_LEN);
    if !auth::verify(secret, REPLY_LABEL, mine, &[challenge, payload].concat(), mac) {
        return Err(Error::remote("the bootstrap root's reply failed authentication (tampered with on the way, or a process without the secret)"));
    }
    Ok(payload)
}

/// Parses and authenticates a hello message answering the root's challenge `nonce` (public for
/// fuzzing).
pub fn parse_hello(msg: &[u8], secret: &Secret, nonce: &[u8; NONCE_LEN]) -> Result<HelloFields> {
    let mut r = wire::Reader::new(msg);
    let proof = r.bytes(PROOF_LEN)?;
    let body = &msg[PROOF_LEN..];
    let version = r.u32()?;
    if version != WIRE_VERSION {
        return Err(Error::remote(format!(
            "hello speaks rendezvous version {version}, this root speaks {WIRE_VERSION} (ranks of different oxccl versions?)"
        )));
    }
    if !auth::verify(secret, HELLO_LABEL, nonce, body, proof) {
        return Err(Error::remote("hello failed authentication (wrong secret or tampered with)"));
    }
    let theirs: [u8; NONCE_LEN] = r.bytes(NONCE_LEN)?.try_into().map_err(|_| Error::remote("bad nonce"))?;
    let nranks = r.u32()? as usize;
    let rank = r.u32()? as usize;
    let addr = r.str(MAX_STR)?;
    let host = r.str(MAX_STR)?;
    r.finish()?;
    if nranks == 0 || nranks > MAX_RANKS || rank >= nranks {
        return Err(Error::remote(format!("hello has rank {rank} of nranks {nranks}")));
    }
    let addr = addr.parse().map_err(|_| Error::remote(format!("hello has a bad address {addr:?}")))?;
    Ok(HelloFields { nranks, rank, addr, host, nonce: theirs })
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
