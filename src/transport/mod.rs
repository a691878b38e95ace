//! Transports: byte pipes between this rank and each peer.
//!
//! A [`Link`] is one full-duplex, ordered, reliable byte stream to one peer, used
//! without blocking: the engine calls [`Link::try_send`] / [`Link::try_recv`] and, when
//! nothing moves, waits through [`Links::wait`] (poll(2) on sockets, a condition variable for
//! in-memory links). Messages carry no framing: both ends know every size from the plan.

pub mod cma;
pub mod copy;
pub mod mem;
pub mod ofi;
pub mod rails;
pub use crate::net::nosig;
pub mod ring;
pub mod sealed;
pub mod select;
pub mod shm;
pub mod table;
pub mod tcp;
pub mod tcp_threads;

use crate::error::Result;
use std::os::fd::RawFd;
use std::time::Duration;

/// Copies `bufs` one after another to the start of `out`, which must hold them all (links use
/// it to send a few small pieces with one call); returns the bytes copied.
pub(crate) fn gather(bufs: &[&[u8]], out: &mut [u8]) -> usize {
    let mut off = 0;
    for b in bufs {
        out[off..off + b.len()].copy_from_slice(b);
        off += b.len();
    }
    off
}

/// One ordered byte stream to a peer, driven without blocking.
pub trait Link: Send {
    /// Writes as much of `buf` as fits without blocking; returns the bytes taken (0: try later).
    fn try_send(&mut self, buf: &[u8]) -> Result<usize>;
    /// Writes from `bufs` in order as far as fits without blocking, in one system call where
    /// the transport can (so small pieces leave in one segment); returns the bytes taken.
    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(b) => self.try_send(b),
            None => Ok(0),
        }
    }
    /// Reads up to `buf.len()` bytes without blocking; returns the bytes read (0: none yet).
    /// A closed or failed peer is an error, never `Ok(0)`.
    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize>;
    /// Reads into `a`, then on into `b`, without blocking, in one system call where the
    /// transport can (so a small signature and the data behind it cost one read); returns the
    /// bytes read. Default: fills `a` only.
    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        if a.is_empty() {
            self.try_recv(b)
        } else {
            self.try_recv(a)
        }
    }
    /// A file descriptor that poll(2) can wait on, for links backed by one.
    fn poll_fd(&self) -> Option<RawFd>;
    /// The poll(2) events to wait for on [`Link::poll_fd`] for `interest` (default: `POLLIN`
    /// to read, `POLLOUT` to write; links that signal through a side channel override it).
    fn poll_events(&self, interest: Interest) -> i16 {
        (if interest.read { libc::POLLIN } else { 0 }) | (if interest.write { libc::POLLOUT } else { 0 })
    }
    /// Adds the descriptors (with events) that poll(2) must watch for `interest` on this link
    /// to `out`; returns false for a link without descriptors. Default: [`Link::poll_fd`] with
    /// [`Link::poll_events`]; a link over several sockets names the one each direction waits on.
    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        match self.poll_fd() {
            Some(fd) => {
                out.push(libc::pollfd { fd, events: self.poll_events(interest), revents: 0 });
                true
            }
            None => false,
        }
    }
    /// Called before the engine sleeps waiting for `interest` on this link: a link whose peer
    /// must be told to wake it up (shared memory) says so here. `Ok(false)` means progress is
    /// already possible and the engine should not sleep. Default: `Ok(true)`.
    fn arm(&mut self, interest: Interest) -> Result<bool> {
        let _ = interest;
        Ok(true)
    }
    /// Whether [`Link::recv_in_place`] works on this link.
    fn supports_in_place(&self) -> bool {
        false
    }
    /// Zero-copy receive: calls `f` with up to `max` readable bytes, in place, as two slices
    /// in stream order (the second is empty unless the bytes wrap around a ring's end), only
    /// if there are any, and consumes the bytes `f` returns it used. Returns the bytes
    /// consumed, or `None` when the link does not support it (the default).
    fn recv_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<Option<usize>> {
        let _ = (max, f);
        Ok(None)
    }
    /// Room to write the next bytes of the send stream in place (a forwarded reduction,
    /// `engine::fuse`): the start and length of the free bytes at the write position, up to
    /// the end of the link's memory, or `None` when the link cannot take bytes this way now
    /// (the default; a shared-memory link busy with a single-copy send). The bytes are not
    /// sent until [`Link::forward_publish`]; nothing else may be sent on the link in between.
    fn forward_space(&mut self) -> Option<(*mut u8, usize)> {
        None
    }
    /// Sends the first `n` bytes written at the last [`Link::forward_space`]; `more`: the
    /// message they belong to continues (its rest must follow in the same memory).
    fn forward_publish(&mut self, n: usize, more: bool) {
        let _ = (n, more);
    }
    /// Text naming the other end (address), for error messages.
    fn describe(&self) -> String;

    /// This link as a shared-memory link (for its small-message lane), when it is one.
    fn shm(&mut self) -> Option<&mut shm::ShmLink> {
        None
    }
    /// Makes both ends fail promptly (used by abort and on errors).
    fn shutdown(&self);
}

/// What the engine waits for on one link.
#[derive(Clone, Copy, Debug, Default)]
pub struct Interest {
    /// Wake when the link has bytes to read.
    pub read: bool,
    /// Wake when the link can take more bytes.
    pub write: bool,
}

/// Waits until one of the links may make progress, or `timeout` passes.
///
/// Links with file descriptors are polled; links without one are served by `notifier`
/// (their peers signal it on every transfer).
pub struct Links;

impl Links {
    /// Blocks until progress may be possible on one of `links` (those with an interest), or timeout.
    pub fn wait(links: &[(&dyn Link, Interest)], notifier: Option<&mem::Notifier>, timeout: Duration) -> Result<()> {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(links.len());
        let mut fdless = false;
        for (l, i) in links {
            if !i.read && !i.write {
                continue;
            }
            if !l.poll_set(*i, &mut fds) {
                fdless = true;
            }
        }
        if fdless {
            // In-memory links: wait on the notifier; sockets, if any, are polled with a short slice.
            let slice = if fds.is_empty() { timeout } else { timeout.min(Duration::from_micros(200)) };
            if let Some(n) = notifier {
                n.wait(slice);
            } else {
                std::thread::sleep(slice.min(Duration::from_micros(50)));
            }
            if fds.is_empty() {
                return Ok(());
            }
            return poll_fds(&mut fds, Duration::ZERO);
        }
        if fds.is_empty() {
            return Ok(());
        }
        poll_fds(&mut fds, timeout)
    }
}

fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> Result<()> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the given length.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(crate::error::Error::from_io("poll", e));
        }
    }
    Ok(())
}
