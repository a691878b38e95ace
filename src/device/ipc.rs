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
//! `region.rs`; the mapped regions, the barriers, sequence numbers, tickets and the watchdog
//! that every flow runs on are the mesh (`mesh.rs`). This file is the dispatcher: [`Ipc`]
//! holds the mesh and each flow's own state, and runs the flow `algo::select::ipc_all_reduce`
//! chose (the LL flow of `small.rs`, a window plan through `window.rs`, or the direct rounds of
//! `direct.rs`); only it names those flows. The one-shot flow of the other collectives
//! (`oneshot.rs`) and the exchange (`p2p.rs`) run on the same mesh.
//!
//! Teardown drains the stream (bounded), closes the peers' mappings, then runs a closing barrier
//! on the host flags before freeing the exported region, so no peer still maps memory that is
//! freed; if draining or the barrier times out, the region is leaked instead.

use super::direct::{Direct, DirectFlow};
use super::mesh::Mesh;
use super::region::{Card, PeerRegion, Region};
use super::watch::Watch;
use super::window::{Frame, Sig, WinState, Window};
use super::{DevCall, Gpu};
use crate::algo::select::{IpcAllReduceFlow, IpcPlacement};
use crate::algo::window;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One communicator's IPC state: the mesh every flow runs on, and each flow's own state.
pub(crate) struct Ipc {
    /// The regions, flags, barriers, counters and watchdog (`mesh.rs`).
    mesh: Mesh,
    /// The window executor's fold tables and the peers' mapped buffers (`window.rs`).
    pub(super) win: Box<WinState>,
    /// The direct flow between processes (`direct.rs`), from its first round.
    direct: Option<Direct>,
    /// The LL flow's table (`small.rs`) when small all-reduces take it.
    ll: Option<super::small::Ll>,
}

/// The mesh's accessors (rank, areas, barriers, counters) on the IPC state, for the flows
/// that run on it whole (`oneshot.rs`, `p2p.rs`) and the executor (`run.rs`, `state.rs`).
impl std::ops::Deref for Ipc {
    type Target = Mesh;
    fn deref(&self) -> &Mesh {
        &self.mesh
    }
}

impl std::ops::DerefMut for Ipc {
    fn deref_mut(&mut self) -> &mut Mesh {
        &mut self.mesh
    }
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
        let placement = IpcPlacement { separate: Card::all_separate(cards), local: Card::all_local(cards) };
        let mesh = Mesh::new(rank, peers, region, stream, (watch, watchdog), placement);
        Ok(Ipc { mesh, win, direct: None, ll })
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

    /// Runs `enqueue` unless the path failed earlier; a failed enqueue fails the communicator.
    pub(super) fn guarded(&mut self, enqueue: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(e.context("the CUDA IPC path failed earlier"));
        }
        let r = enqueue(self);
        if let Err(e) = &r {
            self.watch.fail(e.clone().context(format!("rank {}: enqueueing a device collective", self.rank())));
        }
        r
    }

    /// # Safety
    /// As [`Ipc::all_reduce`].
    unsafe fn enqueue(&mut self, gpu: &Gpu, call: DevCall, captured: bool, flow: IpcAllReduceFlow) -> Result<()> {
        let DevCall { send, recv, count, dtype, op, stream } = call;
        let (me, n, es) = (self.rank(), self.size(), dtype.size());
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
        let plan = match flow {
            // SAFETY: forwarded from this function's contract.
            IpcAllReduceFlow::Ll => return unsafe { self.all_reduce_ll(gpu, &call) },
            IpcAllReduceFlow::SmallCaptured => window::all_reduce_small_captured(me, n, count, es),
            IpcAllReduceFlow::Small => {
                // The parity of the sequence number its barrier takes.
                let parity = self.peek_seq() as usize & 1;
                window::all_reduce_small(me, n, count, es, parity)
            }
            IpcAllReduceFlow::Board => {
                self.tell_direct("the buffers published on the device");
                frame.board = true;
                window::all_reduce_direct(me, n, count, es)
            }
            IpcAllReduceFlow::Rounds { publish } => {
                // SAFETY: forwarded from this function's contract.
                return unsafe { self.direct_flow().all_reduce(gpu, &call, publish) };
            }
            IpcAllReduceFlow::Shared { publish } => {
                let sig = Sig { count: count as u64, dtype: dtype as u8, op: op as u8 };
                match self.window().share(send, recv, sig, captured, publish)? {
                    Some((inputs, outputs)) => {
                        self.tell_direct("the buffers exchanged through the host");
                        (frame.inputs, frame.outputs) = (inputs, outputs);
                        window::all_reduce_direct(me, n, count, es)
                    }
                    None => window::all_reduce_staged(me, n, count, es, self.half()),
                }
            }
            IpcAllReduceFlow::Staged => window::all_reduce_staged(me, n, count, es, self.half()),
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
        unsafe { self.window().run_window(gpu, &plan, &frame) }
    }

    /// Whether the ranks set up the LL flow (`small.rs`; the same answer on every rank), for
    /// the choice of an all-reduce's flow ([`crate::algo::select::ipc_ll`]).
    pub(crate) fn ll_ready(&self) -> bool {
        self.ll.is_some()
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
        self.ll_area() + if self.ll.is_some() { super::small::table_bytes(self.size()) } else { 0 }
    }

    /// The window executor on this state (`window.rs`).
    pub(super) fn window(&mut self) -> Window<'_> {
        Window { m: &mut self.mesh, w: &mut self.win }
    }

    /// The direct flow between processes on this state (`direct.rs`).
    fn direct_flow(&mut self) -> DirectFlow<'_> {
        DirectFlow { m: &mut self.mesh, direct: &mut self.direct }
    }
}

impl Drop for Ipc {
    fn drop(&mut self) {
        let timeout = self.watch.timeout;
        // The watchdog keeps running while draining: it releases the stream if a peer dies or the
        // communicator failed.
        let drained = self.drain(timeout);
        self.mesh.stop_watchdog();
        if let Some(d) = &mut self.direct {
            d.stop(drained);
        }
        if !drained {
            crate::warn!("CUDA IPC: rank {}: GPU work still pending at teardown; leaking the IPC region", self.rank());
            self.mesh.leak();
            // (The LL table, `self.ll`, is left allocated too: only `Ll::free` frees it.)
            self.win.leak();
            return;
        }
        self.win.close();
        if let Some(l) = self.ll.take() {
            l.free();
        }
        self.mesh.close_peers();
        let used = self.used();
        // A failed communicator's peers may be gone or stuck: wait less for them.
        let bound = if self.failure().is_some() { timeout.min(Duration::from_secs(2)) } else { timeout };
        if used && !self.closing_barrier(bound) {
            crate::warn!(
                "CUDA IPC: rank {}: peers did not finish their teardown within {bound:?}; leaking the IPC region",
                self.rank()
            );
            self.mesh.leak_region();
        }
        // Peers' flag pages (and, last, this rank's) drop here: their streams are drained.
    }
}
