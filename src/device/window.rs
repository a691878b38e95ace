//! The device executor of window plans ([`crate::algo::window`]) on the CUDA IPC mode, and
//! what the direct all-reduce needs: the peers' user buffers mapped here, and fold tables.
//!
//! **Running a plan.** Every op goes onto one stream: a copy is `cuMemcpyDtoDAsync`; a fold of
//! two sources into one destination is the pairwise reduce kernel; a fold into one destination
//! from more sources is a chain of pairwise kernels (as before window plans: no table); a fold
//! into several destinations is one `oxccl_fold_*` kernel reading its sources and destinations
//! from a table in device memory; a barrier is the IPC barrier of stream memory operations
//! (phase 0 and 1 alternate, a new sequence number at each phase 0). The call ends with the
//! done/ticket write.
//!
//! **Fold tables.** A table is the list of device addresses of a fold. Tables are kept in device
//! memory, cached by content ([`TABLE_SLOTS`] of them): a call whose buffers repeat (the common
//! case: training loops reuse their buffers) uploads nothing; a new table costs one
//! host-to-device copy from page-locked memory. A slot is reused only once the ticket of the
//! last call that used it has been reached, so neither its page-locked source nor its device
//! copy changes under queued work.
//!
//! **Direct all-reduce of a captured call** ([`crate::algo::select::ipc_direct`]; uncaptured
//! calls between processes take `direct.rs`, which never meets the peers on the host). Every
//! rank describes its send and receive buffers (allocation base and size from
//! `cuMemGetAddressRange`, the allocation's `cuIpcGetMemHandle` or, for `cuMemCreate` memory, a
//! VMM card of `super::vmm`, the offset) and the ranks exchange the descriptions through the
//! communicator's host all-reduce. When every rank could export both buffers (and
//! `OXCCL_CUDA_DIRECT` is not `0` on any), each rank maps the peers' allocations (cached by IPC
//! handle: a handle names one allocation, so a freed and reallocated range gets a new one) and
//! runs `algo::window::all_reduce_direct`; otherwise every rank runs the staged plan. A mapping
//! that cannot be opened fails the communicator (the peers are released by the watchdog).
//! Mappings are closed when more than [`IMPORT_CAP`] are open (those no queued call uses), and
//! at teardown after the stream drained.
//!
//! **Direct all-reduce between ranks of one process.** There the ranks need no IPC handle (one
//! address space), and no host meeting either, which could deadlock a thread driving several
//! ranks: each rank publishes its call on its stream, before the plan's first barrier, as four
//! 64-bit stream writes into its board (a small area of its region): the tag (the first
//! barrier's sequence number, type and operator), the count, `send` and `recv`. A fold naming
//! the peers' buffers then reads a guarded table (`cuda/reduce.cu`) whose entries are the
//! addresses of the boards' `send` and `recv` words (the same for every call, so the table is
//! cached once), plus the segment's offset. The kernel folds only when every board carries the
//! same tag and count; otherwise (the ranks' calls differ, or a barrier released by the
//! watchdog let a fold run before a peer published) it writes nothing and sets the rank's
//! fault word, and the watchdog fails the communicator with `ncclInvalidUsage`. A board is
//! rewritten only by its owner's next call, after the closing barrier of this one, which every
//! reader's fold precedes.
//!
//! Caveat (as for NCCL's registered buffers): a peer's allocation stays mapped here until the
//! mapping is evicted or the communicator is destroyed, so the driver may keep its memory
//! after the owner frees it.

use super::bufs::{open_handle, BufCard, IMPORT_CAP};
use super::layout::{BOARD_COUNT, BOARD_RECV, BOARD_SEND, BOARD_TAG};
use super::mesh::Mesh;
use super::pinned::{reached, Pinned};
use super::{check, ops, Gpu};
use crate::algo::window::{At, Mem, WindowPlan, WindowStep, CAPTURE_AREA, INPUT_AREA, RESULT_AREA, SMALL_AREA};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::collections::HashMap;

/// Fold tables kept in device memory per communicator.
pub(crate) const TABLE_SLOTS: usize = 64;

