//! Runs a [`Plan`] over the links of a communicator.
//!
//! One thread drives every step without blocking: sends to each peer go out in plan order as
//! their dependencies complete, receives from each peer are read in plan order (into a staging
//! buffer when they must be reduced), and local copies run when ready. When nothing moves the
//! engine spins briefly, then sleeps in poll(2) (or on the in-memory notifier). A step that
//! makes no progress for the communicator's timeout fails with `ncclTimeout` naming the peer.

pub mod arena;
mod check;
mod failure;
mod fuse;
pub mod lane;
mod recv;

use crate::algo::{Action, Buf, Plan, Region, Step};
use crate::error::{Error, Result};
use crate::reduce;
use crate::transport::{mem::Notifier, Interest, Link, Links};
use crate::types::{DataType, ReduceOp};
use check::{check_step, Queue};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The caller's buffers for one collective.
#[derive(Clone, Copy, Debug)]
pub struct Buffers {
    /// Start of the send buffer.
    pub send: *const u8,
    /// Bytes readable from `send`.
    pub send_len: usize,
    /// Start of the receive buffer.
    pub recv: *mut u8,
    /// Bytes writable at `recv`.
    pub recv_len: usize,
}

/// One collective call of a (possibly grouped) plan: its buffers, type and operator.
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    /// The caller's buffers.
    pub bufs: Buffers,
    /// Element type.
    pub dtype: DataType,
    /// Operator.
    pub op: ReduceOp,
}

/// Resolved base addresses of every call's buffers, scratch included.
struct Mem {
    bases: Vec<[(*mut u8, usize); 3]>,
}

impl Mem {
    /// Fills `bases` (reused memory) with the calls' buffers.
    fn new(calls: &[Operands], scratch: &mut [Vec<u64>], mut bases: Vec<[(*mut u8, usize); 3]>) -> Mem {
        bases.clear();
        bases.extend(calls.iter().enumerate().map(|(i, c)| {
            let s = scratch
                .get_mut(i)
                .map(|v| (v.as_mut_ptr() as *mut u8, v.len() * 8))
                .unwrap_or((std::ptr::null_mut(), 0));
            // In place, the send buffer *is* the receive buffer: both go through `recv`.
            let send = if std::ptr::eq(c.bufs.send, c.bufs.recv) { c.bufs.recv } else { c.bufs.send as *mut u8 };
            [(send, c.bufs.send_len), (c.bufs.recv, c.bufs.recv_len), s]
        }));
        Mem { bases }
    }

    fn base(&self, r: &Region) -> Option<(*mut u8, usize)> {
        let i = match r.buf {
            Buf::Send => 0,
            Buf::Recv => 1,
            Buf::Scratch => 2,
        };
        self.bases.get(r.call).map(|b| b[i])
    }

    /// Address of a region (bounds were checked in `Exec::new`; not dereferenced here).
    fn ptr(&self, r: Region) -> *mut u8 {
        self.base(&r).map(|b| b.0.wrapping_add(r.off)).unwrap_or(std::ptr::null_mut())
    }

    /// A read view of a region for the duration of one step.
    ///
    /// # Safety
    /// The view must be dropped before the step that asked for it ends, and no mutable view of
    /// the same bytes may exist while it lives (the plan validator's invariant: steps that
    /// write overlapping bytes are ordered by dependencies, see [`crate::algo::validate`]).
    unsafe fn slice<'b>(&self, r: Region) -> &'b [u8] {
        // SAFETY: regions were bounds-checked in `Exec::new`; the caller of `run` guarantees
        // the buffers are valid and unaliased for the call, and scratch is owned by the engine;
        // the caller keeps to this function's contract on the view's use.
        unsafe { std::slice::from_raw_parts(self.ptr(r), r.len) }
    }
}

