//! In-memory transport: ranks as threads of one process, for testing algorithms at scale.
//!
//! Each ordered pair of ranks shares a bounded byte pipe, so back-pressure behaves like a
//! socket's buffer: a schedule that would deadlock on TCP deadlocks here too (and times out).

use super::Link;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A wake-up signal for one rank: peers bump it whenever they move bytes to or from it.
#[derive(Default)]
pub struct Notifier {
    seq: Mutex<u64>,
    cv: Condvar,
}

impl Notifier {
    /// Signals the owner that something changed.
    pub fn notify(&self) {
        let mut s = crate::sync::lock(&self.seq);
        *s = s.wrapping_add(1);
        self.cv.notify_all();
    }
    /// Waits for a signal or `timeout`, whichever comes first.
    pub fn wait(&self, timeout: Duration) {
        let s = crate::sync::lock(&self.seq);
        let start = *s;
        let _ = self.cv.wait_timeout_while(s, timeout, |v| *v == start);
    }
}

struct PipeState {
    data: VecDeque<u8>,
    closed: bool,
}

struct Pipe {
    state: Mutex<PipeState>,
    capacity: usize,
}

/// One end of an in-memory link between two ranks.
pub struct MemLink {
    tx: Arc<Pipe>,
    rx: Arc<Pipe>,
    me: Arc<Notifier>,
    peer: Arc<Notifier>,
    peer_rank: usize,
}

/// Default bytes a pipe holds before the sender must wait (like a socket buffer).
pub const PIPE_CAPACITY: usize = 256 * 1024;

/// Builds the full mesh of links for `n` ranks: `result[r][p]` is rank r's link to p
/// (`None` for p == r), plus each rank's notifier.
pub fn mesh(n: usize, capacity: usize) -> (Vec<Vec<Option<MemLink>>>, Vec<Arc<Notifier>>) {
    let notifiers: Vec<Arc<Notifier>> = (0..n).map(|_| Arc::new(Notifier::default())).collect();
    let pipe = || Arc::new(Pipe { state: Mutex::new(PipeState { data: VecDeque::new(), closed: false }), capacity });
    let pipes: Vec<Vec<Arc<Pipe>>> = (0..n).map(|_| (0..n).map(|_| pipe()).collect()).collect();
    let links = (0..n)
        .map(|r| {
            (0..n)
                .map(|p| {
                    (p != r).then(|| MemLink {
                        tx: pipes[r][p].clone(),
                        rx: pipes[p][r].clone(),
                        me: notifiers[r].clone(),
                        peer: notifiers[p].clone(),
                        peer_rank: p,
                    })
                })
                .collect()
        })
        .collect();
    (links, notifiers)
}

impl Link for MemLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        let mut st = crate::sync::lock(&self.tx.state);
        if st.closed {
            return Err(Error::remote(format!("in-memory link to rank {} was shut down", self.peer_rank)));
        }
        let n = buf.len().min(self.tx.capacity.saturating_sub(st.data.len()));
        st.data.extend(&buf[..n]);
        drop(st);
        if n > 0 {
            self.peer.notify();
        }
        Ok(n)
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut st = crate::sync::lock(&self.rx.state);
        let n = buf.len().min(st.data.len());
        if n == 0 && st.closed {
            return Err(Error::remote(format!("in-memory link from rank {} was shut down", self.peer_rank)));
        }
        let (a, b) = st.data.as_slices();
        let na = n.min(a.len());
        buf[..na].copy_from_slice(&a[..na]);
        buf[na..n].copy_from_slice(&b[..n - na]);
        st.data.drain(..n);
        drop(st);
        if n > 0 {
            self.peer.notify();
        }
        Ok(n)
    }

    fn poll_fd(&self) -> Option<RawFd> {
        None
    }

    fn describe(&self) -> String {
        format!("in-memory link to rank {}", self.peer_rank)
    }

    fn shutdown(&self) {
        for p in [&self.tx, &self.rx] {
            crate::sync::lock(&p.state).closed = true;
        }
        self.peer.notify();
        self.me.notify();
    }
}
