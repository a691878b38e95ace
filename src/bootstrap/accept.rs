//! Accepting data connections: every handshake runs at once, without blocking, so a stranger
//! that connects and stays silent (or dribbles bytes) never delays a real peer.
//!
//! The handshake is mutual (both ends prove the communicator's secret over both ends' nonces,
//! see [`super::connect_peer`]):
//!
//! ```text
//! acceptor  -> connector: nonce_a
//! connector -> acceptor:  nonce_c | HMAC(secret, DATA_LABEL, nonce_a, from|to|nonce_c) | from
//! acceptor  -> connector: HMAC(secret, DATA_ACK_LABEL, nonce_c, from|to|nonce_a)
//! ```
//!
//! A control channel ([`super::Purpose::Control`]) runs the same exchange under the
//! `CONTROL_LABEL`s; the acceptor learns the purpose from the label its MAC verifies with.
//!
//! The acceptor polls its listener and every connection in handshake together
//! ([`super::pending`]): each gets at most [`STRANGER_LIMIT`] (and never past the caller's
//! deadline), at most [`MAX_HANDSHAKES`] (or a quarter of the descriptor limit) run at once,
//! running out of descriptors drops the oldest and pauses, and a dropped stranger costs one
//! log line. Only the deadline of the whole wait (`OXCCL_TIMEOUT_MS`) ends it, with a message
//! naming the ranks that never connected and what was dropped meanwhile.

use super::auth::{self, NONCE_LEN, PROOF_LEN};
use super::pending::{handshake_cap, Challenged, Pool};
use super::{data_context, wire, Bootstrap, Conn, Purpose};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Longest time one incoming connection may take to answer the challenge.
pub const STRANGER_LIMIT: Duration = Duration::from_secs(2);
/// Most handshakes in progress at once (fewer under a low descriptor limit).
pub const MAX_HANDSHAKES: usize = 1024;
/// How often a rank says which peers it still waits for.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);
/// Bytes of the connector's answer: length prefix, nonce, proof, rank.
const ANSWER: usize = 4 + NONCE_LEN + PROOF_LEN + 4;

/// Handshakes still in progress when a wait ended (its ranks had all connected): kept for the
/// next wait, so a peer that connected early is never cut off mid-handshake.
#[derive(Default)]
pub struct InProgress(Option<Pool>);

/// Connections of one purpose that arrived for ranks nobody waited for yet, by (purpose, rank).
pub type Extra = HashMap<(Purpose, usize), Conn>;

/// What an answer said: the claimed rank and the purpose it proved, or why it is refused.
pub(super) fn check_answer(b: &Bootstrap, nonce: &[u8], msg: &[u8]) -> Result<(usize, [u8; NONCE_LEN], Purpose)> {
    let mut r = wire::Reader::new(msg);
    let theirs: [u8; NONCE_LEN] = r.bytes(NONCE_LEN)?.try_into().map_err(|_| Error::remote("bad nonce"))?;
    let proof = r.bytes(PROOF_LEN)?;
    let from = r.u32()? as usize;
    r.finish()?;
    if from >= b.peers.len() || from == b.rank {
        return Err(Error::remote(format!("connection claims to be from rank {from}")));
    }
    let ctx = [&data_context(from, b.rank)[..], &theirs[..]].concat();
    // The label that verifies is the purpose (at most two MACs per answer).
    let purpose = [Purpose::Data, Purpose::Control]
        .into_iter()
        .find(|p| auth::verify(&b.secret, p.labels().0, nonce, &ctx, proof))
        .ok_or_else(|| {
            Error::remote(format!("connection claiming rank {from} failed authentication (wrong secret)"))
        })?;
    Ok((from, theirs, purpose))
}

/// The acceptor's proof for a connection from `from` that sent `theirs`, after our `nonce`.
pub(super) fn ack(b: &Bootstrap, from: usize, theirs: &[u8], nonce: &[u8], purpose: Purpose) -> [u8; PROOF_LEN] {
    let ctx = [&data_context(from, b.rank)[..], nonce].concat();
    auth::prove(&b.secret, purpose.labels().1, theirs, &ctx)
}

/// Connections dropped during one wait (for the log and the timeout message).
struct Dropped {
    rank: usize,
    count: usize,
    last: String,
}

impl Dropped {
    fn add(&mut self, h: Challenged, why: &str) {
        self.count += 1;
        self.last = format!("{}: {why}", h.who());
        if self.count <= 8 || self.count % 100 == 0 {
            crate::warn!("rank {}: dropped data connection #{} from {}", self.rank, self.count, self.last);
        }
    }
}

