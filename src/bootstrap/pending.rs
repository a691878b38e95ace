//! Connections in handshake on one listener, shared by the bootstrap root ([`super::root`]) and
//! the data listener ([`super::accept`]): every handshake runs at once on the caller's thread,
//! without blocking, so strangers cost no thread and a bounded number of descriptors.
//!
//! Each accepted connection gets its challenge (a fresh nonce, one frame) at once and then has
//! until its limit to send one frame back. At most [`handshake_cap`] connections are in
//! handshake: when the pool is full, the oldest one is dropped to make room once it has had
//! [`MIN_AGE`] to answer (a real peer answers within a round trip); younger ones are left in
//! the kernel's backlog meanwhile. When `accept` fails for want of descriptors (`EMFILE`,
//! `ENFILE`), the oldest connection in handshake is dropped and accepting pauses for
//! [`BACKOFF`] instead of failing.

use super::auth::{self, NONCE_LEN};
use crate::error::{Error, Result};
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long a full pool leaves its oldest connection before dropping it for a new one.
pub const MIN_AGE: Duration = Duration::from_millis(250);
/// How long accepting pauses after the process ran out of descriptors.
pub const BACKOFF: Duration = Duration::from_millis(50);

/// Most handshakes at once for a process whose descriptor limit (`RLIMIT_NOFILE`, soft) is
/// `limit`: a quarter of it, at most `max`, at least 4, so strangers can never take the
/// descriptors the process needs for its own links.
pub fn cap_for(limit: u64, max: usize) -> usize {
    ((limit / 4).min(max as u64) as usize).max(4)
}

/// [`cap_for`] this process's descriptor limit.
pub fn handshake_cap(max: usize) -> usize {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid rlimit for getrlimit to fill.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 { r.rlim_cur } else { 1024 };
    cap_for(limit, max)
}

/// One connection in handshake.
pub struct Challenged {
    /// The connection (non-blocking).
    pub s: TcpStream,
    /// Who connected.
    pub peer: Option<SocketAddr>,
    /// The challenge it was sent.
    pub nonce: [u8; NONCE_LEN],
    got: Vec<u8>,
    max: usize,
    born: Instant,
    until: Instant,
}

impl Challenged {
    /// Reads what arrived: the answer's frame body once complete, `None` while incomplete.
    pub fn step(&mut self) -> Result<Option<Vec<u8>>> {
        let mut buf = [0u8; 4096];
        loop {
            let want = if self.got.len() < 4 {
                4 - self.got.len()
            } else {
                let len = u32::from_be_bytes(self.got[..4].try_into().expect("4 bytes")) as usize;
                if len > self.max {
                    return Err(Error::remote(format!("sent a frame of {len} bytes (limit {})", self.max)));
                }
                4 + len - self.got.len()
            };
            if want == 0 {
                return Ok(Some(self.got.split_off(4)));
            }
            match (&self.s).read(&mut buf[..want.min(4096)]) {
                Ok(0) => return Err(Error::remote("closed the connection during the handshake")),
                Ok(n) => self.got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::remote(format!("handshake failed: {e}"))),
            }
        }
    }

    /// Whether its time to answer is over.
    pub fn expired(&self, now: Instant) -> bool {
        now >= self.until
    }

    /// Who connected, as text.
    pub fn who(&self) -> String {
        self.peer.map_or("?".into(), |p| p.to_string())
    }
}

/// The connections in handshake on one listener.
pub struct Pool {
    /// The connections, in no particular order.
    pub hs: Vec<Challenged>,
    cap: usize,
    limit: Duration,
    max: usize,
    paused_until: Option<Instant>,
    full: bool,
}

impl Pool {
    /// A pool of at most `cap` handshakes, each given `limit` to send an answer of at most
    /// `max` bytes.
    pub fn new(cap: usize, limit: Duration, max: usize) -> Pool {
        Pool { hs: Vec::new(), cap, limit, max, paused_until: None, full: false }
    }

    fn oldest(&self) -> Option<usize> {
        (0..self.hs.len()).min_by_key(|&i| self.hs[i].born)
    }