/// `dst = with op incoming` over `incoming.len()` bytes (in place when `dst == with`).
///
/// # Safety
/// `dst` must be writable and `with` readable for `incoming.len()` bytes; they are either the
/// same address or do not overlap, and neither overlaps `incoming`.
unsafe fn reduce_at(dtype: DataType, op: ReduceOp, dst: *mut u8, with: *const u8, incoming: &[u8]) {
    let len = incoming.len();
    if std::ptr::eq(dst, with) {
        // SAFETY: per the contract, `dst` is valid for `len` bytes and aliases nothing else.
        reduce::reduce_into(dtype, op, unsafe { std::slice::from_raw_parts_mut(dst, len) }, incoming);
    } else {
        // SAFETY: per the contract, both are valid for `len` bytes and do not overlap.
        let (d, w) = unsafe { (std::slice::from_raw_parts_mut(dst, len), std::slice::from_raw_parts(with, len)) };
        reduce::reduce_to(dtype, op, d, w, incoming);
    }
}

/// Reduces the whole elements at the front of the incoming bytes `a` then `b` (stream order)
/// into `dst` (see [`reduce_at`]); an element split between `a` and `b` is put together on the
/// stack. Returns the bytes used (0 when less than one element is there).
///
/// # Safety
/// As [`reduce_at`], for `a.len() + b.len()` bytes.
unsafe fn reduce_elems(dtype: DataType, op: ReduceOp, dst: *mut u8, with: *const u8, a: &[u8], b: &[u8]) -> usize {
    let elem = dtype.size();
    if a.len() >= elem {
        let n = a.len() - a.len() % elem;
        // SAFETY: forwarded; n <= a.len().
        unsafe { reduce_at(dtype, op, dst, with, &a[..n]) };
        n
    } else if a.len() + b.len() >= elem {
        let mut tmp = [0u8; 16];
        tmp[..a.len()].copy_from_slice(a);
        tmp[a.len()..elem].copy_from_slice(&b[..elem - a.len()]);
        // SAFETY: forwarded, for one element.
        unsafe { reduce_at(dtype, op, dst, with, &tmp[..elem]) };
        elem
    } else {
        0
    }
}

/// Everything the engine needs besides the plan.
pub struct Ctx<'a> {
    /// This rank.
    pub rank: usize,
    /// Number of ranks (for `Avg`).
    pub nranks: usize,
    /// Links indexed by peer rank.
    pub links: &'a mut [Option<Box<dyn Link>>],
    /// Wake-up signal for fd-less links.
    pub notifier: Option<&'a Notifier>,
    /// Set by `ncclCommAbort`.
    pub abort: &'a AtomicBool,
    /// Longest time without progress.
    pub timeout: Duration,
    /// Name of the collective, for messages.
    pub what: &'a str,
    /// Reusable staging memory, one per peer (grown as needed).
    pub staging: &'a mut Vec<Vec<u64>>,
    /// Reusable scratch memory, one per call (grown as needed).
    pub scratch: &'a mut Vec<Vec<u64>>,
    /// How to wait when nothing moves: spin, yield, sleep ([`spin_time`]).
    pub spin: crate::wait::Spin,
    /// The operation signatures to exchange with each peer before its data
    /// ([`crate::mismatch`]); `None` when mismatch detection is off.
    pub sigs: Option<&'a mut crate::mismatch::Exchange>,
}

fn fail(rank: usize, what: &str, step: usize, e: Error) -> Error {
    e.context(format!("rank {rank}: {what} step {step}"))
}

fn sig_fail(rank: usize, what: &str, e: Error) -> Error {
    e.context(format!("rank {rank}: {what} (operation signature)"))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    /// Bytes received so far (into the destination, or into staging for a reduction).
    Moving(usize),
    /// All bytes are in staging; waiting for dependencies before applying them.
    Received,
    /// A reduction applied straight out of the link's memory; bytes applied so far.
    Direct(usize),
    Done,
}

/// Largest first receive step staged together with the signature on links that could
/// reduce it in place (shared memory).
const SMALL_STAGE: usize = 4096;

/// Idle rounds spun before the engine starts reading the clock.
const CLOCKLESS_ROUNDS: u32 = 64;

/// The waiting policy for `ranks_here` ranks sharing this host ([`crate::wait`]); `set` is
/// `OXCCL_SPIN_US` ([`crate::config::Config::spin_us`]) when given.
pub fn spin_time(ranks_here: usize, set: Option<u64>) -> crate::wait::Spin {
    crate::wait::Spin::for_load(ranks_here, crate::wait::host_cpus(), set)
}

