//! The CUDA IPC mesh of one communicator: this rank's region and the peers' mapped regions
//! and flag pages (`region.rs`), the barriers on the flags, the sequence numbers and tickets
//! that count the calls, and the watchdog that bounds every wait (`watch.rs`). Every IPC flow
//! runs on it: the all-reduce's (`ipc.rs`, which dispatches them), the window executor
//! (`window.rs`), the direct flow between processes (`direct.rs`), the one-shot collectives
//! (`oneshot.rs`) and the exchange (`p2p.rs`). It names none of them.

use super::check;
use super::layout::{flag, CAPTURE, CLOSING, DONE, FAULT, P2P, SMALL, TICKET};
use super::pinned::reached;
use super::region::{alive, PeerRegion, Region};
use super::watch::{lock, InFlight, Waits, Watch};
use crate::algo::select::IpcPlacement;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One communicator's CUDA IPC mesh (module doc).
pub(crate) struct Mesh {
    rank: usize,
    peers: Vec<PeerRegion>,
    region: Option<Region>,
    seq: u32,
    /// Send/receive barrier counter per peer (`p2p.rs`): each pair of ranks counts alike.
    pseq: Vec<u32>,
    /// Calls enqueued (the value of the ticket word once the stream has run them all).
    ticket: u32,
    /// The communicator's internal stream (owned by `state`; every call of this mode runs on it).
    stream: sys::CUstream,
    pub(super) watch: Arc<Watch>,
    watchdog: Option<JoinHandle<()>>,
    /// No two ranks share a process (the direct flow's host meeting cannot deadlock a thread
    /// that drives several ranks): the same answer on every rank, from the cards.
    separate: bool,
    /// Every rank is in this process (the direct flow publishes the buffers on the device, in
    /// the boards, instead of meeting on the host): the same answer on every rank.
    local: bool,
    /// Whether the log said that the direct flow ran.
    told: bool,
}

// SAFETY: device addresses and a stream handle, usable from any thread with the context
// current; the state is used under the communicator's device lock.
unsafe impl Send for Mesh {}

impl Mesh {
    /// The mesh of `rank` over its `region` and the mapped `peers` (by rank), its calls on
    /// `stream`, watched by `watch` (whose thread is `watchdog`); `separate` and `local`: where
    /// the ranks live ([`IpcPlacement`]).
    pub(super) fn new(
        rank: usize,
        peers: Vec<PeerRegion>,
        region: Region,
        stream: sys::CUstream,
        (watch, watchdog): (Arc<Watch>, JoinHandle<()>),
        IpcPlacement { separate, local }: IpcPlacement,
    ) -> Mesh {
        let n = peers.len();
        Mesh {
            rank,
            peers,
            region: Some(region),
            seq: 0,
            pseq: vec![0; n],
            ticket: 0,
            stream,
            watch,
            watchdog: Some(watchdog),
            separate,
            local,
            told: false,
        }
    }

    /// Bytes of each area of the regions (input, result).
    pub(super) fn half(&self) -> usize {
        self.region.as_ref().map_or(0, |r| r.half)
    }

    pub(super) fn input(&self, q: usize) -> u64 {
        self.peers[q].base
    }

    pub(super) fn result(&self, q: usize) -> u64 {
        self.input(q) + self.half() as u64
    }

    /// Device address of small slot `parity` (0 or 1) in rank `q`'s region (after its two areas).
    pub(super) fn small(&self, q: usize, parity: u32) -> u64 {
        self.input(q) + 2 * self.half() as u64 + u64::from(parity & 1) * SMALL as u64
    }

    /// Device address of rank `q`'s small slot for captured calls (after the two others).
    pub(super) fn capture_slot(&self, q: usize) -> u64 {
        self.input(q) + 2 * self.half() as u64 + 2 * SMALL as u64
    }

    /// Device address of rank `q`'s board (after the captured small slot): the four words a
    /// direct all-reduce between ranks of one process publishes (`window.rs`).
    pub(super) fn board(&self, q: usize) -> u64 {
        self.input(q) + 2 * self.half() as u64 + 3 * SMALL as u64
    }

    /// Device address of this rank's fault word (set by a fold kernel that refused its boards).
    pub(super) fn fault_word(&self) -> u64 {
        self.watch.mine.dev(FAULT)
    }

    /// The barrier sequence number the next call's first barrier takes.
    pub(super) fn peek_seq(&self) -> u32 {
        self.seq.wrapping_add(1)
    }

    /// Orders `stream` after every call enqueued so far on any stream: one wait on the ticket
    /// word, unless the host already sees the last call finished.
    pub(super) fn order_after_calls(&self, stream: sys::CUstream) -> Result<()> {
        if self.ticket == 0 || reached(self.watch.mine.load(TICKET), self.ticket) {
            return Ok(());
        }
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        let at = self.watch.mine.dev(TICKET);
        // SAFETY: the ticket word of this rank's registered flag page.
        check(unsafe { sys::cuStreamWaitValue32_v2(stream, at, self.ticket, geq) }, "cuStreamWaitValue32(ticket)")
    }

