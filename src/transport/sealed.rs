//! Data integrity on a link (`OXCCL_WIRE_INTEGRITY=1`): [`SealedLink`] wraps a TCP link and
//! carries its byte stream as records, each checked before any of its bytes is delivered.
//!
//! ```text
//! | payload length (u32 BE, 1..=MAX_RECORD) | payload | tag (16 bytes) |
//! tag = HMAC-SHA256(key of this direction, record number (u64 BE) | length | payload), first 16 bytes
//! ```
//!
//! The keys are the data connection's ([`crate::bootstrap::auth::Keys`]: derived in the
//! authenticated handshake from the communicator's secret and both ends' nonces, one per
//! direction); records are numbered from 0 in each direction, the number is not sent but
//! covered by the tag, so a record altered, forged, replayed, reordered or dropped on the way
//! fails its check and the link fails as tampered with, naming the peer's address. The
//! receiver holds a whole record before it delivers a byte of it; the sender reports bytes
//! taken only once their whole record is in the socket, so the stream's progress is what the
//! wrapped link's would be. HMAC-SHA256 is the crate's one MAC already (sha2 uses the CPU's
//! SHA extensions where present); confidentiality is not offered: the bytes travel in clear.

use super::{Interest, Link};
use crate::bootstrap::auth::{Keys, KEY_LEN};
use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::os::fd::RawFd;

/// Largest payload of one record.
pub const MAX_RECORD: usize = 256 << 10;
/// Bytes of a record's length field.
const LEN: usize = 4;
/// Bytes of a record's tag (HMAC-SHA256 truncated to 128 bits).
pub const TAG_LEN: usize = 16;

fn tag(key: &[u8; KEY_LEN], seq: u64, head_and_payload: &[&[u8]]) -> [u8; TAG_LEN] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length");
    m.update(&seq.to_be_bytes());
    for p in head_and_payload {
        m.update(p);
    }
    m.finalize().into_bytes()[..TAG_LEN].try_into().expect("16 bytes")
}

/// The record being sent: its bytes, how many the socket took, and how many of its payload
/// bytes the caller has been told were taken.
struct Tx {
    key: [u8; KEY_LEN],
    seq: u64,
    rec: Vec<u8>,
    sent: usize,
    payload: usize,
    claimed: usize,
}

/// The record being received: its bytes so far, its full size once the length is read, and
/// (once checked) how many payload bytes were delivered.
struct Rx {
    key: [u8; KEY_LEN],
    seq: u64,
    rec: Vec<u8>,
    have: usize,
    checked: bool,
    delivered: usize,
}

/// A link whose byte stream travels in MAC'd records (see the module documentation).
pub struct SealedLink {
    inner: Box<dyn Link>,
    tx: Tx,
    rx: Rx,
}

impl SealedLink {
    /// Wraps `inner` (a fresh link: no byte sent or received yet) with the connection's keys.
    pub fn new(inner: Box<dyn Link>, keys: &Keys) -> SealedLink {
        SealedLink {
            inner,
            tx: Tx { key: keys.send, seq: 0, rec: Vec::new(), sent: 0, payload: 0, claimed: 0 },
            rx: Rx { key: keys.recv, seq: 0, rec: vec![0; LEN], have: 0, checked: false, delivered: 0 },
        }
    }

    fn tampered(&self, why: &str) -> Error {
        Error::remote(format!("data link to {} was tampered with: {why}", self.inner.describe()))
    }

    /// Starts a record of the first bytes of `bufs` (at most [`MAX_RECORD`]).
    fn seal(&mut self, bufs: &[&[u8]]) {
        let total: usize = bufs.iter().map(|b| b.len()).sum::<usize>().min(MAX_RECORD);
        let t = &mut self.tx;
        t.rec.clear();
        t.rec.extend_from_slice(&(total as u32).to_be_bytes());
        let mut left = total;
        for b in bufs {
            let n = b.len().min(left);
            t.rec.extend_from_slice(&b[..n]);
            left -= n;
        }
        let mac = tag(&t.key, t.seq, &[&t.rec]);
        t.rec.extend_from_slice(&mac);
        t.seq += 1;
        (t.sent, t.payload, t.claimed) = (0, total, 0);
    }

