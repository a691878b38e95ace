//! The CUDA IPC path: all-reduce between the ranks of one node (several may share one GPU),
//! entirely on the GPU and ordered on the user's stream.
//!
//! At set-up every rank allocates one device region,
//! `[input H | result H | small 0 | small 1 | captured small | board]` (the small slots [`SMALL`]
//! bytes each, the board `layout::BOARD`), and exports it with `cuIpcGetMemHandle`; the handles
//! travel through the communicator's host all-reduce, and each rank maps every peer's region
//! once (`cuIpcOpenMemHandle`; a peer in the same process is addressed directly).
//!
//! An all-reduce runs one of three window plans of `algo::window` (validated and simulated
//! there), through the window executor (`window.rs`):
//!
//! - at most [`SMALL`] bytes, `all_reduce_small`, as sequence number `s`: copy `send` into my
//!   small slot `s mod 2`; barrier 0; fold every rank's slot `s mod 2`, in rank order, into
//!   `recv`. No closing barrier (the plan's doc says why). With 2 ranks that is 5 stream
//!   operations (copy, flag write, flag wait, kernel, the closing 64-bit write of the done and
//!   ticket words);
//! - from [`crate::algo::select::IPC_DIRECT_MIN`] bytes, `all_reduce_direct`: barrier 0; one
//!   fold kernel per rank reads its segment of every rank's send buffer and writes it into
//!   every rank's receive buffer, where they lie; barrier 1 (2nS bytes moved in all, no copy).
//!   When no two ranks share a process, each rank publishes its buffers' IPC handles in its
//!   flag page and an opener thread maps the peers' (`direct.rs`: the caller never waits for a
//!   peer); when every rank is in this process, they are published on the device in each
//!   rank's board (`window.rs`);
//! - otherwise `all_reduce_staged`, chunks of at most `H` bytes: copy the chunk into my input
//!   area; barrier 0; one fold kernel reads my segment of every input area and writes it into
//!   every rank's result area; barrier 1; copy my result area out.
//!
//! The barriers are stream memory operations (`cuStreamWriteValue32` on the peer's flag,
//! preceded by a memory fence; `cuStreamWaitValue32 GEQ` on mine), so nothing blocks the host.
//! The flags live in host-shared pages (`flags`), not in device memory: a host thread can
//! always release a stream waiting on them.
//! Every access to a peer's memory (its input area or buffer, its result area or buffer, its
//! flags) happens between barrier 0 and my barrier-1 write; so once barrier 1 has passed on a
//! rank's stream, no peer touches that rank's memory again until the next chunk's barrier 0:
//! the next chunk's copy-in and folds can never overwrite data a peer still reads.
//!
//! An all-reduce runs on the caller's stream; the other flows on the communicator's internal
//! stream. `state` orders each call after the previous one when their streams differ (a wait on
//! the ticket word or an event), so chunk sequence numbers follow stream order whatever user
//! streams the calls came from.
//!
//! A watchdog thread per communicator (`watch.rs`) bounds every wait: when the communicator fails or is
//! aborted (`ncclCommAbort`), when a call is pending longer than `OXCCL_TIMEOUT_MS`, or when a
//! peer process on this host has died, it records the error (failing the communicator, so the
//! peers' host links shut too) and keeps writing "far ahead" values into this rank's flags until
//! the stream has drained. The stream then completes with garbage in the result, and every later
//! call and `ncclCommGetAsyncError` report the error, as on the host path.
//!
//! The regions, the cards that publish them and the mapping of the peers' regions are in
//! `region.rs`; the one-shot flow of the other collectives (`oneshot.rs`) runs on the same
//! regions, barriers, sequence numbers and watchdog.
//!
//! Teardown drains the stream (bounded), closes the peers' mappings, then runs a closing barrier
//! on the host flags before freeing the exported region, so no peer still maps memory that is
//! freed; if draining or the barrier times out, the region is leaked instead.

use super::layout::{flag, CAPTURE, CLOSING, DONE, FAULT, P2P, SMALL, TICKET};
use super::pinned::reached;
use super::region::{alive, Card, PeerRegion, Region};
use super::watch::{lock, InFlight, Waits, Watch};
use super::window::{Frame, Sig, WinState};
use super::{check, DevCall, Gpu};
use crate::algo::select::{IpcAllReduceFlow, IpcPlacement};
use crate::algo::window;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One communicator's IPC state.
pub(crate) struct Ipc {
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
    /// The window executor's fold tables and the peers' mapped buffers (`window.rs`).
    pub(super) win: Box<super::window::WinState>,
    /// The direct flow between processes (`direct.rs`), from its first round.
    pub(super) direct: Option<super::direct::Direct>,
    /// The LL flow's table (`small.rs`) when small all-reduces take it.
    pub(super) ll: Option<super::small::Ll>,
}

