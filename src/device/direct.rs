//! The direct all-reduce between ranks in processes of their own, enqueued without waiting for
//! the peers: every rank folds its segment of every rank's send buffer into every rank's
//! receive buffer, where they lie, and the host of the caller meets no peer.
//!
//! **Publishing.** For each round (a call of more than `H` bytes, the regions' area size, runs
//! in rounds of at most `H` bytes, alike on every rank) the caller writes a card into the ring
//! of its flag page (which the peers map): the round's number `d` (counted alike on every rank),
//! the tag (first barrier's sequence number, type and operator), the round's count, and for
//! `send` and `recv` either its allocation's `cuIpcGetMemHandle` (address, allocation base,
//! handle; a VMM card of `vmm` for `cuMemCreate` memory) or "my area": a buffer that cannot be
//! exported (or every buffer of a rank with `OXCCL_CUDA_DIRECT=0`) is staged through the
//! rank's input and result areas, which the peers mapped at set-up (a copy in before the first
//! barrier, a copy out after the second). The card is written with host stores: no stream
//! work, no waiting (see *Depth* for the one bound).
//!
//! **Opening.** A thread per communicator (the opener), with the GPU's context current, takes
//! the rounds in order, waits for each peer's card of round `d` in the peer's page, opens the
//! peers' allocations (`cuIpcOpenMemHandle`, cached by handle; at most [`IMPORT_CAP`] kept once
//! no queued round uses them) and writes, in a page of its own (host memory mapped for the
//! device), one board per rank `[tag, count, send, recv]` as mapped here and the guarded fold
//! table naming the boards' words (`cuda/reduce.cu`), then stores `d` into the rank's resolved
//! word. The stream runs: barrier 0; `cuStreamWaitValue32(resolved ≥ d)`; the guarded fold
//! (which folds only when every board carries the same tag and count, else sets the fault
//! word: a mismatched call becomes `ncclInvalidUsage` from the watchdog, as does the opener's
//! own comparison of the cards); barrier 1. A peer that never publishes leaves the stream
//! waiting, so the call is timed and its peers watched by the watchdog as every call is; the
//! watchdog's release also writes the resolved word far ahead, and the caller zeroed the
//! round's board tags, so a released fold writes nothing.
//!
//! **Depth.** The ring holds [`RING`] rounds: a round reuses slot `d mod RING` once the round
//! that used it before passed its closing barrier on this rank's stream (which implies that
//! every peer's opener read that card: its stream waited for it before the barrier this rank's
//! stream passed): the end of its call (the ticket word) for a call's last round, else the
//! round word that the stream writes after each earlier round. Only the `RING + 1`-th round in
//! flight waits, on the host and bounded by the communicator's timeout.

use super::bufs::{open_handle, BufCard, IMPORT_CAP};
use super::flags::FlagPage;
use super::layout::{CARDS, CARD_WORDS, C_COUNT, C_RECV, C_SEND, C_STAMP, C_TAG, RESOLVED, RING, ROUND_DONE, TICKET};
use super::mesh::Mesh;
use super::pinned::reached;
use super::watch::{lock, Watch};
use super::{check, ops, DevCall, Gpu};
use crate::algo::window::{self, WindowStep};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One rank's round as its card says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Card {
    tag: u64,
    count: u64,
    /// `None`: staged through the owner's area.
    send: Option<BufCard>,
    recv: Option<BufCard>,
}

fn card_at(d: u32) -> usize {
    CARDS + (d as usize % RING) * CARD_WORDS
}

fn write_buf(page: &FlagPage, at: usize, b: &Option<BufCard>) {
    let Some(b) = b else {
        page.store64(at, 2);
        return;
    };
    page.store64(at, 1);
    page.store64(at + 2, b.addr);
    page.store64(at + 4, b.base);
    for (i, w) in b.handle.chunks(4).enumerate() {
        page.store(at + 6 + i, u32::from_le_bytes(w.try_into().expect("4 bytes")));
    }
}

fn read_buf(page: &FlagPage, at: usize) -> Option<BufCard> {
    if page.load64(at) != 1 {
        return None;
    }
    let mut handle = [0u8; 64];
    for (i, w) in handle.chunks_mut(4).enumerate() {
        w.copy_from_slice(&page.load(at + 6 + i).to_le_bytes());
    }
    Some(BufCard { addr: page.load64(at + 2), base: page.load64(at + 4), handle })
}