    /// Reads the current record as far as the wrapped link has it; checks it once whole.
    fn fill(&mut self) -> Result<()> {
        while !self.rx.checked {
            let want = if self.rx.have < LEN { LEN } else { self.rx.rec.len() };
            if self.rx.have == LEN && self.rx.rec.len() == LEN {
                let len = u32::from_be_bytes(self.rx.rec[..LEN].try_into().expect("4 bytes")) as usize;
                if len == 0 || len > MAX_RECORD {
                    let why = format!("record #{} claims {len} bytes (1 to {MAX_RECORD})", self.rx.seq);
                    return Err(self.tampered(&why));
                }
                self.rx.rec.resize(LEN + len + TAG_LEN, 0);
                continue;
            }
            let have = self.rx.have;
            let n = self.inner.try_recv(&mut self.rx.rec[have..want])?;
            if n == 0 {
                return Ok(());
            }
            self.rx.have += n;
            if self.rx.have == self.rx.rec.len() && self.rx.rec.len() > LEN {
                let end = self.rx.rec.len() - TAG_LEN;
                let want = tag(&self.rx.key, self.rx.seq, &[&self.rx.rec[..end]]);
                // Constant time is not needed here: the tag is checked once and the link dies.
                if want[..] != self.rx.rec[end..] {
                    let why =
                        format!("record #{} failed its MAC (altered, forged, replayed or reordered)", self.rx.seq);
                    return Err(self.tampered(&why));
                }
                self.rx.seq += 1;
                (self.rx.checked, self.rx.delivered) = (true, 0);
            }
        }
        Ok(())
    }

    /// Copies checked bytes into `a`, then `b`; the count.
    fn deliver(&mut self, a: &mut [u8], b: &mut [u8]) -> usize {
        let r = &mut self.rx;
        if !r.checked {
            return 0;
        }
        let payload = &r.rec[LEN + r.delivered..r.rec.len() - TAG_LEN];
        let na = a.len().min(payload.len());
        a[..na].copy_from_slice(&payload[..na]);
        let nb = b.len().min(payload.len() - na);
        b[..nb].copy_from_slice(&payload[na..na + nb]);
        r.delivered += na + nb;
        if LEN + r.delivered + TAG_LEN == r.rec.len() {
            r.rec.truncate(LEN);
            (r.have, r.checked) = (0, false);
        }
        na + nb
    }
}

