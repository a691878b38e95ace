//! The small all-reduce path of a communicator ([`crate::engine::lane`]): which calls take
//! it, and running one with the communicator's bookkeeping (concurrency guard, flight
//! recorder, failure handling).

use super::*;
use crate::engine::arena;
use crate::engine::lane::{self, PlanlessCtx};
use std::sync::atomic::AtomicU32;

/// Most calls skipped between two probes that find an unshared buffer.
pub const MAX_SKIP: u32 = 1024;

/// Where the probe's skipping stands ([`Communicator::probes_sharing`]).
#[derive(Default)]
pub(crate) struct Backoff {
    /// Calls left to skip.
    skip: AtomicU32,
    /// Calls skipped after the last unshared probe.
    backoff: AtomicU32,
}

impl Communicator {
    /// Whether `op` (outside a group) takes a plan-less shared-memory path: the small
    /// all-reduce ([`lane`]: at most [`lane::MAX_BYTES`] bytes per rank on a power-of-two
    /// communicator) or, on a host with more ranks than CPUs (`OXCCL_ARENA` says otherwise),
    /// the arena all-reduce ([`arena`]: every other size, at least [`arena::MIN_RANKS`] ranks), when
    /// the ranks share one host over shared memory and no algorithm is forced (`OXCCL_ALGO`,
    /// `NCCL_ALGO`, [`Communicator::set_tuning`]). Depends only on values every rank shares, so
    /// that every rank of a matched call takes the same path.
    pub(crate) fn takes_lane(&self, coll: Collective, count: usize, dtype: DataType) -> bool {
        let bytes = count.saturating_mul(dtype.size());
        // Under `OXCCL_DETERMINISTIC` only the arena, which folds in rank order as the
        // schedules of `algo::det` do; the lane reduces in an order of its own.
        let det = self.fixed.det.load(Ordering::Relaxed);
        coll == Collective::AllReduce
            && self.transport == TransportKind::Shm
            && ((!det && lane::eligible(self.size, bytes))
                || (self.config.arena.unwrap_or(self.fixed.crowded)
                    && arena::eligible(self.size, bytes, self.config.arena == Some(true)))
                || self.probes_sharing(bytes))
            && self.config.algos.is_none()
            && !self.fixed.forced.load(Ordering::Relaxed)
    }

    /// Whether an all-reduce of `bytes` on this communicator first asks whether every rank's
    /// buffers are in shareable host memory ([`arena::all_reduce`]'s probe): two ranks, from
    /// [`arena::PROBE_MIN`] bytes, sharing on (`OXCCL_LOCAL_REGISTER`), the arena not turned
    /// off (`OXCCL_ARENA=0`). With `OXCCL_ARENA=1` the arena takes the call anyway.
    ///
    /// After a probe that found an unshared buffer, the next calls skip it (1, 2, 4, ... up to
    /// [`MAX_SKIP`] calls), so that a program whose buffers are never shared pays for one
    /// barrier in [`MAX_SKIP`] calls; a probe that finds every buffer shared ends the skipping.
    /// Every rank makes the same calls and sees the same probe outcomes, so every rank skips the
    /// same calls.
    fn probes_sharing(&self, bytes: usize) -> bool {
        self.may_probe(bytes) && self.probe.skip.load(Ordering::Relaxed) == 0
    }

    fn may_probe(&self, bytes: usize) -> bool {
        self.size == 2 && bytes >= arena::PROBE_MIN && self.config.local_register && self.config.arena.is_none()
    }