/// Runs `plan` to completion.
///
/// # Safety
/// For every call, `send` must be readable for `send_len` bytes and `recv` writable for
/// `recv_len` bytes for the whole run, not accessed by anything else meanwhile; the two may be
/// the same pointer (in place) but must not otherwise overlap, and different calls' receive
/// buffers must not overlap. Every region of `plan` must lie inside its buffer (checked: a
/// plan that violates it fails with `ncclInternalError`).
pub unsafe fn run(plan: &Plan, calls: &[Operands], ctx: Ctx<'_>) -> Result<()> {
    Exec::new(plan, calls, ctx)?.run()
}

/// Memory the engine reuses from one call to the next on the same thread (buffer table, step
/// states, per-peer queues), so that a small collective allocates nothing.
#[derive(Default)]
struct Pool {
    bases: Vec<[(*mut u8, usize); 3]>,
    state: Vec<State>,
    sends: Vec<VecDeque<usize>>,
    recvs: Vec<VecDeque<usize>>,
    locals: VecDeque<usize>,
    fwd: Vec<usize>,
}

thread_local! {
    static POOL: std::cell::RefCell<Pool> = std::cell::RefCell::new(Pool::default());
}

/// `n` empty queues, reusing `qs`' allocations.
fn queues(mut qs: Vec<VecDeque<usize>>, n: usize) -> Vec<VecDeque<usize>> {
    qs.resize_with(n, VecDeque::new);
    qs.iter_mut().for_each(VecDeque::clear);
    qs
}

struct Exec<'a, 'p> {
    plan: &'p Plan,
    calls: &'p [Operands],
    mem: Mem,
    ctx: Ctx<'a>,
    state: Vec<State>,
    sends: Vec<VecDeque<usize>>,
    recvs: Vec<VecDeque<usize>>,
    locals: VecDeque<usize>,
    /// Per receive step, the send step that forwards its result as it is reduced
    /// ([`fuse`]), or `usize::MAX`.
    fwd: Vec<usize>,
    remaining: usize,
    /// `remaining` when [`Exec::run_locals`] last scanned the local steps: until another step
    /// is done, no local step can have become ready, so the scan is skipped.
    locals_scanned: usize,
}

impl Drop for Exec<'_, '_> {
    fn drop(&mut self) {
        use std::mem::take;
        let pool = Pool {
            bases: take(&mut self.mem.bases),
            state: take(&mut self.state),
            sends: take(&mut self.sends),
            recvs: take(&mut self.recvs),
            locals: take(&mut self.locals),
            fwd: take(&mut self.fwd),
        };
        let _ = POOL.try_with(|p| *p.borrow_mut() = pool);
    }
}

impl<'a, 'p> Exec<'a, 'p> {
    fn new(plan: &'p Plan, calls: &'p [Operands], ctx: Ctx<'a>) -> Result<Self> {
        let n = ctx.links.len();
        ctx.scratch.resize_with(ctx.scratch.len().max(calls.len()), Vec::new);
        for (i, bytes) in plan.scratch.iter().enumerate() {
            let words = bytes.div_ceil(8);
            if ctx.scratch[i].len() < words {
                ctx.scratch[i].resize(words, 0);
            }
        }
        let pool = POOL.with(|p| std::mem::take(&mut *p.borrow_mut()));
        let mem = Mem::new(calls, ctx.scratch, pool.bases);
        let mut sends = queues(pool.sends, n);
        let mut recvs = queues(pool.recvs, n);
        let mut locals = pool.locals;
        locals.clear();
        for (i, node) in plan.nodes.iter().enumerate() {
            match check_step(i, node, &mem, calls, &ctx)? {
                Queue::Send(peer) => sends[peer].push_back(i),
                Queue::Recv(peer) => recvs[peer].push_back(i),
                Queue::Local => locals.push_back(i),
            }
        }
        let max = plan.max_staged_recv().div_ceil(8);
        ctx.staging.resize_with(n, Vec::new);
        for (p, q) in recvs.iter().enumerate() {
            if !q.is_empty() && ctx.staging[p].len() < max {
                ctx.staging[p].resize(max, 0);
            }
        }
        let remaining = plan.nodes.len();
        let mut state = pool.state;
        state.clear();
        state.resize(remaining, State::Pending);
        let fwd = fuse::forwards(plan, calls, pool.fwd);
        Ok(Exec { plan, calls, mem, ctx, state, sends, recvs, locals, fwd, remaining, locals_scanned: usize::MAX })
    }

