//! "Abort with reason" frames: how a failing rank tells its peers why.
//!
//! When an operation fails on a rank (a collective mismatch it detected, a dead peer, a
//! timeout), the engine writes one small frame on each link before the communicator shuts its
//! links: the `ncclResult_t` code and the text of the error. A peer whose operation then fails
//! on that link (end of stream) reads the bytes the link still holds and finds the frame at
//! their end; it fails its own operation with the frame's code and text and forwards the frame
//! once on its own links (it fails only once), so the reason floods every rank in bounded time.
//!
//! Data links carry no framing, so a frame is recognised by its *trailer*: the frame is always
//! the last thing a failing rank writes on a link, and ends with its text length and a magic.
//! The writer puts it on a link only where it cannot be mistaken for a complete operation's
//! data: where the receiver expects an operation signature, or inside a send step with more
//! bytes left than the frame holds (so the receiver is still missing data when the link
//! closes). Shared-memory links send it on their TCP side channel instead.

use crate::error::{ErrorKind, Result};

const HEAD_MAGIC: [u8; 4] = *b"OXAB";
const TAIL_MAGIC: [u8; 4] = *b"BAXO";
/// Bytes around the text: magic, code, zero, length (head); length, magic (trailer).
const OVERHEAD: usize = 8 + 6;
/// Longest text a frame carries (longer texts are cut).
pub const MAX_TEXT: usize = 1024;
/// Longest frame on the wire.
pub const MAX_FRAME: usize = MAX_TEXT + OVERHEAD;

/// Encodes a frame carrying `kind` and `text` (cut to [`MAX_TEXT`] bytes at a character
/// boundary).
pub fn encode(kind: ErrorKind, text: &str) -> Vec<u8> {
    let mut end = text.len().min(MAX_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let t = &text.as_bytes()[..end];
    let len = (t.len() as u16).to_be_bytes();
    let mut f = Vec::with_capacity(t.len() + OVERHEAD);
    f.extend_from_slice(&HEAD_MAGIC);
    f.push(kind.code() as u8);
    f.push(0);
    f.extend_from_slice(&len);
    f.extend_from_slice(t);
    f.extend_from_slice(&len);
    f.extend_from_slice(&TAIL_MAGIC);
    f
}

/// The kind a frame's code byte names: any error of the `ncclResult_t` table except
/// `ncclInProgress`, which is not a failure.
fn kind_of(code: u8) -> Option<ErrorKind> {
    ErrorKind::from_code(i32::from(code)).filter(|&k| k != ErrorKind::InProgress)
}

/// Finds a frame at the very end of `bytes` (the last bytes a peer wrote on a link before
/// closing it); returns its code and text. Any byte string is accepted (never a panic).
pub fn parse_tail(bytes: &[u8]) -> Option<(ErrorKind, String)> {
    let n = bytes.len();
    if n < OVERHEAD || bytes[n - 4..] != TAIL_MAGIC {
        return None;
    }
    let len = u16::from_be_bytes([bytes[n - 6], bytes[n - 5]]) as usize;
    if len > MAX_TEXT || n < len + OVERHEAD {
        return None;
    }
    let f = &bytes[n - len - OVERHEAD..];
    if f[..4] != HEAD_MAGIC || f[5] != 0 || u16::from_be_bytes([f[6], f[7]]) as usize != len {
        return None;
    }
    let kind = kind_of(f[4])?;
    Some((kind, String::from_utf8_lossy(&f[8..8 + len]).into_owned()))
}

/// Appends `new` to `tail`, keeping only the last [`MAX_FRAME`] bytes (a frame is the last
/// thing on a link, so older bytes never matter).
pub fn keep_tail(tail: &mut Vec<u8>, new: &[u8]) {
    if new.len() >= MAX_FRAME {
        tail.clear();
        tail.extend_from_slice(&new[new.len() - MAX_FRAME..]);
        return;
    }
    tail.extend_from_slice(new);
    if tail.len() > MAX_FRAME {
        tail.drain(..tail.len() - MAX_FRAME);
    }
}

/// Writes all of `frame` through `try_send`, waiting at most `limit` in total (best effort:
/// a peer that reads nothing is dead or stuck, and will learn of the failure otherwise).
pub fn write_bounded(
    frame: &[u8],
    limit: std::time::Duration,
    mut try_send: impl FnMut(&[u8]) -> Result<usize>,
) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut off = 0;
    while off < frame.len() {
        match try_send(&frame[off..]) {
            Ok(0) => {
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            Ok(n) => off += n,
            Err(_) => return false,
        }
    }
    true
}

/// [`write_bounded`] on a non-blocking side socket that carries only wake-ups and frames
/// besides the link's data (shared memory, OFI): a full socket buffer waits, an error ends it.
pub fn write_bounded_to(sock: &std::net::TcpStream, frame: &[u8], limit: std::time::Duration) -> bool {
    write_bounded(frame, limit, |b| match crate::net::nosig::send(sock, b) {
        Ok(n) => Ok(n),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => Ok(0),
        Err(e) => Err(crate::error::Error::from_io("abort frame", e)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_found_at_the_end_of_any_preceding_bytes() {
        let f = encode(ErrorKind::InvalidUsage, "rank 1: collective mismatch");
        let mut stream = vec![7u8; 100];
        stream.extend_from_slice(&f);
        assert_eq!(parse_tail(&stream), Some((ErrorKind::InvalidUsage, "rank 1: collective mismatch".into())));
        assert_eq!(parse_tail(&f), Some((ErrorKind::InvalidUsage, "rank 1: collective mismatch".into())));
        assert_eq!(parse_tail(&stream[..stream.len() - 1]), None, "a cut frame is not a frame");
        let mut tail = Vec::new();
        for chunk in stream.chunks(7) {
            keep_tail(&mut tail, chunk);
        }
        assert_eq!(parse_tail(&tail).map(|x| x.0), Some(ErrorKind::InvalidUsage));
    }

    #[test]
    fn long_texts_are_cut_at_a_character_boundary() {
        let text = "é".repeat(MAX_TEXT);
        let f = encode(ErrorKind::Remote, &text);
        assert!(f.len() <= MAX_FRAME);
        let (k, t) = parse_tail(&f).expect("frame");
        assert_eq!(k, ErrorKind::Remote);
        assert!(text.starts_with(&t) && t.len() >= MAX_TEXT - 1);
    }
}