impl Link for SealedLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        self.try_send_vectored(&[buf])
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let offered: usize = bufs.iter().map(|b| b.len()).sum();
        if offered == 0 {
            return Ok(0);
        }
        if self.tx.rec.is_empty() {
            self.seal(bufs);
        }
        while self.tx.sent < self.tx.rec.len() {
            let n = self.inner.try_send(&self.tx.rec[self.tx.sent..])?;
            if n == 0 {
                return Ok(0);
            }
            self.tx.sent += n;
        }
        // The whole record is out: its payload (the offered bytes' prefix) is taken.
        let n = (self.tx.payload - self.tx.claimed).min(offered);
        self.tx.claimed += n;
        if self.tx.claimed == self.tx.payload {
            self.tx.rec.clear();
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.try_recv_vectored(buf, &mut [])
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        if a.is_empty() && b.is_empty() {
            return Ok(0);
        }
        self.fill()?;
        Ok(self.deliver(a, b))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        self.inner.poll_fd()
    }

    fn poll_events(&self, interest: Interest) -> i16 {
        self.inner.poll_events(interest)
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        self.inner.poll_set(interest, out)
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        // Checked bytes waiting, or a record sent whose bytes are not all claimed: no sleep.
        let sent = !self.tx.rec.is_empty() && self.tx.sent == self.tx.rec.len();
        if (interest.read && self.rx.checked) || (interest.write && sent) {
            return Ok(false);
        }
        self.inner.arm(interest)
    }

    fn describe(&self) -> String {
        format!("{} (OXCCL_WIRE_INTEGRITY)", self.inner.describe())
    }

    fn shutdown(&self) {
        self.inner.shutdown()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::tcp::tests::{bytes, exchange, socket_pairs};
    use crate::transport::tcp::TcpLink;

    fn keys() -> (Keys, Keys) {
        let (x, y) = ([5u8; KEY_LEN], [6u8; KEY_LEN]);
        (Keys { send: x, recv: y }, Keys { send: y, recv: x })
    }

    fn sealed(s: std::net::TcpStream, peer: usize, k: &Keys) -> SealedLink {
        SealedLink::new(Box::new(TcpLink::new(s, peer).unwrap()), k)
    }

    #[test]
    fn streams_arrive_whole_both_ways_for_any_pieces() {
        let (mut sa, mut sb) = socket_pairs(1);
        let (ka, kb) = keys();
        let mut a = sealed(sa.pop().unwrap(), 1, &ka);
        let mut b = sealed(sb.pop().unwrap(), 0, &kb);
        let cases =
            [(1usize, 1, 1), (4099, 1000, 333), (MAX_RECORD + 5, MAX_RECORD + 5, 7), (3 << 20, 1 << 20, 100_000)];
        for (i, &(len, send, recv)) in cases.iter().enumerate() {
            let msg = bytes(len, i as u64 + 1);
            let [got_b, got_a] = exchange(&mut a, &mut b, &msg, send, recv);
            assert!(got_b == msg && got_a == msg, "length {len}, pieces {send}/{recv}");
        }
        assert!(a.describe().ends_with("(OXCCL_WIRE_INTEGRITY)"), "{}", a.describe());
    }

    /// A record as a peer with `key` seals record `seq` of `payload` (length field `len`).
    fn record(key: &[u8; KEY_LEN], seq: u64, len: u32, payload: &[u8]) -> Vec<u8> {
        let mut r = len.to_be_bytes().to_vec();
        r.extend_from_slice(payload);
        let t = tag(key, seq, &[&r]);
        r.extend_from_slice(&t);
        r
    }

    /// What a sealed link (keys of side b) makes of `wire`, written raw by its peer (up to 10
    /// bytes, or what came within 5 s).
    fn receive(wire: &[u8]) -> Result<Vec<u8>> {
        use std::io::Write;
        let (mut sa, mut sb) = socket_pairs(1);
        let (_, kb) = keys();
        let mut raw = sa.pop().unwrap();
        let mut b = sealed(sb.pop().unwrap(), 0, &kb);
        raw.write_all(wire).unwrap();
        let (mut out, mut buf) = (Vec::new(), vec![0u8; 1 << 16]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline && out.len() < 10 {
            let n = b.try_recv(&mut buf)?;
            out.extend_from_slice(&buf[..n]);
        }
        Ok(out)
    }

    #[test]
    fn altered_forged_replayed_and_oversized_records_fail_the_link_as_tampered() {
        let k = [5u8; KEY_LEN]; // side a's send key: what b checks
        let (one, two) = (record(&k, 0, 5, b"hello"), record(&k, 1, 5, b"world"));
        assert_eq!(receive(&[&one[..], &two[..]].concat()).unwrap(), b"helloworld", "genuine records");
        let tampered = |wire: &[u8], what: &str| {
            let e = receive(wire).expect_err(what);
            assert!(e.message().contains("data link to rank 0 (127.0.0.1:"), "{what}: {e}");
            assert!(e.message().contains("was tampered with"), "{what}: {e}");
            e.message().to_string()
        };
        let mut flipped = two.clone();
        flipped[6] ^= 1;
        let e = tampered(&[&one[..], &flipped[..]].concat(), "a flipped byte");
        assert!(e.contains("record #1 failed its MAC"), "{e}");
        tampered(&[&one[..], &one[..]].concat(), "a replayed record");
        tampered(&two, "a record out of turn");
        tampered(&record(&[9; KEY_LEN], 0, 5, b"hello"), "a record forged under another key");
        assert!(tampered(&record(&k, 0, 0, b""), "an empty record").contains("claims 0 bytes"));
        let e = tampered(&(MAX_RECORD as u32 + 1).to_be_bytes(), "an oversized record");
        assert!(e.contains(&format!("claims {} bytes", MAX_RECORD + 1)), "{e}");
    }
}