    fn ptr(&self, r: Region) -> *mut u8 {
        self.mem.ptr(r)
    }

    /// A write view of a region (of the receive buffer, or of scratch).
    ///
    /// # Safety
    /// No other view of the same bytes may exist while the returned one lives, and it must be
    /// dropped before the step that asked for it ends.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, r: Region) -> &mut [u8] {
        debug_assert!(r.buf != Buf::Send || self.ptr(r) == self.mem.ptr(Region { buf: Buf::Recv, ..r }));
        // SAFETY: as in `Mem::slice`; writes go only to the receive buffer or scratch, and the
        // caller guarantees the view is the only one of its bytes while it lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(r), r.len) }
    }

    fn deps_done(&self, i: usize) -> bool {
        self.plan.nodes[i].deps.iter().all(|&d| self.state[d] == State::Done)
    }

    fn done(&mut self, i: usize) {
        self.state[i] = State::Done;
        self.remaining -= 1;
    }

    fn run(&mut self) -> Result<()> {
        // The clock is read only while nothing moves: `idle_since` is the start of the current
        // stretch without progress.
        // The first few idle rounds do not even read it (a small message's reply is usually
        // there by then).
        let mut idle_since: Option<Instant> = None;
        let mut idle_rounds = 0u32;
        while self.remaining > 0 || self.ctx.sigs.as_ref().is_some_and(|x| !x.done()) {
            if self.ctx.abort.load(Ordering::Relaxed) {
                return Err(Error::invalid_usage(format!(
                    "rank {}: {} interrupted: communicator was aborted",
                    self.ctx.rank, self.ctx.what
                )));
            }
            let moved = self.run_locals() | self.progress_sends()? | self.progress_recvs()?;
            if moved {
                if let Some(t) = idle_since.take() {
                    crate::wait::waited(&self.ctx.spin, t.elapsed());
                }
                idle_rounds = 0;
                continue;
            }
            idle_rounds += 1;
            // Yielding rounds read the clock from the second one on: a yield may last a whole
            // time slice of another task, so rounds are no measure of time.
            let clockless = if self.ctx.spin.yields_at_once() { 2 } else { CLOCKLESS_ROUNDS };
            if idle_rounds < clockless {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let idle = now.duration_since(*idle_since.get_or_insert(now));
            if idle > self.ctx.timeout {
                return Err(self.timeout_error());
            }
            if idle < crate::wait::budget(&self.ctx.spin) {
                // After a short pure spin (none when ranks outnumber cores), give the core
                // away on each round: the peer we wait for may need this one.
                if idle < self.ctx.spin.pure {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            self.wait(self.ctx.timeout.saturating_sub(idle).min(Duration::from_millis(100)))?;
        }
        Ok(())
    }

    fn run_locals(&mut self) -> bool {
        if self.remaining == self.locals_scanned {
            return false;
        }
        self.locals_scanned = self.remaining;
        let mut moved = false;
        let mut i = 0;
        while i < self.locals.len() {
            let n = self.locals[i];
            if !self.deps_done(n) {
                i += 1;
                continue;
            }
            match self.plan.nodes[n].step {
                Step::Copy { src, dst } => {
                    let (s, d) = (self.ptr(src), self.ptr(dst));
                    if s != d {
                        // SAFETY: both ranges were bounds-checked; `copy` allows overlap.
                        unsafe { std::ptr::copy(s, d, src.len.min(dst.len)) };
                    }
                }
                Step::Finish { dst } => self.finish(dst),
                Step::Fold { src, dst } => {
                    let call = &self.calls[dst.call];
                    // SAFETY: the fold's dependencies are done, so nothing else writes `dst`
                    // or `src` now (the validator's invariant); `new` checked they are apart.
                    let (d, s) = unsafe { (self.slice_mut(dst), self.mem.slice(src)) };
                    reduce::fold(call.dtype, call.op, d, s, src.len / dst.len);
                }
                Step::Encode { src, dst, enc } => {
                    // SAFETY: as for the fold: the step's dependencies are done, so nothing
                    // else writes `dst` or `src` now; `new` checked they are apart.
                    let (d, s) = unsafe { (self.slice_mut(dst), self.mem.slice(src)) };
                    enc.encode(s, d);
                }
                Step::Decode { src, dst, enc, add } => {
                    // SAFETY: as for `Encode`.
                    let (d, s) = unsafe { (self.slice_mut(dst), self.mem.slice(src)) };
                    if add {
                        enc.decode_add(s, d);
                    } else {
                        enc.decode(s, d);
                    }
                }
                _ => unreachable!("only local steps are queued here"),
            }
            self.locals.remove(i);
            self.done(n);
            moved = true;
        }
        moved
    }

    fn finish(&self, dst: Region) {
        let call = &self.calls[dst.call];
        if call.op == ReduceOp::Avg && self.ctx.nranks > 1 {
            // SAFETY: the final division is the last step touching `dst`: every step writing
            // it is done, and the view dies with this statement.
            reduce::divide(call.dtype, unsafe { self.slice_mut(dst) }, self.ctx.nranks);
        }
    }

    fn progress_sends(&mut self) -> Result<bool> {
        let mut moved = false;
        for peer in 0..self.sends.len() {
            moved |= self.progress_sends_to(peer)?;
        }
        Ok(moved)
    }

    /// Sends to `peer` what its queue allows now, in plan order; returns whether bytes moved.
    fn progress_sends_to(&mut self, peer: usize) -> Result<bool> {
        let mut moved = false;
        // The signature goes out in one write with the first data step when that is ready,
        // so both travel in one segment.
        let first = self.sends[peer].front().copied().filter(|&i| self.deps_done(i) && self.state[i] == State::Pending);
        if let (Some(x), Some(l)) = (self.ctx.sigs.as_deref_mut(), self.ctx.links[peer].as_mut()) {
            let out = x.pending_out(peer);
            if !out.is_empty() {
                let data = match first.map(|i| &self.plan.nodes[i].step) {
                    // SAFETY: the send's dependencies are done, so nothing writes `src`
                    // while this step reads it; the view is dropped within this step.
                    Some(Step::Send { src, .. }) => unsafe { self.mem.slice(*src) },
                    _ => &[],
                };
                let n = match l.try_send_vectored(&[out, data]) {
                    Ok(n) => n,
                    Err(e) => return Err(self.explain(peer, sig_fail(self.ctx.rank, self.ctx.what, e))),
                };
                let (to_sig, rest, whole) = (n.min(out.len()), n.saturating_sub(out.len()), data.len());
                x.sent(peer, to_sig);
                moved |= n > 0;
                let sig_left = !x.pending_out(peer).is_empty();
                if let (Some(i), true) = (first, rest > 0) {
                    if rest == whole {
                        self.sends[peer].pop_front();
                        self.done(i);
                    } else {
                        self.state[i] = State::Moving(rest);
                    }
                }
                if sig_left {
                    return Ok(moved);
                }
            }
        }
        while let Some(&i) = self.sends[peer].front() {
            if !self.deps_done(i) {
                break;
            }
            let Step::Send { src, .. } = self.plan.nodes[i].step else { unreachable!() };
            let sent = match self.state[i] {
                State::Moving(k) => k,
                _ => 0,
            };
            // SAFETY: the send's dependencies are done, so nothing writes `src` while this
            // step reads it; the view is dropped within this step.
            let data = unsafe { &self.mem.slice(src)[sent..] };
            let n = if data.is_empty() {
                Ok(0)
            } else {
                self.link(peer).try_send(data).map_err(|e| fail(self.ctx.rank, self.ctx.what, i, e))
            };
            let n = n.map_err(|e| self.explain(peer, e))?;
            moved |= n > 0;
            if sent + n == src.len {
                self.sends[peer].pop_front();
                self.done(i);
                moved = true;
            } else {
                self.state[i] = State::Moving(sent + n);
                break;
            }
        }
        Ok(moved)
    }

    fn link(&mut self, peer: usize) -> &mut Box<dyn Link> {
        self.ctx.links[peer].as_mut().expect("links checked in new")
    }

    fn fail(&self, step: usize, e: Error) -> Error {
        fail(self.ctx.rank, self.ctx.what, step, e)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.lane_mismatch()?;
        let mut want = Vec::new();
        for peer in 0..self.ctx.links.len() {
            // Bytes are wanted when the signature exchange or the front receive may read now.
            let sig = self.ctx.sigs.as_deref();
            let read =
                sig.is_some_and(|x| x.wants_input(peer)) || self.recvs[peer].front().is_some_and(|&i| self.may_read(i));
            let write = sig.is_some_and(|x| !x.pending_out(peer).is_empty())
                || self.sends[peer].front().is_some_and(|&i| self.deps_done(i));
            let Some(l) = self.ctx.links[peer].as_mut() else { continue };
            if !(read || write) {
                continue;
            }
            let interest = Interest { read, write };
            let step = self.recvs[peer].front().or(self.sends[peer].front()).copied().unwrap_or(0);
            if !l.arm(interest).map_err(|e| fail(self.ctx.rank, self.ctx.what, step, e))? {
                return Ok(());
            }
            want.push((peer, interest));
        }
        let links: Vec<(&dyn Link, Interest)> =
            want.iter().filter_map(|&(p, i)| self.ctx.links[p].as_deref().map(|l| (l, i))).collect();
        Links::wait(&links, self.ctx.notifier, timeout)
    }

    /// A peer whose signature this operation waits for, but which posted a small all-reduce's
    /// message on its shared-memory lane instead ([`lane`]): the calls differ.
    fn lane_mismatch(&mut self) -> Result<()> {
        let Some(x) = self.ctx.sigs.as_deref() else { return Ok(()) };
        for (peer, l) in self.ctx.links.iter_mut().enumerate() {
            if !x.wants_input(peer) || !x.received_so_far(peer).is_empty() {
                continue;
            }
            let (Some(mine), Some(shm)) = (x.mine(peer), l.as_mut().and_then(|l| l.shm())) else { continue };
            if let Some(stamp) = shm.lane_unexpected() {
                let theirs = lane::stamp_signature(&stamp, mine.seq);
                crate::mismatch::check(self.ctx.rank, mine, peer, &theirs)
                    .map_err(|e| e.context(format!("rank {}: {}", self.ctx.rank, self.ctx.what)))?;
            }
        }
        Ok(())
    }

    fn timeout_error(&self) -> Error {
        let mut waiting = Vec::new();
        for (peer, l) in self.ctx.links.iter().enumerate() {
            if self.ctx.sigs.as_deref().is_some_and(|x| x.wants_input(peer)) {
                let who = l.as_ref().map(|l| l.describe()).unwrap_or_default();
                waiting.push(format!("receiving the operation signature from {who}"));
            }
        }
        for (peer, q) in self.recvs.iter().enumerate() {
            if let Some(&i) = q.front() {
                let who = self.ctx.links[peer].as_ref().map(|l| l.describe()).unwrap_or_default();
                waiting.push(format!("receiving step {i} from {who}"));
            }
        }
        for (peer, q) in self.sends.iter().enumerate() {
            if let Some(&i) = q.front() {
                let who = self.ctx.links[peer].as_ref().map(|l| l.describe()).unwrap_or_default();
                waiting.push(format!("sending step {i} to {who}"));
            }
        }
        Error::timeout(format!(
            "rank {}: {} made no progress for {} ms (OXCCL_TIMEOUT_MS); stuck {}",
            self.ctx.rank,
            self.ctx.what,
            self.ctx.timeout.as_millis(),
            waiting.join(", ")
        ))
    }
}