/// Writes round `d`'s card into `page` (the stamp last).
fn publish(page: &FlagPage, d: u32, c: &Card) {
    let at = card_at(d);
    page.store64(at + C_TAG, c.tag);
    page.store64(at + C_COUNT, c.count);
    write_buf(page, at + C_SEND, &c.send);
    write_buf(page, at + C_RECV, &c.recv);
    page.store(at + C_STAMP, d);
}

/// Round `d`'s card in `page`, once its owner wrote it.
fn read(page: &FlagPage, d: u32) -> Option<Card> {
    let at = card_at(d);
    (page.load(at + C_STAMP) == d).then(|| Card {
        tag: page.load64(at + C_TAG),
        count: page.load64(at + C_COUNT),
        send: read_buf(page, at + C_SEND),
        recv: read_buf(page, at + C_RECV),
    })
}

/// 32-bit words of one slot of the resolved page: `n` boards of 4 64-bit words, then the
/// guarded table (`2n` word addresses, the offset, the fault word's address).
fn slot_words(n: usize) -> usize {
    2 * (4 * n + 2 * n + 2)
}

/// Zeroes the tags of slot `slot`'s boards (a fold released before the opener wrote them
/// writes nothing) and writes its guarded table: the boards' `send` and `recv` words, the
/// fold's offset `off`, the fault word `fault`. Returns the table's device address. The caller
/// owns the slot (no queued fold reads it).
fn write_table(page: &FlagPage, slot: usize, n: usize, off: u64, fault: u64) -> u64 {
    let at = slot * slot_words(n);
    let table = at + 8 * n;
    for q in 0..n {
        page.store64(at + 8 * q, 0);
        page.store64(table + 2 * q, page.dev(at + 8 * q + 4));
        page.store64(table + 2 * (n + q), page.dev(at + 8 * q + 6));
    }
    page.store64(table + 4 * n, off);
    page.store64(table + 4 * n + 2, fault);
    page.dev(table)
}

/// A round for the opener.
struct Job {
    d: u32,
    /// The ticket of the call the round belongs to.
    ticket: u32,
    card: Card,
    /// This rank's send and receive addresses for the round (its buffers or its areas).
    me: (u64, u64),
}

/// What the caller and the opener share.
#[derive(Default)]
struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
    stop: AtomicBool,
    /// At stop: close the mappings (the stream drained) rather than leak them.
    close: AtomicBool,
}

/// What a ring slot waits for before its reuse.
#[derive(Clone, Copy)]
enum Held {
    Free,
    /// The call with this ticket (the slot's round was the call's last).
    Ticket(u32),
    /// This round's end (the round word; a call of more rounds).
    Round(u32),
}

/// The direct flow at work: the IPC mesh it runs on and its own state (`None` until the first
/// round starts it).
pub(crate) struct DirectFlow<'a> {
    /// The regions, barriers and counters.
    pub(super) m: &'a mut Mesh,
    /// The flow's state.
    pub(super) direct: &'a mut Option<Direct>,
}

/// The direct flow's state, held by `Ipc` (`ipc.rs`) from the first direct round.
pub(crate) struct Direct {
    /// Rounds published.
    d: u32,
    /// What frees each slot of the ring: the end of the call or of the round that used it.
    held: Vec<Held>,
    resolved: Arc<FlagPage>,
    queue: Arc<Queue>,
    opener: Option<JoinHandle<()>>,
}

