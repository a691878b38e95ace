//! TCP transport: one nonblocking socket per peer, driven by the engine with poll(2).

use super::Link;
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// Largest vectored transfer gathered through a stack buffer instead of readv/writev.
const SMALL: usize = 4096;

/// A data connection to one peer.
pub struct TcpLink {
    stream: TcpStream,
    peer_rank: usize,
    peer_addr: String,
    /// Gathers small vectored transfers (allocated once: zeroing a stack buffer on every
    /// attempt of a spinning receive costs more than the copy).
    small: Vec<u8>,
}

impl TcpLink {
    /// Wraps a connected, handshaken stream: sets it nonblocking with NODELAY and big buffers.
    pub fn new(stream: TcpStream, peer_rank: usize) -> Result<TcpLink> {
        tune(&stream)?;
        stream.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        let peer_addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        Ok(TcpLink { stream, peer_rank, peer_addr, small: vec![0; SMALL] })
    }

    /// A second handle on the same socket (for aborting from another thread).
    pub fn try_clone_stream(&self) -> Option<TcpStream> {
        self.stream.try_clone().ok()
    }

    fn remote(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::remote(format!("peer rank {} ({}) {what}: {e}", self.peer_rank, self.peer_addr))
    }
}

/// Socket buffer size to request (`OXCCL_SOCKET_BUF`, default 4 MiB; 0 leaves the kernel's
/// autotuning in charge). 4 MiB measured slightly faster on loopback (docs/PERFORMANCE.md).
fn socket_buffer() -> usize {
    static B: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *B.get_or_init(|| crate::config::env_u64("SOCKET_BUF").unwrap_or(4 << 20) as usize)
}

/// Sets TCP_NODELAY, and the socket buffer size when one is configured (best effort).
pub fn tune(stream: &TcpStream) -> Result<()> {
    stream.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
    let size = socket_buffer();
    if size > 0 {
        let s = socket2::SockRef::from(stream);
        let _ = s.set_send_buffer_size(size);
        let _ = s.set_recv_buffer_size(size);
    }
    Ok(())
}

impl TcpLink {
    /// Runs one nonblocking write of `len` bytes (`write`), mapping its outcome.
    fn write_with(&mut self, len: usize, write: impl Fn(&mut TcpStream) -> std::io::Result<usize>) -> Result<usize> {
        loop {
            return match write(&mut self.stream) {
                Ok(0) if len > 0 => Err(self.remote("closed the connection", "write returned 0")),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => Err(self.remote("connection failed while sending", e)),
            };
        }
    }
}

impl Link for TcpLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        self.write_with(buf.len(), |s| s.write(buf))
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total <= SMALL {
            // Small pieces (a signature and a small message) are gathered on the stack and
            // sent with send(2), which costs less in the kernel than writev(2).
            let mut tmp = std::mem::take(&mut self.small);
            let mut off = 0;
            for b in bufs {
                tmp[off..off + b.len()].copy_from_slice(b);
                off += b.len();
            }
            let r = self.try_send(&tmp[..total]);
            self.small = tmp;
            return r;
        }
        let slices: Vec<std::io::IoSlice<'_>> = bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
        self.write_with(bufs.iter().map(|b| b.len()).sum(), |s| s.write_vectored(&slices))
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            return match self.stream.read(buf) {
                Ok(0) => Err(self.remote("closed the connection", "end of stream")),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => Err(self.remote("connection failed while receiving", e)),
            };
        }
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        if a.is_empty() && b.is_empty() {
            return Ok(0);
        }
        if a.len() + b.len() <= SMALL {
            // recv(2) into the stack and a copy costs less than readv(2), and this is what
            // the engine calls over and over while it waits for a small message.
            let mut tmp = std::mem::take(&mut self.small);
            let r = self.try_recv(&mut tmp[..a.len() + b.len()]);
            if let Ok(n) = r {
                let k = n.min(a.len());
                a[..k].copy_from_slice(&tmp[..k]);
                b[..n - k].copy_from_slice(&tmp[k..n]);
            }
            self.small = tmp;
            return r;
        }
        let mut bufs = [std::io::IoSliceMut::new(a), std::io::IoSliceMut::new(b)];
        loop {
            return match self.stream.read_vectored(&mut bufs) {
                Ok(0) => Err(self.remote("closed the connection", "end of stream")),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => Err(self.remote("connection failed while receiving", e)),
            };
        }
    }

    fn peek_abort(&mut self) -> Option<(crate::error::ErrorKind, String)> {
        // A frame sits at the end of what the peer wrote before it closed the link; look at up
        // to 64 KiB (the rest of the peer's last operation, if any, and the frame).
        let mut buf = vec![0u8; 64 << 10];
        let n = self.stream.peek(&mut buf).ok()?;
        crate::abort::parse_tail(&buf[..n])
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.stream.as_raw_fd())
    }

    fn describe(&self) -> String {
        format!("rank {} ({})", self.peer_rank, self.peer_addr)
    }

    fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Connects to `addr`, retrying refused connections until `deadline` (the peer may not be
/// listening yet).
pub fn connect_retry(addr: SocketAddr, deadline: Instant) -> Result<TcpStream> {
    let mut delay = Duration::from_millis(1);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(format!("could not connect to {addr} before the deadline")));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e)
                if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::Interrupted) =>
            {
                std::thread::sleep(delay.min(left));
                delay = (delay * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(Error::system(format!("connect to {addr}: {e}"))),
        }
    }
}

/// Accepts one connection on a nonblocking `listener`, waiting until `deadline`; `abort`
/// is checked between waits.
pub fn accept_until(listener: &TcpListener, deadline: Instant, abort: &dyn Fn() -> bool) -> Result<TcpStream> {
    listener.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| Error::from_io("set_nonblocking", e))?;
                s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if abort() {
                    return Err(Error::invalid_usage("communicator was aborted while waiting for connections"));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::timeout(format!(
                        "no connection arrived on {} before the deadline",
                        listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                    )));
                }
                let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd on the stack, length 1.
                unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(100) as i32) };
            }
            Err(e) => return Err(Error::system(format!("accept: {e}"))),
        }
    }
}
