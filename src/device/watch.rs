//! The watchdog of the CUDA IPC path (`ipc.rs`): one thread per communicator bounds every
//! wait of its stream. It times each call by the ticket word the stream writes when the call
//! ends, checks the communicator's failure and abort, the abort word a failing peer writes, and
//! the liveness of the peer processes a pending call still waits for; on a failure it records
//! the error (failing the communicator), tells the peers through their abort words, and keeps
//! writing "far ahead" values into this rank's barrier flags so the stream drains.

use super::flags::FlagPage;
use super::layout::{flag, ABORT, CAPTURE, DONE, FAULT, P2P, RESOLVED, TICKET};
use super::pinned::reached;
use super::region::alive;
use crate::comm::Communicator;
use crate::error::Error;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// What a pending call waits for from its peers (for the dead-peer check).
pub(super) enum Waits {
    /// A collective: every peer, up to this chunk sequence number.
    Coll(u32),
    /// A send/receive exchange: these peers, up to these values of their last barrier flag.
    Pairs(Vec<(usize, u32)>),
}

/// A call enqueued and not yet seen finished.
pub(super) struct InFlight {
    pub(super) ticket: u32,
    pub(super) since: Instant,
    pub(super) waits: Waits,
}

/// State shared with the watchdog thread.
pub(super) struct Watch {
    pub(super) rank: usize,
    pub(super) n: usize,
    pub(super) mine: Arc<FlagPage>,
    /// Last chunk sequence number enqueued.
    pub(super) issued: AtomicU32,
    /// Highest send/receive pair counter enqueued.
    pub(super) p2p_issued: AtomicU32,
    /// Last direct all-reduce round enqueued (`direct.rs`).
    pub(super) resolved_issued: AtomicU32,
    /// Calls enqueued and not yet seen finished, in ticket order.
    pub(super) pending: Mutex<VecDeque<InFlight>>,
    pub(super) failure: Mutex<Option<Error>>,
    pub(super) stop: AtomicBool,
    pub(super) comm: Weak<Communicator>,
    /// Set by `ncclCommAbort` (outlives the communicator).
    pub(super) aborted: Arc<AtomicBool>,
    /// Every rank's flag page (this rank's included), for the abort word.
    pub(super) pages: Vec<Arc<FlagPage>>,
    pub(super) pids: Vec<(usize, u32)>,
    pub(super) timeout: Duration,
    /// Said with a timeout: the likely cause when every stream of the GPU shares one hardware
    /// queue and ranks of this process may be driven by separate threads (`ipc.rs`).
    pub(super) hint: Option<&'static str>,
}

pub(super) use crate::sync::lock;

impl Watch {
    pub(super) fn failure(&self) -> Option<Error> {
        lock(&self.failure).clone()
    }

    /// Records the first failure and fails the communicator (its host links shut, so peers
    /// notice at once).
    pub(super) fn fail(&self, e: Error) {
        let mut f = lock(&self.failure);
        if f.is_some() {
            return;
        }
        crate::warn!("CUDA IPC: {}", e.message());
        *f = Some(e.clone());
        drop(f);
        // Tell the peers through their flag pages: their streams may be waiting on this rank.
        for (q, p) in self.pages.iter().enumerate() {
            if q != self.rank && p.load(ABORT) == 0 {
                p.store(ABORT, self.rank as u32 + 1);
            }
        }
        if let Some(c) = self.comm.upgrade() {
            c.fail(e);
        }
    }

    /// Writes values far ahead of every pending wait into this rank's barrier flags, and sets
    /// this rank's abort word (an LL kernel's waits give up when it is set: `small.rs`).
    fn release(&self) {
        if self.mine.load(ABORT) == 0 {
            self.mine.store(ABORT, self.rank as u32 + 1);
        }
        let v = self.issued.load(Ordering::Acquire).wrapping_add(1 << 30);
        let w = self.p2p_issued.load(Ordering::Acquire).wrapping_add(1 << 30);
        for q in 0..self.n {
            for phase in 0..2 {
                self.mine.store(flag(phase, q), v);
                self.mine.store(flag(P2P + phase, q), w);
                // A captured call's barrier waits for 1 (and resets it after passing).
                self.mine.store(flag(CAPTURE + phase, q), 1);
            }
        }
        release(self);
    }

    /// One look: failure of the communicator, overdue call, dead peer.
    fn check(&self, last_pid_check: &mut Instant) {
        if self.aborted.load(Ordering::Acquire) {
            self.fail(Error::invalid_usage(format!("rank {}: communicator was aborted", self.rank)));
            return;
        }
        if self.mine.load(FAULT) != 0 {
            self.fail(Error::invalid_usage(format!(
                "rank {}: collective mismatch: the ranks' direct device all-reduces differ in count, type or operator \
                 (found on the device: the fold wrote nothing)",
                self.rank
            )));
            return;
        }
        let from = self.mine.load(ABORT);
        if from != 0 {
            self.fail(Error::remote(format!(
                "rank {}: rank {} failed during a device collective (see its log)",
                self.rank,
                from - 1
            )));
            return;
        }
        if let Some(c) = self.comm.upgrade() {
            if let Some(e) = c.failure() {
                self.fail(e);
                return;
            }
        }
        let mut p = lock(&self.pending);
        let done = self.mine.load(TICKET);
        while p.front().is_some_and(|c| reached(done, c.ticket)) {
            p.pop_front();
        }
        let Some(front) = p.front() else { return };
        if front.since.elapsed() > self.timeout {
            let what = match front.waits {
                Waits::Coll(seq) => format!("device collective (chunk {seq})"),
                Waits::Pairs(_) => "device send/receive".to_string(),
            };
            drop(p);
            self.fail(Error::timeout(format!(
                "rank {}: {what} did not finish within {:?} (OXCCL_TIMEOUT_MS){}",
                self.rank,
                self.timeout,
                self.hint.unwrap_or("")
            )));
            return;
        }
        if last_pid_check.elapsed() > Duration::from_millis(20) {
            *last_pid_check = Instant::now();
            // A peer that exits after finishing its share of the pending call (its own "done"
            // word, or its last send/receive barrier flag here, has reached it) is not a
            // failure: only one that died before counts.
            let behind = |q: usize| match &front.waits {
                Waits::Coll(seq) => !reached(self.pages[q].load(DONE), *seq),
                Waits::Pairs(v) => {
                    v.iter().any(|&(r, last)| r == q && !reached(self.mine.load(flag(P2P + 1, q)), last))
                }
            };
            let dead = self.pids.iter().find(|&&(q, pid)| behind(q) && !alive(pid)).copied();
            drop(p);
            if let Some((q, pid)) = dead {
                self.fail(Error::remote(format!(
                    "rank {}: rank {q} (process {pid}) died during a device collective",
                    self.rank
                )));
            }
        }
    }

    pub(super) fn run(&self) {
        let mut last_pid_check = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            if self.failure().is_none() {
                self.check(&mut last_pid_check);
            }
            if self.failure().is_some() {
                self.release();
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The watchdog's view of [`RESOLVED`]: released far ahead with the barrier flags.
pub(super) fn release(watch: &Watch) {
    let v = watch.resolved_issued.load(Ordering::Acquire).wrapping_add(1 << 30);
    watch.mine.store(RESOLVED, v);
}