    /// Counts a call that could have probed and did not (its op was built without the lane).
    pub(crate) fn skipped_probe(&self, bytes: usize) {
        if self.may_probe(bytes) {
            let s = &self.probe.skip;
            let _ = s.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| k.checked_sub(1));
        }
    }

    /// Records a probe's outcome (`all`: every buffer was shared).
    fn probed(&self, all: bool) {
        let b = &self.probe;
        let next = if all { 0 } else { (b.backoff.load(Ordering::Relaxed) * 2).clamp(1, MAX_SKIP) };
        b.backoff.store(next, Ordering::Relaxed);
        b.skip.store(next, Ordering::Relaxed);
    }

    /// Runs the all-reduce `c` of `count` elements on the small all-reduce path
    /// ([`Communicator::takes_lane`] must hold).
    ///
    /// # Safety
    /// `c`'s buffers must be valid for the all-reduce (as `Communicator::prepare` checks).
    pub(crate) unsafe fn run_lane(&self, c: &Call, count: usize) -> Result<()> {
        const WHAT: &str = "all_reduce";
        if self.fixed.det.load(Ordering::Relaxed) || !lane::eligible(self.size, count.saturating_mul(c.dtype.size())) {
            // SAFETY: the caller's contract.
            return unsafe { self.run_arena(c, count) };
        }
        self.check_usable(WHAT)?;
        let Some(_busy) = self.guard.enter() else { return Err(self.refuse_concurrent(WHAT)) };
        let mut guard = lock(&self.inner);
        let inner = &mut *guard;
        let (rank, n) = (self.rank, self.size);
        let mut peers = [0usize; lane::MAX_ROUNDS];
        let mut np = 0;
        for p in lane::partners(rank, n) {
            peers[np] = p;
            np += 1;
        }
        let peers = &peers[..np];
        let desc = mismatch::Desc::single(Collective::AllReduce, count, c.dtype, c.op);
        let seq = self.flight.start(WHAT, &desc, peers);
        let r = (|| {
            self.planless_start(inner, peers)?;
            let bufs = inner.lane.get_or_insert_with(|| {
                crate::info!(
                    "rank {rank}: all-reduces of up to {} B take the shared-memory lane (partners {peers:?})",
                    lane::MAX_BYTES
                );
                Default::default()
            });
            let ctx = self.planless_ctx(&mut inner.links);
            // SAFETY: the caller's contract.
            unsafe { lane::all_reduce(ctx, bufs, c.bufs.send, c.bufs.recv, count, c.dtype, c.op) }
        })();
        self.finish_planless(inner, seq, r)
    }

    /// Runs the all-reduce `c` of `count` elements through the host arena ([`arena`]).
    ///
    /// # Safety
    /// As [`Communicator::run_lane`].
    unsafe fn run_arena(&self, c: &Call, count: usize) -> Result<()> {
        const WHAT: &str = "all_reduce";
        self.check_usable(WHAT)?;
        let Some(_busy) = self.guard.enter() else { return Err(self.refuse_concurrent(WHAT)) };
        let mut guard = lock(&self.inner);
        let inner = &mut *guard;
        let (rank, n) = (self.rank, self.size);
        let peers: Vec<usize> = (0..n).filter(|&p| p != rank).collect();
        let desc = mismatch::Desc::single(Collective::AllReduce, count, c.dtype, c.op);
        let seq = self.flight.start(WHAT, &desc, &peers);
        // Two ranks reach the arena only through the probe or `OXCCL_ARENA=1` (which turns it off).
        let probe = self.probes_sharing(count.saturating_mul(c.dtype.size()));
        let r = (|| {
            self.planless_start(inner, &peers)?;
            let ctx = self.planless_ctx(&mut inner.links);
            // SAFETY: the caller's contract.
            unsafe { arena::all_reduce(ctx, &mut inner.arena, c.bufs.send, c.bufs.recv, count, c.dtype, c.op, probe) }
        })();
        let taken = matches!(r, Ok(true));
        if probe && r.is_ok() {
            self.probed(taken);
        }
        self.finish_planless(inner, seq, r.map(|_| ()))?;
        drop(guard);
        drop(_busy);
        if taken {
            return Ok(());
        }
        // Not every buffer is shared: the call runs on its plan (every rank learnt the same at
        // the probe's barrier).
        let in_place = std::ptr::eq(c.bufs.send, c.bufs.recv);
        let plan = self
            .plan_for(Collective::AllReduce, count, c.dtype, c.op, in_place)
            .map_err(|e| self.record(e.context(WHAT)))?;
        // SAFETY: the caller's contract.
        unsafe { self.execute(WHAT, &desc, &plan, std::slice::from_ref(c)) }
    }

    /// The start of a plan-less call with `peers`: connects their links if needed and counts
    /// the call in each pair's sequence (the mismatch check's numbering, shared with the engine).
    fn planless_start(&self, inner: &mut Inner, peers: &[usize]) -> Result<()> {
        if peers.iter().any(|&p| inner.links[p].is_none()) {
            self.ensure_links(inner, peers, Instant::now() + self.timeout())?;
        }
        if self.config.check_mismatch {
            for &p in peers {
                inner.seq[p] += 1;
            }
        }
        Ok(())
    }

    /// What a plan-less path needs of this communicator, with its `links`.
    fn planless_ctx<'a>(&'a self, links: &'a mut [Option<Box<dyn Link>>]) -> PlanlessCtx<'a> {
        PlanlessCtx {
            rank: self.rank,
            nranks: self.size,
            links,
            abort: &self.aborted,
            timeout: self.timeout(),
            spin: self.fixed.spin,
            check: self.config.check_mismatch,
            share: self.config.local_register,
        }
    }

    /// The end of a plan-less call: records the outcome; on failure spreads the reason to the
    /// peers, shuts the links and fails the communicator.
    fn finish_planless(&self, inner: &mut Inner, seq: u64, r: Result<()>) -> Result<()> {
        match r {
            Ok(()) => {
                self.flight.finish(seq, &Ok(()));
                Ok(())
            }
            Err(e) => {
                let e = self.fail_call(inner, e);
                self.flight.finish(seq, &Err(e.clone()));
                Err(e)
            }
        }
    }
}