/// Checks a complete answer and sends the acknowledgement; the rank and purpose it proved,
/// and the connection's keys.
fn finish(b: &Bootstrap, h: &Challenged, msg: &[u8]) -> Result<(usize, Purpose, auth::Keys)> {
    if msg.len() != ANSWER - 4 {
        return Err(Error::remote("sent a malformed answer to the challenge"));
    }
    let (from, theirs, purpose) = check_answer(b, &h.nonce, msg)?;
    let keys = auth::Keys::derive(&b.secret, purpose.labels().0, b.rank, from, &h.nonce, &theirs);
    let proof = ack(b, from, &theirs, &h.nonce, purpose);
    let mut frame = (PROOF_LEN as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&proof);
    // 36 bytes on a fresh connection: the socket buffer takes them at once.
    match crate::net::nosig::send(&h.s, &frame) {
        Ok(n) if n == frame.len() => Ok((from, purpose, keys)),
        Ok(_) | Err(_) => Err(Error::remote(format!("rank {from}'s connection took no acknowledgement"))),
    }
}

/// Accepts and authenticates connections on `b`'s listeners (its data listener and those on its
/// further rails) until every rank of `want` has
/// connected a data link (they are removed from it); data links from other ranks go to
/// `extra` (control channels are closed). Fails at `deadline`, or when `abort` says so.
pub fn accept_ranks(
    b: &Bootstrap,
    keep: &mut InProgress,
    want: &mut Vec<usize>,
    extra: &mut HashMap<usize, TcpStream>,
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut all = Extra::new();
    let r = accept_for(b, keep, Purpose::Data, want, &mut all, deadline, abort);
    extra.extend(all.into_iter().filter(|((p, _), _)| *p == Purpose::Data).map(|((_, r), c)| (r, c.stream)));
    r.map(|v| v.into_iter().map(|(r, c)| (r, c.stream)).collect())
}

/// [`accept_ranks`] for connections of `purpose`, with their keys; connections of another
/// purpose or from ranks not in `want` go to `extra`.
pub fn accept_for(
    b: &Bootstrap,
    keep: &mut InProgress,
    purpose: Purpose,
    want: &mut Vec<usize>,
    extra: &mut Extra,
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Vec<(usize, Conn)>> {
    let listener = &b.listener;
    // The data listener and those on the further rails ([`Bootstrap::further`]): one pool.
    let all: Vec<&std::net::TcpListener> = std::iter::once(listener).chain(b.further.iter()).collect();
    for l in &all {
        l.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    }
    let pool = keep.0.get_or_insert_with(|| Pool::new(handshake_cap(MAX_HANDSHAKES), STRANGER_LIMIT, ANSWER - 4));
    let mut out = Vec::new();
    let mut dropped = Dropped { rank: b.rank, count: 0, last: String::new() };
    let start = Instant::now();
    let mut next_progress = start + PROGRESS_EVERY;
    while !want.is_empty() {
        if abort() {
            return Err(Error::invalid_usage(format!(
                "rank {}: communicator was aborted while waiting for ranks {want:?} to connect",
                b.rank
            )));
        }
        let now = Instant::now();
        if now >= deadline {
            let others = if dropped.count > 0 {
                format!("; {} other connection(s) were dropped meanwhile (last: {})", dropped.count, dropped.last)
            } else {
                String::new()
            };
            return Err(Error::timeout(format!(
                "rank {}: ranks {want:?} did not connect to this rank's data listener {} before the deadline (OXCCL_TIMEOUT_MS){others}",
                b.rank,
                listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
            )));
        }
        if now >= next_progress {
            next_progress += PROGRESS_EVERY;
            crate::warn!(
                "rank {}: waiting for ranks {want:?} to connect: {} of {} s",
                b.rank,
                now.duration_since(start).as_secs(),
                deadline.saturating_duration_since(start).as_secs()
            );
        }
        // New connections: each gets its challenge at once.
        pool.accept_all(&all, &mut |h, why| dropped.add(h, why)).map_err(|e| e.context(format!("rank {}", b.rank)))?;
        // Progress every handshake.
        let hs = &mut pool.hs;
        let mut i = 0;
        while i < hs.len() {
            match hs[i].step().and_then(|m| m.map(|m| finish(b, &hs[i], &m)).transpose()) {
                Ok(None) if !hs[i].expired(now) => i += 1,
                Ok(None) => dropped.add(hs.swap_remove(i), "sent no valid answer within the limit"),
                Err(e) => dropped.add(hs.swap_remove(i), e.message()),
                Ok(Some((from, what, keys))) => {
                    let h = hs.swap_remove(i);
                    h.s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
                    h.s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
                    let conn = Conn { stream: h.s, keys };
                    match want.iter().position(|&p| p == from).filter(|_| what == purpose) {
                        Some(k) => {
                            want.swap_remove(k);
                            out.push((from, conn));
                        }
                        None => {
                            extra.insert((what, from), conn);
                        }
                    }
                }
            }
        }
        if want.is_empty() {
            break;
        }
        // Sleep until something arrives, a handshake expires, or 100 ms (abort checks).
        pool.wait_all(&all, deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(100)));
    }
    Ok(out)
}