/// One call's buffers and scalars, as the plan's executor needs them.
pub(super) struct Frame {
    /// This rank's send buffer.
    pub(super) send: u64,
    /// This rank's receive buffer.
    pub(super) recv: u64,
    /// Every rank's send buffer as mapped here (direct flow only; empty otherwise).
    pub(super) inputs: Vec<u64>,
    /// Every rank's receive buffer as mapped here (direct flow only).
    pub(super) outputs: Vec<u64>,
    /// Elements of the call (as the boards publish it).
    pub(super) count: u64,
    /// Element type.
    pub(super) dtype: DataType,
    /// Operator.
    pub(super) op: ReduceOp,
    /// PreMulSum factor of the plan's `Scale` ops.
    pub(super) scale: Option<f64>,
    /// The stream.
    pub(super) stream: sys::CUstream,
    /// Whether the stream is capturing a CUDA graph (`Ipc::all_reduce_captured`).
    pub(super) captured: bool,
    /// The peers' buffers are read through the boards (every rank in this process): the call
    /// publishes `send` and `recv` in this rank's board, and folds naming the peers' buffers
    /// use guarded tables of board words.
    pub(super) board: bool,
}

/// The window executor at work: the IPC mesh it runs plans on and its own state.
pub(crate) struct Window<'a> {
    /// The regions, barriers and counters.
    pub(super) m: &'a mut Mesh,
    /// The fold tables and mapped buffers.
    pub(super) w: &'a mut WinState,
}

/// A fold table slot: its content and the ticket of the last call that used it.
struct Slot {
    key: Vec<u64>,
    last: u32,
    /// Used by a captured call: kept for the communicator's life (graphs replay it).
    kept: bool,
}

/// Fold tables in device memory, with their page-locked sources.
struct Tables {
    dev: u64,
    host: Pinned,
    /// 64-bit words per slot.
    words: usize,
    slots: Vec<Option<Slot>>,
    index: HashMap<Vec<u64>, usize>,
}

impl Drop for Tables {
    fn drop(&mut self) {
        // SAFETY: allocated in `Tables::new`; the owner (`Ipc::drop`) drops this only after the
        // stream drained, and leaks it otherwise.
        unsafe { sys::cuMemFree_v2(self.dev) };
    }
}

impl Tables {
    fn new(words: usize) -> Result<Tables> {
        let bytes = words * 8 * TABLE_SLOTS;
        let host = Pinned::new(bytes)?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: writes the allocation's address.
        check(unsafe { sys::cuMemAlloc_v2(&mut dev, bytes) }, &format!("cuMemAlloc({bytes} bytes) for fold tables"))?;
        Ok(Tables { dev, host, words, slots: (0..TABLE_SLOTS).map(|_| None).collect(), index: HashMap::new() })
    }
}

/// A peer's allocation mapped here.
struct Import {
    base: u64,
    last: u32,
    /// Used by a captured call: kept for the communicator's life.
    kept: bool,
}

/// The window executor's state, held by `Ipc` (`ipc.rs`): fold tables and the peers' mapped
/// buffers.
#[derive(Default)]
pub(crate) struct WinState {
    tables: Option<Tables>,
    imports: HashMap<(usize, [u8; 64]), Import>,
}

impl WinState {
    /// The state of an `n`-rank communicator, its fold tables allocated (at set-up, not during
    /// a call: a stream capturing a graph in global mode forbids allocations).
    pub(super) fn new(n: usize) -> Result<WinState> {
        // A guarded table (`Window::board_fold`) ends with two more words.
        Ok(WinState { tables: Some(Tables::new(2 * n + 2)?), ..Default::default() })
    }

    /// The fold tables (allocated by [`WinState::new`], freed only at teardown).
    fn tables_mut(&mut self) -> Result<&mut Tables> {
        self.tables
            .as_mut()
            .ok_or_else(|| Error::internal("the CUDA IPC fold tables are gone (communicator torn down)"))
    }

    /// Bytes the fold tables hold: (device memory, page-locked host memory).
    pub(crate) fn bytes(&self) -> (usize, usize) {
        self.tables.as_ref().map_or((0, 0), |t| (t.words * 8 * TABLE_SLOTS, t.host.len()))
    }

    /// Closes every mapping (the stream has drained) and frees the tables.
    pub(super) fn close(&mut self) {
        for (_, i) in self.imports.drain() {
            if !super::vmm::close(i.base) {
                // SAFETY: opened by cuIpcOpenMemHandle in `import`; no queued work uses it.
                unsafe { sys::cuIpcCloseMemHandle(i.base) };
            }
        }
        self.tables = None;
    }

    /// Leaks the mappings and tables (work may still use them).
    pub(super) fn leak(&mut self) {
        std::mem::forget(self.tables.take());
        self.imports.clear();
    }
}

