//! Sealed control frames: every frame on a control channel carries its sequence number and a
//! MAC under the channel's key for its direction ([`crate::bootstrap::auth::Keys`], derived in
//! the authenticated handshake from the communicator's secret and both ends' nonces).
//!
//! ```text
//! | type | payload length (u16 BE) | payload | sequence (u64 BE) | tag (16 bytes) |
//! tag = HMAC-SHA256(key of this direction, everything before the tag), first 16 bytes
//! ```
//!
//! The first frame of each direction is number 0 and each next one the number after. The
//! receiver ([`Opener`]) acts on a frame only once its tag verifies and its number is the one
//! due: a frame forged without the key, altered on the way, replayed (from this channel or any
//! other, the keys differ per connection and direction) or reordered is refused, and since a
//! byte stream cannot be resynchronised after bytes that are not the peer's, the channel is
//! then treated as tampered with ([`Refused::Tampered`]).

use super::frame::{Frame, HEADER, MAX_PAYLOAD};
use crate::bootstrap::auth::KEY_LEN;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a frame's sequence number.
pub const SEQ_LEN: usize = 8;
/// Bytes of a frame's tag (HMAC-SHA256 truncated to 128 bits).
pub const TAG_LEN: usize = 16;
/// Bytes after the payload.
pub const TRAILER: usize = SEQ_LEN + TAG_LEN;

fn mac(key: &[u8; KEY_LEN]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length")
}

/// Seals the frames one end sends on a channel.
pub struct Sealer {
    key: [u8; KEY_LEN],
    next: u64,
}

impl Sealer {
    /// A sealer under `key` (the channel's send key), numbering from 0.
    pub fn new(key: [u8; KEY_LEN]) -> Sealer {
        Sealer { key, next: 0 }
    }

    /// The bytes of `f`, numbered and tagged. Each call takes the next number: the bytes must
    /// be sent (or the channel given up), or the receiver sees a gap.
    pub fn seal(&mut self, f: &Frame) -> Vec<u8> {
        let mut out = f.encode();
        out.extend_from_slice(&self.next.to_be_bytes());
        self.next += 1;
        let mut m = mac(&self.key);
        m.update(&out);
        out.extend_from_slice(&m.finalize().into_bytes()[..TAG_LEN]);
        out
    }
}

/// Why received bytes were not taken as a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The bytes are not the peer's as it sent them (forged, altered, replayed or reordered):
    /// what was found.
    Tampered(String),
    /// An authentic frame the peer should not have sent (another version, or a bug).
    Malformed(String),
}

/// Checks and takes the frames one end receives on a channel.
pub struct Opener {
    key: [u8; KEY_LEN],
    next: u64,
}

impl Opener {
    /// An opener under `key` (the channel's receive key), expecting frame 0 first.
    pub fn new(key: [u8; KEY_LEN]) -> Opener {
        Opener { key, next: 0 }
    }