    /// The ticket the call being enqueued will get.
    pub(super) fn call_ticket(&self) -> u32 {
        self.ticket.wrapping_add(1)
    }

    /// The ticket of the last call the streams finished.
    pub(super) fn ticket_done(&self) -> u32 {
        self.watch.mine.load(TICKET)
    }

    /// The communicator's `OXCCL_TIMEOUT_MS` (its config's), which bounds every wait here.
    pub(super) fn timeout(&self) -> Duration {
        self.watch.timeout
    }

    /// Where the ranks live, for the choice of an all-reduce's flow
    /// ([`crate::algo::select::ipc_all_reduce`]).
    pub(crate) fn placement(&self) -> IpcPlacement {
        IpcPlacement { separate: self.separate, local: self.local }
    }

    /// The communicator (alive while a call runs on it).
    pub(super) fn comm(&self) -> Result<Arc<Communicator>> {
        self.watch.comm.upgrade().ok_or_else(|| Error::internal("the communicator of a CUDA IPC call is gone"))
    }

    /// The error that stopped this communicator's device path, if any.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.watch.failure()
    }

    /// Barrier `phase` for chunk `s`, on `stream`.
    pub(super) fn barrier(&self, phase: usize, s: u32, stream: sys::CUstream) -> Result<()> {
        let with: Vec<(usize, u32)> = (0..self.peers.len()).filter(|&q| q != self.rank).map(|q| (q, s)).collect();
        self.signal_and_wait(phase, &with, false, stream)
    }

    /// The one barrier loop of every barrier kind, on `stream`, with flag words `phase` and
    /// the peers `with` (peer, value): writes each value into my flag in the peer's page, then
    /// waits for each peer's flag in mine to reach it (`GEQ`; with `reset`, to equal it, and
    /// then writes 0 back: the captured calls' flags, whose values replays repeat).
    fn signal_and_wait(&self, phase: usize, with: &[(usize, u32)], reset: bool, stream: sys::CUstream) -> Result<()> {
        let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        let cond = if reset {
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32
        } else {
            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32
        };
        for &(q, v) in with {
            let at = self.peers[q].flags.dev(flag(phase, self.rank));
            // SAFETY: `at` is a flag word of peer q's registered flag page.
            check(unsafe { sys::cuStreamWriteValue32_v2(stream, at, v, write) }, "cuStreamWriteValue32(peer flag)")?;
        }
        super::lockstep::arrive();
        for &(q, v) in with {
            let at = self.watch.mine.dev(flag(phase, q));
            // SAFETY: `at` is a flag word of this rank's registered flag page.
            check(unsafe { sys::cuStreamWaitValue32_v2(stream, at, v, cond) }, "cuStreamWaitValue32(own flag)")?;
        }
        for &(q, _) in with.iter().filter(|_| reset) {
            let at = self.watch.mine.dev(flag(phase, q));
            // SAFETY: as above. The peer writes this word again only after my next barrier's
            // write (phases alternate), which this stream issues after this reset.
            check(unsafe { sys::cuStreamWriteValue32_v2(stream, at, 0, write) }, "cuStreamWriteValue32(own flag)")?;
        }
        Ok(())
    }

    /// A barrier of a captured call, phase `phase` (0 or 1), on `stream`: set my flag in every
    /// peer's page, wait until each peer's flag in mine is set, reset those.
    pub(super) fn capture_barrier(&self, phase: usize, stream: sys::CUstream) -> Result<()> {
        let with: Vec<(usize, u32)> = (0..self.peers.len()).filter(|&q| q != self.rank).map(|q| (q, 1)).collect();
        self.signal_and_wait(CAPTURE + phase, &with, true, stream)
    }

    /// The next chunk sequence number (every rank numbers its chunks alike).
    pub(super) fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.watch.issued.store(self.seq, Ordering::Release);
        self.seq
    }

    /// Ends a call: the stream writes its last chunk number into the done word (with the
    /// ticket), and the watchdog starts timing it.
    pub(super) fn finish_call(&mut self, stream: sys::CUstream) -> Result<()> {
        self.finish_ticket(stream, Waits::Coll(self.seq))
    }

    /// Ends a send/receive exchange with the peers `pairs` (peer, its last barrier-1 value).
    pub(super) fn finish_pairs(&mut self, stream: sys::CUstream, pairs: Vec<(usize, u32)>) -> Result<()> {
        self.finish_ticket(stream, Waits::Pairs(pairs))
    }

    /// The stream writes the call's ticket into the ticket word, and the last chunk number
    /// enqueued into the done word (every chunk before it ran earlier on this rank's streams),
    /// in one 64-bit write; the watchdog times the call.
    fn finish_ticket(&mut self, stream: sys::CUstream, waits: Waits) -> Result<()> {
        self.ticket = self.ticket.wrapping_add(1);
        let both = u64::from(self.seq) | (u64::from(self.ticket) << 32);
        const _: () = assert!(DONE % 2 == 0 && TICKET == DONE + 1, "done and ticket share one aligned 64-bit word");
        // SAFETY: the done and ticket words of this rank's registered flag page (8-byte aligned,
        // little-endian: done in the low half).
        unsafe { super::write_value64(stream, self.watch.mine.dev(DONE), both, "done, ticket")? };
        lock(&self.watch.pending).push_back(InFlight { ticket: self.ticket, since: Instant::now(), waits });
        Ok(())
    }

    /// The next send/receive barrier value with `peer` (both ranks of a pair count alike).
    pub(super) fn next_pair(&mut self, peer: usize) -> u32 {
        self.pseq[peer] = self.pseq[peer].wrapping_add(1);
        self.watch.p2p_issued.fetch_max(self.pseq[peer], Ordering::AcqRel);
        self.pseq[peer]
    }

    /// Send/receive barrier `phase` (0 or 1) with the peers `with` (peer, value), on `stream`:
    /// writes each value into the peer's flag, then waits for each peer's.
    pub(super) fn pair_barrier(&self, phase: usize, with: &[(usize, u32)], stream: sys::CUstream) -> Result<()> {
        self.signal_and_wait(P2P + phase, with, false, stream)
    }

    /// This rank.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the communicator.
    pub(super) fn size(&self) -> usize {
        self.peers.len()
    }

    /// The internal stream.
    pub(super) fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Bytes of each window area of the regions, by id (`algo::window`).
    pub(super) fn areas(&self) -> Vec<usize> {
        vec![self.half(), self.half(), SMALL, SMALL, SMALL]
    }

    /// Waits (bounded) until the internal stream has run everything enqueued so far, and every
    /// call enqueued on a user's stream has run (the ticket word reached the last ticket).
    pub(super) fn drain(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        loop {
            // SAFETY: the live internal stream of this communicator.
            let idle = unsafe { sys::cuStreamQuery(self.stream) } != sys::CUresult::CUDA_ERROR_NOT_READY;
            if idle && reached(self.watch.mine.load(TICKET), self.ticket) {
                return true;
            }
            if start.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The closing barrier: tell every peer this rank no longer maps its memory, and wait
    /// (bounded) until every live peer has said the same.
    pub(super) fn closing_barrier(&self, timeout: Duration) -> bool {
        let n = self.peers.len();
        for q in (0..n).filter(|&q| q != self.rank) {
            self.peers[q].flags.store(flag(CLOSING, self.rank), 1);
        }
        let start = Instant::now();
        loop {
            let waiting = (0..n)
                .filter(|&q| q != self.rank)
                .any(|q| self.watch.mine.load(flag(CLOSING, q)) == 0 && self.peers[q].pid.is_none_or(alive));
            if !waiting {
                return true;
            }
            if start.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Bytes of the LL area of this rank's region (`small.rs`).
    pub(super) fn ll_area(&self) -> usize {
        self.region.as_ref().map_or(0, |r| r.ll)
    }

    /// Says once in the log that the direct flow runs, and how the buffers travel.
    pub(super) fn tell_direct(&mut self, how: &str) {
        if !self.told {
            self.told = true;
            crate::info!(
                "rank {}: device all_reduce: direct flow from {} bytes (every rank folds its segment of the peers' buffers where they lie; {how})",
                self.rank(),
                crate::algo::select::IPC_DIRECT_MIN
            );
        }
    }

    /// Waits (bounded) until the stream finished the call with ticket `t`.
    pub(super) fn wait_ticket(&self, t: u32, what: &str) -> Result<()> {
        let start = Instant::now();
        let timeout = self.timeout();
        while !reached(self.ticket_done(), t) {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if start.elapsed() > timeout {
                return Err(Error::timeout(format!(
                    "rank {}: waiting {} ms for the GPU to finish call {t} to reuse {what}",
                    self.rank(),
                    timeout.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Whether a call ever ran on the mesh (then teardown runs the closing barrier).
    pub(super) fn used(&self) -> bool {
        self.seq != 0 || self.ticket != 0
    }

    /// Stops the watchdog and waits for its thread.
    pub(super) fn stop_watchdog(&mut self) {
        self.watch.stop.store(true, Ordering::Release);
        if let Some(t) = self.watchdog.take() {
            let _ = t.join();
        }
    }

    /// Leaks this rank's region and the peers' mappings (work may still use them).
    pub(super) fn leak(&mut self) {
        std::mem::forget(self.region.take());
        std::mem::forget(std::mem::take(&mut self.peers));
    }

    /// Leaks this rank's region only (peers may still map it).
    pub(super) fn leak_region(&mut self) {
        std::mem::forget(self.region.take());
    }

    /// Closes the peers' mappings (the stream drained).
    pub(super) fn close_peers(&mut self) {
        PeerRegion::close_all(&mut self.peers);
    }
}
