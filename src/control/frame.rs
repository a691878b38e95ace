//! The frames of a control channel: a type byte, a 16-bit big-endian payload length, the
//! payload (at most [`MAX_PAYLOAD`] bytes).
//!
//! | type | frame     | payload                                  |
//! |------|-----------|------------------------------------------|
//! | 1    | heartbeat | the sender's process id (u32)            |
//! | 2    | abort     | `ncclResult_t` code (i32), reason (UTF-8) |
//! | 3    | closing   | none: the sender destroys its end         |

use crate::error::{Error, Result};

/// Longest payload accepted (an abort's reason is cut to fit).
pub const MAX_PAYLOAD: usize = 1024;
/// Bytes before the payload.
pub const HEADER: usize = 3;

const HEARTBEAT: u8 = 1;
const ABORT: u8 = 2;
const CLOSING: u8 = 3;

/// One control frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// The sender is alive (sent every second by its liveness thread).
    Heartbeat {
        /// The sender's process id.
        pid: u32,
    },
    /// The sender's communicator failed; the receiver fails too.
    Abort {
        /// The `ncclResult_t` of the failure.
        code: i32,
        /// What failed, as the sender words it.
        reason: String,
    },
    /// The sender destroys its communicator (or exits): the end of the channel is no death.
    Closing,
}

impl Frame {
    /// The frame's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let (kind, payload) = match self {
            Frame::Heartbeat { pid } => (HEARTBEAT, pid.to_be_bytes().to_vec()),
            Frame::Abort { code, reason } => {
                let mut p = code.to_be_bytes().to_vec();
                let mut cut = reason.len().min(MAX_PAYLOAD - 4);
                while !reason.is_char_boundary(cut) {
                    cut -= 1;
                }
                p.extend_from_slice(&reason.as_bytes()[..cut]);
                (ABORT, p)
            }
            Frame::Closing => (CLOSING, Vec::new()),
        };
        let mut out = vec![kind];
        out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        out.extend_from_slice(&payload);
        out
    }

    /// Takes the first whole frame off the front of `buf`: `Ok(None)` while it is incomplete,
    /// an error for an unknown type, an oversized length or a malformed payload.
    pub fn take(buf: &mut Vec<u8>) -> Result<Option<Frame>> {
        if buf.len() < HEADER {
            return Ok(None);
        }
        let len = u16::from_be_bytes([buf[1], buf[2]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(Error::remote(format!("control frame of {len} bytes (the limit is {MAX_PAYLOAD})")));
        }
        if buf.len() < HEADER + len {
            return Ok(None);
        }
        let frame = Frame::parse(buf[0], &buf[HEADER..HEADER + len])?;
        buf.drain(..HEADER + len);
        Ok(Some(frame))
    }

    /// The frame of type `kind` with payload `p`; an error for an unknown type or a malformed
    /// payload. An abort's reason is read as UTF-8 (invalid bytes replaced), not yet cleaned
    /// ([`clean`]).
    pub fn parse(kind: u8, p: &[u8]) -> Result<Frame> {
        Ok(match (kind, p.len()) {
            (HEARTBEAT, 4) => Frame::Heartbeat { pid: u32::from_be_bytes([p[0], p[1], p[2], p[3]]) },
            (ABORT, 4..) => Frame::Abort {
                code: i32::from_be_bytes([p[0], p[1], p[2], p[3]]),
                reason: String::from_utf8_lossy(&p[4..]).into_owned(),
            },
            (CLOSING, 0) => Frame::Closing,
            (t, len) => return Err(Error::remote(format!("malformed control frame (type {t}, {len} bytes)"))),
        })
    }
}

/// Longest text taken from a peer into a message ([`clean`]), in characters.
pub const MAX_REASON: usize = 512;

/// Text from a peer (an abort's reason, a host name) made safe to log and return: control
/// characters (line breaks, the escape that starts an ANSI sequence, NUL, DEL, the C1 range)
/// are written as `\u{..}` escapes and anything past [`MAX_REASON`] characters is cut, with
/// `…` marking the cut.
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(4 * MAX_REASON));
    for (i, c) in text.chars().enumerate() {
        if i == MAX_REASON {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_split_anywhere() {
        let frames = [
            Frame::Heartbeat { pid: 4242 },
            Frame::Abort { code: 6, reason: "rank 2 (h:1) stopped answering heartbeats for 5.0 s".into() },
            Frame::Closing,
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(|f| f.encode()).collect();
        for cut in 0..bytes.len() {
            let mut buf = bytes[..cut].to_vec();
            let mut got = Vec::new();
            while let Some(f) = Frame::take(&mut buf).unwrap() {
                got.push(f);
            }
            buf.extend_from_slice(&bytes[cut..]);
            while let Some(f) = Frame::take(&mut buf).unwrap() {
                got.push(f);
            }
            assert_eq!(got, frames, "split at {cut}");
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn clean_escapes_control_characters_and_bounds_the_length() {
        let forged = "rank 1 failed\n[INFO] rank 0: all good\x1b[2K\x1b[1A\r\u{9b}31m\0\x7f done";
        let c = clean(forged);
        assert!(c.chars().all(|ch| !ch.is_control()), "{c:?}");
        assert_eq!(
            c,
            "rank 1 failed\\u{a}[INFO] rank 0: all good\\u{1b}[2K\\u{1b}[1A\\u{d}\\u{9b}31m\\u{0}\\u{7f} done"
        );
        assert_eq!(clean("plain text, é and 中"), "plain text, é and 中", "printable text is kept");
        let long = clean(&"x".repeat(10 * MAX_REASON));
        assert_eq!(long.chars().count(), MAX_REASON + 1);
        assert!(long.ends_with('…'));
        let escapes = clean(&"\x1b".repeat(10 * MAX_REASON));
        assert!(escapes.len() <= MAX_REASON * "\\u{1b}".len() + '…'.len_utf8(), "{}", escapes.len());
    }

    #[test]
    fn bad_frames_are_refused_and_long_reasons_cut() {
        assert!(Frame::take(&mut vec![9, 0, 0]).is_err(), "unknown type");
        assert!(Frame::take(&mut vec![1, 0xff, 0xff]).is_err(), "oversized");
        assert!(Frame::take(&mut vec![1, 0, 1, 7]).is_err(), "heartbeat of 1 byte");
        assert!(Frame::take(&mut vec![3, 0, 1, 0]).is_err(), "closing with a payload");
        let long = Frame::Abort { code: 5, reason: "é".repeat(MAX_PAYLOAD) }.encode();
        assert!(long.len() <= HEADER + MAX_PAYLOAD);
        match Frame::take(&mut long.clone()).unwrap() {
            Some(Frame::Abort { code: 5, reason }) => assert!(reason.chars().all(|c| c == 'é') && !reason.is_empty()),
            other => panic!("{other:?}"),
        }
    }
}