    /// Accepts what waits on `listener` (non-blocking), sending each its challenge; connections
    /// dropped to make room go to `dropped` with the reason.
    pub fn accept(&mut self, listener: &TcpListener, dropped: &mut dyn FnMut(Challenged, &str)) -> Result<()> {
        self.accept_all(&[listener], dropped)
    }

    /// [`Pool::accept`] on each of `listeners` (one rank's data listeners on its rails).
    pub fn accept_all(&mut self, listeners: &[&TcpListener], dropped: &mut dyn FnMut(Challenged, &str)) -> Result<()> {
        for l in listeners {
            self.accept_one(l, dropped)?;
        }
        Ok(())
    }

    fn accept_one(&mut self, listener: &TcpListener, dropped: &mut dyn FnMut(Challenged, &str)) -> Result<()> {
        let now = Instant::now();
        if self.paused_until.is_some_and(|t| now < t) {
            return Ok(());
        }
        self.paused_until = None;
        self.full = false;
        loop {
            if self.hs.len() >= self.cap {
                let i = self.oldest().expect("a full pool is not empty");
                if now.duration_since(self.hs[i].born) < MIN_AGE {
                    self.full = true;
                    return Ok(());
                }
                dropped(self.hs.swap_remove(i), "too many connections in handshake");
            }
            match listener.accept() {
                Ok((s, peer)) => {
                    let nonce = auth::nonce()?;
                    let mut frame = (NONCE_LEN as u32).to_be_bytes().to_vec();
                    frame.extend_from_slice(&nonce);
                    let ok = s.set_nonblocking(true).is_ok()
                        && crate::net::nosig::send(&s, &frame).is_ok_and(|n| n == frame.len());
                    let p = Challenged {
                        s,
                        peer: Some(peer),
                        nonce,
                        got: Vec::new(),
                        max: self.max,
                        born: now,
                        until: now + self.limit,
                    };
                    if ok {
                        self.hs.push(p);
                    } else {
                        dropped(p, "could not send the challenge");
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of descriptors: free one and let the backlog wait rather than fail.
                    match self.oldest() {
                        Some(i) => dropped(self.hs.swap_remove(i), &format!("out of descriptors to accept ({e})")),
                        None => crate::warn!("accept: {e}; pausing {} ms", BACKOFF.as_millis()),
                    }
                    self.paused_until = Some(now + BACKOFF);
                    return Ok(());
                }
                Err(e) => return Err(Error::system(format!("accept: {e}"))),
            }
        }
    }

    /// Sleeps until the listener or a connection in handshake has something, a handshake
    /// expires, or `most` passes.
    pub fn wait(&self, listener: &TcpListener, most: Duration) {
        self.wait_all(&[listener], most)
    }

    /// [`Pool::wait`] on each of `listeners`.
    pub fn wait_all(&self, listeners: &[&TcpListener], most: Duration) {
        let mut pfds: Vec<libc::pollfd> = Vec::with_capacity(self.hs.len() + listeners.len());
        let mut most = most;
        if self.paused_until.is_none() && !self.full {
            pfds.extend(listeners.iter().map(|l| libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        } else {
            // Look again when the pause ends or the oldest may be dropped.
            most = most.min(BACKOFF);
        }
        pfds.extend(self.hs.iter().map(|h| libc::pollfd { fd: h.s.as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        let now = Instant::now();
        if let Some(next) = self.hs.iter().map(|h| h.until).min() {
            most = most.min(next.saturating_duration_since(now));
        }
        // SAFETY: `pfds` is a valid array of pollfd of the given length for the call.
        unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, most.as_millis().max(1) as i32) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_stays_below_the_descriptor_limit() {
        assert_eq!(cap_for(64, 1024), 16);
        assert_eq!(cap_for(1024, 1024), 256);
        assert_eq!(cap_for(1 << 20, 1024), 1024);
        assert_eq!(cap_for(1 << 20, 48), 48);
        assert_eq!(cap_for(8, 48), 4);
    }
}