    /// Takes the first whole frame off the front of `buf`: `Ok(None)` while it is incomplete;
    /// refused when its length cannot be a frame's, its tag does not verify, or its number is
    /// not the one due. Nothing of a refused frame is returned.
    pub fn take(&mut self, buf: &mut Vec<u8>) -> Result<Option<Frame>, Refused> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let len = u16::from_be_bytes([buf[1], buf[2]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(Refused::Tampered(format!(
                "frame #{} claims {len} bytes (the limit is {MAX_PAYLOAD})",
                self.next
            )));
        }
        let body = HEADER + len + SEQ_LEN;
        if buf.len() < body + TAG_LEN {
            return Ok(None);
        }
        let mut m = mac(&self.key);
        m.update(&buf[..body]);
        if m.verify_truncated_left(&buf[body..body + TAG_LEN]).is_err() {
            return Err(Refused::Tampered(format!(
                "frame #{} failed its MAC (forged or altered on the way)",
                self.next
            )));
        }
        let seq = u64::from_be_bytes(buf[HEADER + len..body].try_into().expect("8 bytes"));
        if seq != self.next {
            return Err(Refused::Tampered(format!(
                "frame #{seq} arrived where #{} was due (replayed or reordered)",
                self.next
            )));
        }
        self.next += 1;
        let frame =
            Frame::parse(buf[0], &buf[HEADER..HEADER + len]).map_err(|e| Refused::Malformed(e.message().into()));
        buf.drain(..body + TAG_LEN);
        frame.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> Vec<Frame> {
        vec![
            Frame::Heartbeat { pid: 4242 },
            Frame::Abort { code: 6, reason: "rank 2 (h:1) stopped answering heartbeats".into() },
            Frame::Closing,
        ]
    }

    #[test]
    fn sealed_frames_round_trip_split_anywhere() {
        let mut s = Sealer::new([3; KEY_LEN]);
        let bytes: Vec<u8> = frames().iter().flat_map(|f| s.seal(f)).collect();
        for cut in 0..bytes.len() {
            let mut o = Opener::new([3; KEY_LEN]);
            let (mut buf, mut got) = (bytes[..cut].to_vec(), Vec::new());
            while let Some(f) = o.take(&mut buf).unwrap() {
                got.push(f);
            }
            buf.extend_from_slice(&bytes[cut..]);
            while let Some(f) = o.take(&mut buf).unwrap() {
                got.push(f);
            }
            assert_eq!(got, frames(), "split at {cut}");
            assert!(buf.is_empty());
        }
    }

    /// What an opener that took frames 0.. of `genuine` makes of `bytes` next.
    fn after(genuine: usize, bytes: &[u8]) -> Result<Option<Frame>, Refused> {
        let mut s = Sealer::new([3; KEY_LEN]);
        let mut o = Opener::new([3; KEY_LEN]);
        for _ in 0..genuine {
            let mut b = s.seal(&Frame::Heartbeat { pid: 1 });
            assert!(o.take(&mut b).unwrap().is_some());
        }
        o.take(&mut bytes.to_vec())
    }

    fn tampered(r: Result<Option<Frame>, Refused>, what: &str) {
        match r {
            Err(Refused::Tampered(why)) => assert!(why.contains(what), "{why}"),
            other => panic!("expected tampering ({what}), got {other:?}"),
        }
    }

    #[test]
    fn forged_flipped_replayed_reordered_and_foreign_frames_are_refused() {
        let abort = Frame::Abort { code: 5, reason: "collective mismatch (forged)".into() };
        // Forged: the plain frame with a made-up trailer, and one sealed under another key.
        let mut plain = abort.encode();
        plain.extend_from_slice(&[0; TRAILER]);
        tampered(after(0, &plain), "failed its MAC");
        tampered(after(0, &Sealer::new([4; KEY_LEN]).seal(&abort)), "failed its MAC");
        // Flipped: any bit of a genuine frame.
        let genuine = Sealer::new([3; KEY_LEN]).seal(&abort);
        for i in 0..genuine.len() {
            let mut b = genuine.clone();
            b[i] ^= 0x10;
            match after(0, &b) {
                Err(Refused::Tampered(_)) => {}
                Ok(None) if i == 1 || i == 2 => {} // a longer length: waits for bytes that never verify
                other => panic!("byte {i} flipped: {other:?}"),
            }
        }
        // Replayed: frame 0 again after frame 0; reordered: frame 1 first.
        let mut s = Sealer::new([3; KEY_LEN]);
        let zero = s.seal(&abort);
        let one = s.seal(&abort);
        tampered(after(1, &zero), "#0 arrived where #1 was due");
        tampered(after(0, &one), "#1 arrived where #0 was due");
        // Over-long: refused before any payload is waited for.
        tampered(after(0, &[2, 0xff, 0xff]), "claims 65535 bytes");
        // Nothing refused is ever returned, and a genuine frame still is.
        assert_eq!(after(0, &zero), Ok(Some(abort)));
    }

    #[test]
    fn an_authentic_but_malformed_frame_is_told_apart() {
        let mut bytes = vec![9, 0, 0];
        bytes.extend_from_slice(&0u64.to_be_bytes());
        let mut m = mac(&[3; KEY_LEN]);
        m.update(&bytes);
        bytes.extend_from_slice(&m.finalize().into_bytes()[..TAG_LEN]);
        assert!(matches!(after(0, &bytes), Err(Refused::Malformed(_))));
    }
}
