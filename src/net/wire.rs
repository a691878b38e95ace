//! Framed, bounded messages for the bootstrap and connection handshakes.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes. Every length read from
//! the network is checked against the caller's bound before anything is allocated, and every
//! read has a deadline.

use crate::error::{Error, Result};
use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Writes one frame.
pub fn write_frame(s: &mut TcpStream, payload: &[u8]) -> Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| Error::internal("bootstrap frame too large"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(payload);
    crate::net::nosig::send_all(s, &buf).map_err(|e| Error::remote(format!("sending to {}: {e}", peer(s))))
}

/// Reads one frame of at most `max` bytes, before `deadline`.
pub fn read_frame(s: &mut TcpStream, max: usize, deadline: Instant) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_until(s, &mut len, deadline)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(Error::remote(format!("{} sent a frame of {len} bytes (limit {max})", peer(s))));
    }
    let mut buf = vec![0u8; len];
    read_exact_until(s, &mut buf, deadline)?;
    Ok(buf)
}

/// Fills `buf` from a blocking stream, failing with `ncclTimeout` at `deadline`.
pub fn read_exact_until(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(format!("{} sent nothing before the deadline", peer(s))));
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1)))).map_err(|e| Error::from_io("SO_RCVTIMEO", e))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(Error::remote(format!("{} closed the connection", peer(s)))),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(Error::remote(format!("reading from {}: {e}", peer(s)))),
        }
    }
    Ok(())
}

fn peer(s: &TcpStream) -> String {
    s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "peer".into())
}

/// Builds a message field by field.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    /// Appends raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// Appends a big-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }
    /// Appends a big-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }
    /// Appends a length-prefixed string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u32(s.len() as u32).bytes(s.as_bytes())
    }
}

/// Reads a message field by field; every read is bounds-checked.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    /// Takes `n` raw bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| Error::remote("truncated bootstrap message"))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }
    /// Takes a big-endian u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.bytes(4)?.try_into().map_err(|_| Error::remote("bad u32"))?))
    }
    /// Takes a big-endian u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.bytes(8)?.try_into().map_err(|_| Error::remote("bad u64"))?))
    }
    /// Takes a length-prefixed UTF-8 string of at most `max` bytes.
    pub fn str(&mut self, max: usize) -> Result<String> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(Error::remote(format!("string of {n} bytes in bootstrap message (limit {max})")));
        }
        String::from_utf8(self.bytes(n)?.to_vec()).map_err(|_| Error::remote("bootstrap string is not UTF-8"))
    }
    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(Error::remote("trailing bytes in bootstrap message"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_rejects_truncation_and_oversize() {
        let mut w = Writer::default();
        w.u32(7).str("hello").u64(9);
        let mut r = Reader::new(&w.0);
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.str(16).unwrap(), "hello");
        assert_eq!(r.u64().unwrap(), 9);
        r.finish().unwrap();
        let mut r = Reader::new(&w.0[..6]);
        r.u32().unwrap();
        assert!(r.str(16).is_err());
        let mut r = Reader::new(&w.0);
        r.u32().unwrap();
        assert!(r.str(3).is_err());
        let mut w = Writer::default();
        w.u32(u32::MAX);
        assert!(Reader::new(&w.0).str(usize::MAX).is_err());
    }
}