/// Bytes of one rank's description: ok, type, operator, count, then two [`BufCard`]s.
pub(super) const CARD_LEN: usize = 16 + 2 * (16 + 64);

/// What a rank's call is, as the direct flow's exchange carries it (its mismatch check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sig {
    /// Elements.
    pub(super) count: u64,
    /// Element type (`ncclDataType_t`).
    pub(super) dtype: u8,
    /// Operator (`ncclRedOp_t`).
    pub(super) op: u8,
}

/// Encodes a rank's call and its send and receive buffers (`None`: not shareable).
pub(super) fn encode(sig: Sig, bufs: Option<(BufCard, BufCard)>, out: &mut [u8]) {
    out.fill(0);
    out[1] = sig.dtype;
    out[2] = sig.op;
    out[8..16].copy_from_slice(&sig.count.to_le_bytes());
    if let Some((s, r)) = bufs {
        out[0] = 1;
        s.write(&mut out[16..96]);
        r.write(&mut out[96..176]);
    }
}

/// Decodes [`encode`]'s bytes: the call, and the buffers when shareable.
pub(super) fn decode(b: &[u8]) -> (Sig, Option<(BufCard, BufCard)>) {
    let sig = Sig { count: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")), dtype: b[1], op: b[2] };
    (sig, (b[0] == 1).then(|| (BufCard::read(&b[16..96]), BufCard::read(&b[96..176]))))
}

impl Window<'_> {
    /// The address in this process of the plan's `at` for the call `f`.
    fn addr(&self, f: &Frame, at: &At) -> Result<u64> {
        let base = match at.mem {
            Mem::Input(q) if q == self.m.rank() => f.send,
            Mem::Output(q) if q == self.m.rank() => f.recv,
            Mem::Input(q) => {
                *f.inputs.get(q).ok_or_else(|| Error::internal(format!("rank {q}'s input is not mapped")))?
            }
            Mem::Output(q) => {
                *f.outputs.get(q).ok_or_else(|| Error::internal(format!("rank {q}'s output is not mapped")))?
            }
            Mem::Area { rank, id: INPUT_AREA } => self.m.input(rank),
            Mem::Area { rank, id: RESULT_AREA } => self.m.result(rank),
            Mem::Area { rank, id } if id == SMALL_AREA || id == SMALL_AREA + 1 => {
                self.m.small(rank, (id - SMALL_AREA) as u32)
            }
            Mem::Area { rank, id: CAPTURE_AREA } => self.m.capture_slot(rank),
            Mem::Area { id, .. } => return Err(Error::internal(format!("no window area {id} on the device"))),
        };
        Ok(base + at.off as u64)
    }

    /// Enqueues `plan` on `f.stream`, then the call's done/ticket write.
    ///
    /// # Safety
    /// The plan's ranges must lie inside the call's buffers (valid until the stream has run the
    /// call), the regions, and the peers' buffers mapped into `f`.
    pub(super) unsafe fn run_window(&mut self, gpu: &Gpu, plan: &WindowPlan, f: &Frame) -> Result<()> {
        let es = f.dtype.size();
        if f.board {
            self.check_board_plan(plan)?;
            // SAFETY: this rank's board (its region); `send` and `recv` per the contract.
            unsafe { self.publish(f)? };
        }
        let mut barriers = 0usize;
        let mut s = 0u32;
        for o in &plan.ops {
            // SAFETY (every arm): the addresses lie in memory the contract names.
            match o {
                WindowStep::Copy { from, to, len } => unsafe {
                    ops::copy(self.addr(f, to)?, self.addr(f, from)?, *len, f.stream)?
                },
                WindowStep::Scale { at, len } => {
                    let factor = f.scale.ok_or_else(|| Error::internal("a window plan scales without a factor"))?;
                    let a = self.addr(f, at)?;
                    unsafe { ops::scale(gpu, a, a, (len / es) as u64, f.dtype, factor, f.stream)? }
                }
                WindowStep::Fold { from, to, len } => unsafe { self.fold(gpu, f, from, to, (len / es) as u64)? },
                WindowStep::Barrier if f.captured => {
                    self.m.capture_barrier(barriers % 2, f.stream)?;
                    barriers += 1;
                }
                WindowStep::Barrier => {
                    let phase = barriers % 2;
                    if phase == 0 {
                        s = self.m.next_seq();
                    }
                    self.m.barrier(phase, s, f.stream)?;
                    barriers += 1;
                }
            }
        }
        if f.captured {
            return Ok(());
        }
        self.m.finish_call(f.stream)
    }

    /// One fold: pairwise kernels into one destination, else the table kernel.
    ///
    /// # Safety
    /// As [`Window::run_window`].
    unsafe fn fold(&mut self, gpu: &Gpu, f: &Frame, from: &[At], to: &[At], n: u64) -> Result<()> {
        if f.board && self.names_peer_buffers(from, to) {
            // SAFETY: per the contract; the boards hold the call's buffers.
            return unsafe { self.board_fold(gpu, f, from, to, n) };
        }
        let srcs: Vec<u64> = from.iter().map(|a| self.addr(f, a)).collect::<Result<_>>()?;
        let dsts: Vec<u64> = to.iter().map(|a| self.addr(f, a)).collect::<Result<_>>()?;
        let k = srcs.len();
        let avg = |j: usize| if f.op == ReduceOp::Avg && j == k - 1 { k as u32 } else { 1 };
        if let ([d], true) = (dsts.as_slice(), k >= 2) {
            // A chain of pairwise kernels, unless the destination is a later source (it would
            // be overwritten before it is read).
            if !srcs[2..].contains(d) {
                // SAFETY (this block): per the contract.
                unsafe {
                    ops::reduce(gpu, *d, srcs[0], srcs[1], n, f.dtype, f.op, avg(1), f.stream)?;
                    for (j, &src) in srcs.iter().enumerate().skip(2) {
                        ops::reduce(gpu, *d, *d, src, n, f.dtype, f.op, avg(j), f.stream)?;
                    }
                }
                return Ok(());
            }
        }
        let mut key = srcs;
        key.extend(&dsts);
        let table = self.table(&key, f.stream, f.captured)?;
        let div = if f.op == ReduceOp::Avg { k as u32 } else { 1 };
        // SAFETY: the table lists the fold's addresses (per the contract) and stays unchanged
        // until the call's ticket is reached.
        unsafe { ops::fold(gpu, table, n, k as u32, dsts.len() as u32, f.dtype, f.op, div, false, f.stream) }
    }

    /// Whether a fold reads or writes a peer's send or receive buffer.
    fn names_peer_buffers(&self, from: &[At], to: &[At]) -> bool {
        let me = self.m.rank();
        from.iter().chain(to).any(|a| matches!(a.mem, Mem::Input(q) | Mem::Output(q) if q != me))
    }

    /// A board plan publishes at the start of the call and its folds read the boards: none may
    /// come before the first barrier, and a barrier must follow the last (the next call's
    /// publication must not overwrite a board a peer still reads).
    fn check_board_plan(&self, plan: &WindowPlan) -> Result<()> {
        let folds =
            |o: &WindowStep| matches!(o, WindowStep::Fold { from, to, .. } if self.names_peer_buffers(from, to));
        let first_barrier = plan.ops.iter().position(|o| matches!(o, WindowStep::Barrier));
        let last_barrier = plan.ops.iter().rposition(|o| matches!(o, WindowStep::Barrier));
        let first = plan.ops.iter().position(folds);
        let last = plan.ops.iter().rposition(folds);
        match (first, last, first_barrier, last_barrier) {
            (Some(a), Some(z), Some(fb), Some(lb)) if fb < a && z < lb => Ok(()),
            (None, None, _, _) => Ok(()),
            _ => Err(Error::internal("a window plan reads the boards outside its barriers")),
        }
    }

    /// Publishes this call in this rank's board: tag, count, `send`, `recv` (`cuda/reduce.cu`).
    ///
    /// # Safety
    /// The board is this rank's (its region, live until teardown).
    unsafe fn publish(&self, f: &Frame) -> Result<()> {
        let seq = if f.captured { 0 } else { u64::from(self.m.peek_seq()) };
        let tag = seq << 32 | u64::from(f.captured) << 16 | (f.dtype as u64) << 8 | f.op as u64;
        let board = self.m.board(self.m.rank());
        for (i, v) in [(BOARD_TAG, tag), (BOARD_COUNT, f.count), (BOARD_SEND, f.send), (BOARD_RECV, f.recv)] {
            // SAFETY: word i of this rank's board, 8-byte aligned.
            unsafe { super::write_value64(f.stream, board + 8 * i, v, "board")? };
        }
        Ok(())
    }

    /// A fold whose sources are the ranks' send buffers and destinations their receive
    /// buffers, all at one offset, through a guarded table of board words.
    ///
    /// # Safety
    /// As [`Window::run_window`]; every rank published this call before the fold's barrier.
    unsafe fn board_fold(&mut self, gpu: &Gpu, f: &Frame, from: &[At], to: &[At], n: u64) -> Result<()> {
        let off = from.first().map_or(0, |a| a.off);
        let word = |a: &At, want_input: bool| -> Result<u64> {
            match a.mem {
                Mem::Input(q) if want_input && a.off == off => Ok(self.m.board(q) + 8 * BOARD_SEND),
                Mem::Output(q) if !want_input && a.off == off => Ok(self.m.board(q) + 8 * BOARD_RECV),
                _ => Err(Error::internal(format!(
                    "a board fold names {a:?}: only send buffers in, receive buffers out, one offset"
                ))),
            }
        };
        let mut key: Vec<u64> = from.iter().map(|a| word(a, true)).collect::<Result<_>>()?;
        for a in to {
            key.push(word(a, false)?);
        }
        key.extend([off as u64, self.m.fault_word()]);
        let table = self.table(&key, f.stream, f.captured)?;
        let k = from.len();
        let div = if f.op == ReduceOp::Avg { k as u32 } else { 1 };
        // SAFETY: the table names the boards' words, which hold the call's buffers (every rank
        // published before the barrier this fold follows), valid until the call's ticket.
        unsafe { ops::fold(gpu, table, n, k as u32, to.len() as u32, f.dtype, f.op, div, true, f.stream) }
    }

    /// The device address of a table holding `key`, uploaded on `stream` if not cached.
    fn table(&mut self, key: &[u64], stream: sys::CUstream, keep: bool) -> Result<u64> {
        let (now, n) = (self.m.call_ticket(), self.m.size());
        let t = self.w.tables_mut()?;
        if key.len() > t.words {
            return Err(Error::internal(format!("a fold of {} addresses on {n} ranks", key.len())));
        }
        if let Some(&i) = t.index.get(key) {
            if let Some(s) = &mut t.slots[i] {
                s.last = now;
                s.kept |= keep;
            }
            return Ok(t.dev + (i * t.words * 8) as u64);
        }
        let i = self.free_slot()?;
        let t = self.w.tables_mut()?;
        if let Some(old) = t.slots[i].take() {
            t.index.remove(&old.key);
        }
        let at = i * t.words * 8;
        // SAFETY: slot `i` of the page-locked mirror (in bounds); no queued copy reads it (its
        // last call's ticket was reached, or it was never used).
        unsafe {
            let dst = t.host.host().add(at).cast::<u64>();
            for (j, &w) in key.iter().enumerate() {
                dst.add(j).write_unaligned(w);
            }
        }
        // SAFETY: page-locked source and device slot, both `key.len() * 8` bytes, unchanged
        // until the ticket of this call is reached.
        unsafe { ops::upload(t.dev + at as u64, t.host.host().add(at), key.len() * 8, stream)? };
        t.slots[i] = Some(Slot { key: key.to_vec(), last: now, kept: keep });
        t.index.insert(key.to_vec(), i);
        Ok(t.dev + at as u64)
    }

    /// A table slot that no queued call uses: an empty one, or the least recently used one
    /// once its last call finished (waiting for that, bounded by the communicator's timeout).
    fn free_slot(&mut self) -> Result<usize> {
        let now = self.m.call_ticket();
        let t = self.w.tables_mut()?;
        if let Some(i) = t.slots.iter().position(Option::is_none) {
            return Ok(i);
        }
        let Some((i, last)) = t
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().filter(|s| !s.kept).map(|s| (i, s.last)))
            .min_by_key(|&(_, last)| last.wrapping_sub(now))
        else {
            return Err(Error::invalid_usage(format!(
                "rank {}: every one of the {TABLE_SLOTS} fold tables is held by a call captured into a CUDA graph",
                self.m.rank()
            )));
        };
        self.m.wait_ticket(last, "a fold table slot")?;
        Ok(i)
    }

    /// Every rank's buffers mapped here for a direct all-reduce of `send` → `recv` (the call
    /// `sig`), or `None` when some rank cannot share its buffers (every rank then gets `None`;
    /// this rank offers its own only with `publish`, `OXCCL_CUDA_DIRECT` not `0`);
    /// an error when the ranks' calls differ. Collective: every rank of the communicator calls
    /// it for the same call.
    pub(super) fn share(
        &mut self,
        send: u64,
        recv: u64,
        sig: Sig,
        keep: bool,
        publish: bool,
    ) -> Result<Option<(Vec<u64>, Vec<u64>)>> {
        let comm = self.m.comm()?;
        let (n, me) = (self.m.size(), self.m.rank());
        let len = sig.count * DataType::from_raw(i32::from(sig.dtype)).map_or(8, |t| t.size() as u64);
        let mine = publish.then(|| BufCard::of(send, len).zip(BufCard::of(recv, len))).flatten();
        let mut slots = vec![0u8; n * CARD_LEN];
        encode(sig, mine, &mut slots[me * CARD_LEN..(me + 1) * CARD_LEN]);
        let mut all = vec![0u8; n * CARD_LEN];
        comm.device_host_call().all_reduce_slices(&slots, &mut all, ReduceOp::Max)?;
        let decoded: Vec<(Sig, Option<(BufCard, BufCard)>)> = all.chunks(CARD_LEN).map(decode).collect();
        if let Some((q, (theirs, _))) = decoded.iter().enumerate().find(|(_, (s, _))| *s != sig) {
            return Err(Error::invalid_usage(format!(
                "collective mismatch: rank {me} runs a device all-reduce of {} elements of type {} with operator {}, \
                 rank {q} one of {} elements of type {} with operator {}",
                sig.count, sig.dtype, sig.op, theirs.count, theirs.dtype, theirs.op
            )));
        }
        let cards: Option<Vec<(BufCard, BufCard)>> = decoded.into_iter().map(|(_, c)| c).collect();
        let Some(cards) = cards else { return Ok(None) };
        let now = self.m.call_ticket();
        let (mut inputs, mut outputs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (q, (s, r)) in cards.iter().enumerate() {
            if q == me {
                inputs.push(send);
                outputs.push(recv);
                continue;
            }
            inputs.push(self.import(q, s, now, keep)?);
            outputs.push(self.import(q, r, now, keep)?);
        }
        self.evict_imports();
        Ok(Some((inputs, outputs)))
    }

    /// Rank `q`'s buffer `c` as mapped here (opened on first use), used by call ticket `now`.
    fn import(&mut self, q: usize, c: &BufCard, now: u32, keep: bool) -> Result<u64> {
        let off = c.addr - c.base;
        if let Some(i) = self.w.imports.get_mut(&(q, c.handle)) {
            i.last = now;
            i.kept |= keep;
            return Ok(i.base + off);
        }
        // A call captured into a graph may meet a buffer first here: the mapping is kept for
        // the communicator's life, outside any graph (`capture.rs`).
        let base = super::capture::relaxed(|| open_handle(&c.handle)).map_err(|e| {
            e.context(format!("rank {}: mapping rank {q}'s buffer for a direct all-reduce", self.m.rank()))
        })?;
        self.w.imports.insert((q, c.handle), Import { base, last: now, kept: keep });
        Ok(base + off)
    }

    /// Closes mappings that no queued call uses while more than [`IMPORT_CAP`] are open.
    fn evict_imports(&mut self) {
        if self.w.imports.len() <= IMPORT_CAP {
            return;
        }
        let done = self.m.ticket_done();
        let mut idle: Vec<((usize, [u8; 64]), u32)> = self
            .w
            .imports
            .iter()
            .filter(|(_, i)| !i.kept && reached(done, i.last))
            .map(|(k, i)| (*k, i.last))
            .collect();
        idle.sort_by_key(|&(_, last)| last.wrapping_sub(done));
        for (k, _) in idle.into_iter().take(self.w.imports.len() - IMPORT_CAP) {
            if let Some(i) = self.w.imports.remove(&k) {
                // Possibly during a capture (`capture.rs`): a mapping no graph uses.
                super::capture::relaxed(|| {
                    if !super::vmm::close(i.base) {
                        // SAFETY: opened by `import`; the last call that used it has finished.
                        unsafe { sys::cuIpcCloseMemHandle(i.base) };
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_cards_round_trip() {
        let s = BufCard { addr: 0x7000_0010, base: 0x7000_0000, handle: [3; 64] };
        let r = BufCard { addr: 0x9000_0000, base: 0x9000_0000, handle: [9; 64] };
        let sig = Sig { count: 1 << 40, dtype: 9, op: 4 };
        let mut b = [0u8; CARD_LEN];
        encode(sig, Some((s, r)), &mut b);
        assert_eq!(decode(&b), (sig, Some((s, r))));
        encode(sig, None, &mut b);
        assert_eq!(decode(&b), (sig, None));
    }
}