impl Direct {
    /// Stops the opener; `close`: the stream drained, the peers' mappings are closed.
    pub(super) fn stop(&mut self, close: bool) {
        self.queue.close.store(close, Ordering::Release);
        self.queue.stop.store(true, Ordering::Release);
        self.queue.cv.notify_all();
        if let Some(t) = self.opener.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// The opener thread's view.
struct Opener {
    rank: usize,
    watch: Arc<Watch>,
    resolved: Arc<FlagPage>,
    queue: Arc<Queue>,
    /// Every rank's (input area, result area) as mapped here.
    areas: Vec<(u64, u64)>,
    imports: HashMap<(usize, [u8; 64]), (u64, u32)>,
}

impl Opener {
    fn run(mut self, gpu: Arc<Gpu>) {
        let _ctx = match gpu.enter() {
            Ok(c) => c,
            Err(e) => return self.watch.fail(e.context("the direct all-reduce's opener thread")),
        };
        while let Some(job) = self.next() {
            if self.watch.failure().is_some() {
                continue;
            }
            if let Err(e) = self.resolve(&job) {
                self.watch.fail(e);
            }
        }
        let close = self.queue.close.load(Ordering::Acquire);
        for (_, (base, _)) in self.imports.drain() {
            if close && !super::vmm::close(base) {
                // SAFETY: opened by `open`; the stream drained (no work uses it).
                unsafe { sys::cuIpcCloseMemHandle(base) };
            }
        }
    }

    /// The next round, or `None` once stopped.
    fn next(&self) -> Option<Job> {
        let mut q = lock(&self.queue.jobs);
        loop {
            if self.queue.stop.load(Ordering::Acquire) {
                return None;
            }
            if let Some(j) = q.pop_front() {
                return Some(j);
            }
            q = self
                .queue
                .cv
                .wait_timeout(q, Duration::from_millis(50))
                .map(|r| r.0)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Waits for rank `q`'s card of round `d`; `None` when stopped or failed meanwhile.
    fn card_of(&self, q: usize, d: u32) -> Option<Card> {
        let mut spins = 0u32;
        loop {
            if let Some(c) = read(&self.watch.pages[q], d) {
                return Some(c);
            }
            if self.queue.stop.load(Ordering::Acquire) || self.watch.failure().is_some() {
                return None;
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Maps every rank's buffers of round `job.d` and writes the boards, the table and the
    /// resolved word.
    fn resolve(&mut self, job: &Job) -> Result<()> {
        let n = self.areas.len();
        let mut boards = Vec::with_capacity(n);
        for q in 0..n {
            if q == self.rank {
                boards.push((job.card.tag, job.card.count, job.me.0, job.me.1));
                continue;
            }
            let Some(c) = self.card_of(q, job.d) else { return Ok(()) };
            if (c.tag, c.count) != (job.card.tag, job.card.count) {
                return Err(mismatch(self.rank, q, &job.card, &c));
            }
            let input = match &c.send {
                Some(b) => self.open(q, b, job.ticket)?,
                None => self.areas[q].0,
            };
            let output = match &c.recv {
                Some(b) => self.open(q, b, job.ticket)?,
                None => self.areas[q].1,
            };
            boards.push((c.tag, c.count, input, output));
        }
        let at = (job.d as usize % RING) * slot_words(n);
        let page = &self.resolved;
        for (q, &(tag, count, input, output)) in boards.iter().enumerate() {
            let b = at + 8 * q;
            page.store64(b + 4, input);
            page.store64(b + 6, output);
            page.store64(b + 2, count);
            page.store64(b, tag);
        }
        self.watch.mine.store(RESOLVED, job.d);
        self.evict();
        Ok(())
    }

    /// Rank `q`'s buffer `b` as mapped here, used by the call with ticket `now`.
    fn open(&mut self, q: usize, b: &BufCard, now: u32) -> Result<u64> {
        let off = b.addr - b.base;
        if let Some(i) = self.imports.get_mut(&(q, b.handle)) {
            i.1 = now;
            return Ok(i.0 + off);
        }
        let base = open_handle(&b.handle)
            .map_err(|e| e.context(format!("rank {}: mapping rank {q}'s buffer for a direct all-reduce", self.rank)))?;
        self.imports.insert((q, b.handle), (base, now));
        Ok(base + off)
    }

    /// Closes mappings that no queued call uses while more than [`IMPORT_CAP`] are open.
    fn evict(&mut self) {
        if self.imports.len() <= IMPORT_CAP {
            return;
        }
        let done = self.watch.mine.load(TICKET);
        let mut idle: Vec<_> =
            self.imports.iter().filter(|(_, i)| reached(done, i.1)).map(|(k, i)| (*k, i.1)).collect();
        idle.sort_by_key(|&(_, last)| last.wrapping_sub(done));
        for (k, _) in idle.into_iter().take(self.imports.len() - IMPORT_CAP) {
            if let Some((base, _)) = self.imports.remove(&k) {
                if !super::vmm::close(base) {
                    // SAFETY: opened by `open`; the last call that used it has finished.
                    unsafe { sys::cuIpcCloseMemHandle(base) };
                }
            }
        }
    }
}

fn mismatch(me: usize, q: usize, mine: &Card, theirs: &Card) -> Error {
    let what =
        |c: &Card| format!("{} elements of type {} with operator {}", c.count, (c.tag >> 8) & 0xff, c.tag & 0xff);
    Error::invalid_usage(format!(
        "collective mismatch: rank {me} runs a device all-reduce round of {}, rank {q} one of {}",
        what(mine),
        what(theirs)
    ))
}

impl DirectFlow<'_> {
    /// Enqueues a direct all-reduce between ranks in processes of their own, in rounds of at
    /// most the area size, without waiting for any peer (module doc).
    ///
    /// # Safety
    /// The call's buffers must be device addresses of `count` elements on this GPU, valid until
    /// the stream has run the call; equal for in place, otherwise not overlapping.
    pub(super) unsafe fn all_reduce(&mut self, gpu: &Gpu, call: &DevCall, publish: bool) -> Result<()> {
        let es = call.dtype.size();
        let len = (call.count * es) as u64;
        let cards = publish.then(|| (BufCard::of(call.send, len), BufCard::of(call.recv, len)));
        self.tell_direct_flow(cards);
        let (send_card, recv_card) = cards.unwrap_or((None, None));
        let per = (self.m.half() / es).max(1);
        let mut first = 0;
        while first < call.count {
            let c = per.min(call.count - first);
            let ro = (first * es) as u64;
            let moved = |b: Option<BufCard>| b.map(|b| BufCard { addr: b.addr + ro, ..b });
            let card = Card { tag: 0, count: c as u64, send: moved(send_card), recv: moved(recv_card) };
            let last = first + c == call.count;
            // SAFETY: forwarded from this function's contract.
            unsafe { self.direct_round(gpu, call, card, (ro, (c * es) as u64), last)? };
            first += c;
        }
        self.m.finish_call(call.stream)
    }

    /// The next round's number and ring slot, once the round that used the slot before has
    /// passed its closing barrier on this rank's stream (so every peer read its card).
    fn take_slot(&mut self, gpu: &Gpu) -> Result<(u32, usize)> {
        self.direct_start(gpu)?;
        let dir = self.direct.as_mut().expect("started");
        dir.d = dir.d.wrapping_add(1);
        let (d, slot) = (dir.d, dir.d as usize % RING);
        match dir.held[slot] {
            Held::Free => {}
            Held::Ticket(t) => self.m.wait_ticket(t, "a slot of the direct all-reduce's ring")?,
            Held::Round(e) => {
                let start = Instant::now();
                while !reached(self.m.watch.mine.load(ROUND_DONE), e) {
                    if let Some(err) = self.m.failure() {
                        return Err(err);
                    }
                    if start.elapsed() > self.m.timeout() {
                        return Err(Error::timeout(format!(
                            "rank {}: waiting {:?} for the GPU to finish direct all-reduce round {e}",
                            self.m.rank(),
                            self.m.timeout()
                        )));
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
        Ok((d, slot))
    }

    /// One round of [`DirectFlow::all_reduce`]: `at` = (bytes into the call, bytes long);
    /// `last`: the call's last round (its end is the call's ticket; an earlier round's end is
    /// written into the round word, for the ring's reuse).
    ///
    /// # Safety
    /// As [`DirectFlow::all_reduce`].
    unsafe fn direct_round(
        &mut self,
        gpu: &Gpu,
        call: &DevCall,
        mut card: Card,
        at: (u64, u64),
        last: bool,
    ) -> Result<()> {
        let (n, me, es, stream) = (self.m.size(), self.m.rank(), call.dtype.size(), call.stream);
        let (ro, len) = at;
        let (d, slot) = self.take_slot(gpu)?;
        let me_in = if card.send.is_some() { call.send + ro } else { self.m.input(me) };
        let me_out = if card.recv.is_some() { call.recv + ro } else { self.m.result(me) };
        if card.send.is_none() {
            // SAFETY: the round's bytes of `send` (the contract) into my input area (≥ len).
            unsafe { ops::copy(me_in, call.send + ro, len as usize, stream)? };
        }
        let s = self.m.next_seq();
        card.tag = u64::from(s) << 32 | (call.dtype as u64) << 8 | call.op as u64;
        let plan = window::all_reduce_direct(me, n, (len as usize) / es, es);
        let fold = plan.ops.iter().find_map(|o| match o {
            WindowStep::Fold { from, len, .. } => Some((from[0].off as u64, *len)),
            _ => None,
        });
        let (ticket, fault) = (self.m.call_ticket(), self.m.fault_word());
        let dir = self.direct.as_mut().expect("started");
        dir.held[slot] = if last { Held::Ticket(ticket) } else { Held::Round(d) };
        let table = write_table(&dir.resolved, slot, n, fold.map_or(0, |f| f.0), fault);
        publish(&self.m.watch.mine, d, &card);
        let job = Job { d, ticket, card, me: (me_in, me_out) };
        lock(&dir.queue.jobs).push_back(job);
        dir.queue.cv.notify_one();
        self.m.watch.resolved_issued.store(d, Ordering::Release);
        self.m.barrier(0, s, stream)?;
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the resolved word of this rank's registered flag page.
        check(
            unsafe { sys::cuStreamWaitValue32_v2(stream, self.m.watch.mine.dev(RESOLVED), d, geq) },
            "cuStreamWaitValue32(resolved)",
        )?;
        if let Some((_, flen)) = fold {
            let div = if call.op == crate::types::ReduceOp::Avg { n as u32 } else { 1 };
            let k = n as u32;
            // SAFETY: the table and boards (host memory mapped for the device) name the round's
            // buffers as mapped here, written by the opener before the resolved word the
            // stream waited for; unchanged until this call's ticket is reached.
            unsafe { ops::fold(gpu, table, (flen / es) as u64, k, k, call.dtype, call.op, div, true, stream)? };
        }
        self.m.barrier(1, s, stream)?;
        if card.recv.is_none() {
            // SAFETY: my result area holds the round's result after barrier 1.
            unsafe { ops::copy(call.recv + ro, me_out, len as usize, stream)? };
        }
        if !last {
            let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
            // SAFETY: the round word of this rank's registered flag page.
            let at = self.m.watch.mine.dev(ROUND_DONE);
            check(unsafe { sys::cuStreamWriteValue32_v2(stream, at, d, write) }, "cuStreamWriteValue32(round)")?;
        }
        Ok(())
    }

    /// Creates the direct flow's state and starts its opener (first direct round).
    fn direct_start(&mut self, gpu: &Gpu) -> Result<()> {
        if self.direct.is_some() {
            return Ok(());
        }
        let n = self.m.size();
        let resolved = Arc::new(FlagPage::create(RING * slot_words(n))?);
        let queue = Arc::new(Queue::default());
        let opener = Opener {
            rank: self.m.rank(),
            watch: self.m.watch.clone(),
            resolved: resolved.clone(),
            queue: queue.clone(),
            areas: (0..n).map(|q| (self.m.input(q), self.m.result(q))).collect(),
            imports: HashMap::new(),
        };
        let gpu = super::gpu(gpu.ordinal)?;
        let t = std::thread::Builder::new()
            .name(format!("oxccl-ipc-open-{}", self.m.rank()))
            .spawn(move || {
                super::capture::relax_thread();
                opener.run(gpu)
            })
            .map_err(|e| Error::from_io("spawning the direct all-reduce's opener thread", e))?;
        *self.direct = Some(Direct { d: 0, held: vec![Held::Free; RING], resolved, queue, opener: Some(t) });
        Ok(())
    }

    /// Says once how the direct flow shares this rank's buffers (`cards`: `None` when
    /// `OXCCL_CUDA_DIRECT=0`); a buffer that cannot be exported is a WARN (staged, slower).
    fn tell_direct_flow(&mut self, cards: Option<(Option<BufCard>, Option<BufCard>)>) {
        match cards {
            None => self.m.tell_direct("this rank's buffers staged through its regions: OXCCL_CUDA_DIRECT=0"),
            Some((Some(_), Some(_))) => {
                self.m.tell_direct("the buffers published in the flag pages, mapped by an opener thread")
            }
            // `BufCard::of` said why the buffer cannot be shared (a WARN line per reason).
            Some(_) => self.m.tell_direct("the buffers published in the flag pages, mapped by an opener thread"),
        }
    }
}