// SAFETY: device addresses and a stream handle, usable from any thread with the context
// current; the state is used under the communicator's device lock.
unsafe impl Send for Ipc {}

/// What a timeout adds, and the set-up INFO line says, when [`one_queue_shared`]. An INFO line,
/// not a WARN: one thread driving the ranks through a group (the supported use) is correct.
const ONE_QUEUE_HINT: &str =
    "; CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of the GPU on one hardware queue, where \
     ranks of one process driven by separate threads outside a group can deadlock (a barrier's wait enqueued \
     before the peer's write): drive them from one thread through ncclGroupStart/ncclGroupEnd, or raise \
     CUDA_DEVICE_MAX_CONNECTIONS";

/// Whether every stream of the GPU shares one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`)
/// while some ranks of the communicator share this process: then calls from separate threads
/// outside a group can deadlock until the watchdog's timeout (docs/ARCHITECTURE.md, "Hardware
/// queues"); a group enqueues them in lockstep (`lockstep.rs`).
fn one_queue_shared(cards: &[Card]) -> bool {
    !Card::all_separate(cards)
        && crate::config::environ::var("CUDA_DEVICE_MAX_CONNECTIONS").is_some_and(|v| v.trim() == "1")
}

/// The watchdog of rank `comm`'s IPC state (`watch.rs`) over this rank's `region` and the
/// mapped `peers`, and its thread; `hint` ends its timeout error ([`ONE_QUEUE_HINT`]).
fn start_watchdog(
    comm: &Arc<Communicator>,
    region: &Region,
    peers: &[PeerRegion],
    hint: Option<&'static str>,
) -> Result<(Arc<Watch>, JoinHandle<()>)> {
    let rank = comm.rank();
    let watch = Arc::new(Watch {
        rank,
        n: peers.len(),
        mine: region.flags.clone(),
        issued: AtomicU32::new(0),
        p2p_issued: AtomicU32::new(0),
        resolved_issued: AtomicU32::new(0),
        pending: Mutex::new(VecDeque::new()),
        failure: Mutex::new(None),
        stop: AtomicBool::new(false),
        comm: Arc::downgrade(comm),
        aborted: comm.abort_flag(),
        pages: peers.iter().map(|p| p.flags.clone()).collect(),
        pids: peers.iter().enumerate().filter_map(|(q, p)| p.pid.map(|pid| (q, pid))).collect(),
        timeout: comm.config().timeout,
        hint,
    });
    let w2 = watch.clone();
    let watchdog = std::thread::Builder::new()
        .name(format!("oxccl-ipc-watch-{rank}"))
        .spawn(move || {
            super::capture::relax_thread();
            w2.run()
        })
        .map_err(|e| Error::from_io("spawning the CUDA IPC watchdog", e))?;
    Ok((watch, watchdog))
}

impl Ipc {
    /// Maps every peer's region and flags (`cards` indexed by rank) and starts the watchdog.
    /// On failure, closes what it opened and drops `region` (no call ever ran on it).
    pub(crate) fn open(comm: &Arc<Communicator>, region: Region, cards: &[Card], stream: sys::CUstream) -> Result<Ipc> {
        let rank = comm.rank();
        let mut peers = PeerRegion::map_all(rank, &region, cards)?;
        let hint = one_queue_shared(cards).then_some(ONE_QUEUE_HINT);
        if let (0, Some(h)) = (rank, hint) {
            crate::info!("CUDA IPC: ranks of one process on one GPU{h}");
        }
        let bases: Vec<u64> = peers.iter().map(|p| p.base).collect();
        let ll = match super::small::open(rank, &region, &bases, cards, stream) {
            Ok(l) => l,
            Err(e) => {
                PeerRegion::close_all(&mut peers);
                return Err(e);
            }
        };
        let started =
            WinState::new(cards.len()).and_then(|w| Ok((Box::new(w), start_watchdog(comm, &region, &peers, hint)?)));
        let (win, (watch, watchdog)) = match started {
            Ok(s) => s,
            Err(e) => {
                if let Some(l) = ll {
                    l.free();
                }
                PeerRegion::close_all(&mut peers);
                return Err(e);
            }
        };
        Ok(Ipc {
            rank,
            peers,
            region: Some(region),
            seq: 0,
            pseq: vec![0; cards.len()],
            ticket: 0,
            stream,
            watch,
            watchdog: Some(watchdog),
            separate: Card::all_separate(cards),
            local: Card::all_local(cards),
            win,
            direct: None,
            ll,
        })
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

    /// Enqueues an all-reduce on the internal stream (context current, n ≥ 2). A failure to
    /// enqueue fails the communicator: the peers would otherwise pair with the wrong call.
    ///
    /// # Safety
    /// The call's buffers must be device addresses of `count` elements on this GPU, valid until
    /// the stream has run the call; equal for in place, otherwise not overlapping.
    pub(crate) unsafe fn all_reduce(&mut self, gpu: &Gpu, call: DevCall, flow: IpcAllReduceFlow) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        self.guarded(|ipc| unsafe { ipc.enqueue(gpu, call, false, flow) })
    }

    /// [`Ipc::all_reduce`] on a stream that is capturing a CUDA graph: the barriers use the
    /// capture flags (set, waited for, reset: replays repeat the same values), every call has
    /// an even number of barriers (so replays keep the phases alternating), and nothing is
    /// counted for the watchdog (a graph runs whenever it is launched). The fold tables and
    /// peer mappings it uses stay for the communicator's life.
    ///
    /// # Safety
    /// As [`Ipc::all_reduce`], until the last launch of the graph has run.
    pub(crate) unsafe fn all_reduce_captured(
        &mut self,
        gpu: &Gpu,
        call: DevCall,
        flow: IpcAllReduceFlow,
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        self.guarded(|ipc| unsafe { ipc.enqueue(gpu, call, true, flow) })
    }

    /// A barrier of a captured call, phase `phase` (0 or 1), on `stream`: set my flag in every
    /// peer's page, wait until each peer's flag in mine is set, reset those.
    pub(super) fn capture_barrier(&self, phase: usize, stream: sys::CUstream) -> Result<()> {
        let with: Vec<(usize, u32)> = (0..self.peers.len()).filter(|&q| q != self.rank).map(|q| (q, 1)).collect();
        self.signal_and_wait(CAPTURE + phase, &with, true, stream)
    }

    /// Runs `enqueue` unless the path failed earlier; a failed enqueue fails the communicator.
    pub(super) fn guarded(&mut self, enqueue: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e.context("the CUDA IPC path failed earlier"));
        }
        let r = enqueue(self);
        if let Err(e) = &r {
            self.watch.fail(e.clone().context(format!("rank {}: enqueueing a device collective", self.rank)));
        }
        r
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

    /// # Safety
    /// As [`Ipc::all_reduce`].
    unsafe fn enqueue(&mut self, gpu: &Gpu, call: DevCall, captured: bool, flow: IpcAllReduceFlow) -> Result<()> {
        let DevCall { send, recv, count, dtype, op, stream } = call;
        let (n, es) = (self.peers.len(), dtype.size());
        let bytes = count * es;
        let mut frame = Frame {
            send,
            recv,
            inputs: Vec::new(),
            outputs: Vec::new(),
            count: count as u64,
            dtype,
            op,
            scale: None,
            stream,
            captured,
            board: false,
        };
        if self.takes_ll(bytes, captured) {
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.all_reduce_ll(gpu, &call) };
        }
        let plan = match flow {
            IpcAllReduceFlow::SmallCaptured => window::all_reduce_small_captured(self.rank, n, count, es),
            IpcAllReduceFlow::Small => {
                // The parity of the sequence number its barrier takes.
                let parity = self.peek_seq() as usize & 1;
                window::all_reduce_small(self.rank, n, count, es, parity)
            }
            IpcAllReduceFlow::Board => {
                self.tell_direct("the buffers published on the device");
                frame.board = true;
                window::all_reduce_direct(self.rank, n, count, es)
            }
            // SAFETY: forwarded from this function's contract.
            IpcAllReduceFlow::Rounds { publish } => return unsafe { self.all_reduce_direct(gpu, &call, publish) },
            IpcAllReduceFlow::Shared { publish } => {
                let sig = Sig { count: count as u64, dtype: dtype as u8, op: op as u8 };
                match self.share(send, recv, sig, captured, publish)? {
                    Some((inputs, outputs)) => {
                        self.tell_direct("the buffers exchanged through the host");
                        (frame.inputs, frame.outputs) = (inputs, outputs);
                        window::all_reduce_direct(self.rank, n, count, es)
                    }
                    None => window::all_reduce_staged(self.rank, n, count, es, self.half()),
                }
            }
            IpcAllReduceFlow::Staged => window::all_reduce_staged(self.rank, n, count, es, self.half()),
        };
        // Replays repeat a captured call: the capture flags' phases alternate from one call to
        // the next only with an even number of barriers per call (every plan has one).
        debug_assert!(!captured || plan.barriers() % 2 == 0, "a captured plan with an odd number of barriers");
        if cfg!(debug_assertions) {
            let b = window::Bounds { input: bytes, output: bytes, areas: self.areas(), nranks: n };
            window::validate(&plan, &b).map_err(|e| Error::internal(format!("all-reduce window plan: {e}")))?;
        }
        // SAFETY: the plan's ranges lie in the call's buffers (the contract), the regions, and
        // the peers' buffers just mapped.
        unsafe { self.run_window(gpu, &plan, &frame) }
    }

    /// Whether an all-reduce of `bytes` takes the LL flow (`small.rs`; the same answer on every
    /// rank): the ranks chose it at set-up, 1..=`SMALL_KERNEL_BYTES`, not captured (a replay
    /// would repeat the flag), and the sequence number it takes is not 0 (the zeroed slots).
    fn takes_ll(&self, bytes: usize, captured: bool) -> bool {
        self.ll.is_some()
            && !captured
            && (1..=super::small::SMALL_KERNEL_BYTES).contains(&bytes)
            && self.peek_seq() != 0
    }

    /// An all-reduce on the LL flow on the call's stream: the kernel, then the done/ticket
    /// write; it takes the next barrier sequence number, like the other flows.
    ///
    /// # Safety
    /// As [`Ipc::all_reduce`].
    unsafe fn all_reduce_ll(&mut self, gpu: &Gpu, call: &DevCall) -> Result<()> {
        let seq = self.next_seq();
        let ll = self.ll.as_ref().ok_or_else(|| Error::internal("the LL flow without its table"))?;
        // SAFETY: forwarded from this function's contract; the table and areas live with `self`.
        unsafe { super::small::launch(gpu, ll, call, seq)? };
        self.finish_call(call.stream)
    }

    /// Bytes of GPU memory the LL flow holds on this rank: its LL area (allocated when this
    /// rank asked for the flow) and the table (when the ranks use it).
    pub(crate) fn ll_bytes(&self) -> usize {
        self.region.as_ref().map_or(0, |r| r.ll)
            + if self.ll.is_some() { super::small::table_bytes(self.size()) } else { 0 }
    }

    /// Bytes of each window area of the regions, by id (`algo::window`).
    pub(super) fn areas(&self) -> Vec<usize> {
        vec![self.half(), self.half(), SMALL, SMALL, SMALL]
    }

    /// Waits (bounded) until the internal stream has run everything enqueued so far, and every
    /// call enqueued on a user's stream has run (the ticket word reached the last ticket).
    fn drain(&self, timeout: Duration) -> bool {
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
    fn closing_barrier(&self, timeout: Duration) -> bool {
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
}

impl Drop for Ipc {
    fn drop(&mut self) {
        let timeout = self.watch.timeout;
        // The watchdog keeps running while draining: it releases the stream if a peer dies or the
        // communicator failed.
        let drained = self.drain(timeout);
        self.watch.stop.store(true, Ordering::Release);
        if let Some(t) = self.watchdog.take() {
            let _ = t.join();
        }
        if let Some(d) = &mut self.direct {
            d.stop(drained);
        }
        if !drained {
            crate::warn!("CUDA IPC: rank {}: GPU work still pending at teardown; leaking the IPC region", self.rank);
            std::mem::forget(self.region.take());
            std::mem::forget(std::mem::take(&mut self.peers));
            // (The LL table, `self.ll`, is left allocated too: only `Ll::free` frees it.)
            self.win.leak();
            return;
        }
        self.win.close();
        if let Some(l) = self.ll.take() {
            l.free();
        }
        PeerRegion::close_all(&mut self.peers);
        let used = self.seq != 0 || self.ticket != 0;
        // A failed communicator's peers may be gone or stuck: wait less for them.
        let bound = if self.failure().is_some() { timeout.min(Duration::from_secs(2)) } else { timeout };
        if used && !self.closing_barrier(bound) {
            crate::warn!(
                "CUDA IPC: rank {}: peers did not finish their teardown within {bound:?}; leaking the IPC region",
                self.rank
            );
            std::mem::forget(self.region.take());
        }
        // Peers' flag pages (and, last, this rank's) drop here: their streams are drained.
    }
}
