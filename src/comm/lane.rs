//! The plan-less executors of a communicator: the shared-memory lane ([`crate::engine::lane`])
//! and the host arena ([`arena`]), each an [`Executor`] run in a [`Session`] (concurrency
//! guard, flight record, link set-up, call numbers, failure handling). Which of them (or a
//! plan) runs a call is [`select::path`]'s answer, dispatched by `Communicator::run_planless`
//! (coll.rs);
//! the probe's back-off it reads is kept here between calls.

use super::*;
use crate::algo::select::{self, Backoff, Path, PathRequest};
use crate::engine::arena;
use crate::engine::lane::{self, PlanlessCtx};
use std::sync::atomic::AtomicU64;

/// Where the arena probe's back-off stands ([`select::Backoff`]), kept between calls.
#[derive(Default)]
pub(crate) struct ProbeState(AtomicU64);

impl ProbeState {
    fn get(&self) -> Backoff {
        let v = self.0.load(Ordering::Relaxed);
        Backoff { skip: v as u32, backoff: (v >> 32) as u32 }
    }

    fn set(&self, b: Backoff) {
        self.0.store(u64::from(b.skip) | (u64::from(b.backoff) << 32), Ordering::Relaxed);
    }
}

impl Communicator {
    /// What [`select::path`] needs to know about a host call of `count` elements of `dtype`
    /// (`grouped`: it runs merged with other operations of this communicator).
    pub(crate) fn path_request(&self, coll: Collective, count: usize, dtype: DataType, grouped: bool) -> PathRequest {
        PathRequest {
            coll,
            bytes: count.saturating_mul(dtype.size()),
            nranks: self.size,
            transport: self.transport,
            grouped,
            forced: self.config.algos.is_some() || self.fixed.forced.load(Ordering::Relaxed),
            deterministic: self.fixed.det.load(Ordering::Relaxed),
            crowded: self.fixed.crowded,
            arena: self.config.arena,
            local_register: self.config.local_register,
            backoff: self.probe.get(),
        }
    }

    /// The executor of a call run on its own ([`select::path`]).
    pub(crate) fn host_path(&self, coll: Collective, count: usize, dtype: DataType) -> Path {
        select::path(&self.path_request(coll, count, dtype, false))
    }

    /// Counts, in the probe's back-off, a call that takes `path` for `r`.
    pub(crate) fn count_probe_skip(&self, r: &PathRequest, path: Path) {
        if path == Path::Plan && r.may_probe() {
            self.probe.set(r.backoff.skipped());
        }
    }

    /// Runs the all-reduce `c` of `count` elements through the shared-memory lane ([`lane`])
    /// for `caller`.
    ///
    /// # Safety
    /// `c`'s buffers must be valid for the all-reduce (as `Communicator::prepare` checks).
    pub(crate) unsafe fn run_lane(&self, c: &Operands, count: usize, caller: Caller) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.dispatch(&mut LaneRun { call: c, count }, caller) }
    }

    /// Runs the all-reduce `c` of `count` elements through the host arena ([`arena`]) for
    /// `caller`;
    /// `probe`: first ask whether every rank's buffers are shareable. Returns whether the arena
    /// ran the call: false when the probe found a buffer that is not (every rank learns the same
    /// at the probe's barrier), and the caller runs the call's plan.
    ///
    /// # Safety
    /// As [`Communicator::run_lane`].
    pub(crate) unsafe fn run_arena(&self, c: &Operands, count: usize, probe: bool, caller: Caller) -> Result<bool> {
        // SAFETY: the caller's contract.
        unsafe { self.dispatch(&mut ArenaRun { call: c, count, probe }, caller) }
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
}

/// The name of a plan-less call in errors and the flight record.
const ALL_REDUCE: &str = "all_reduce";

/// The shared-memory lane as an [`Executor`]: a small all-reduce by recursive doubling
/// ([`lane`]).
struct LaneRun<'a> {
    call: &'a Operands,
    count: usize,
}

impl Executor for LaneRun<'_> {
    type Output = ();
    type Session<'c> = Session<'c>;

    #[inline(always)]
    fn what(&self) -> &str {
        ALL_REDUCE
    }

    #[inline(always)]
    fn desc(&self) -> mismatch::Desc {
        mismatch::Desc::single(Collective::AllReduce, self.count, self.call.dtype, self.call.op)
    }

    #[inline(always)]
    fn peers(&self, rank: usize, nranks: usize, out: &mut Vec<usize>) {
        out.clear();
        out.extend(lane::partners(rank, nranks));
    }

    #[inline(always)]
    unsafe fn run(&mut self, s: &mut Session<'_>) -> Result<()> {
        s.connect()?;
        s.count_call(|_, _| {});
        let comm = s.comm();
        let rank = comm.rank;
        let inner = s.inner();
        let peers = &inner.peers;
        let bufs = inner.lane.get_or_insert_with(|| {
            crate::info!(
                "rank {rank}: all-reduces of up to {} B take the shared-memory lane (partners {peers:?})",
                lane::MAX_BYTES
            );
            Default::default()
        });
        let ctx = comm.planless_ctx(&mut inner.links);
        let c = self.call;
        // SAFETY: the caller's contract.
        unsafe { lane::all_reduce(ctx, bufs, c.bufs.send, c.bufs.recv, self.count, c.dtype, c.op) }
    }
}

/// The host arena as an [`Executor`] ([`arena`]); its output is whether the arena ran the
/// call (a probe finds out whether every rank's buffers are shared first).
struct ArenaRun<'a> {
    call: &'a Operands,
    count: usize,
    probe: bool,
}

impl Executor for ArenaRun<'_> {
    type Output = bool;
    type Session<'c> = Session<'c>;

    fn what(&self) -> &str {
        ALL_REDUCE
    }

    fn desc(&self) -> mismatch::Desc {
        mismatch::Desc::single(Collective::AllReduce, self.count, self.call.dtype, self.call.op)
    }

    fn peers(&self, rank: usize, nranks: usize, out: &mut Vec<usize>) {
        out.clear();
        out.extend((0..nranks).filter(|&p| p != rank));
    }

    unsafe fn run(&mut self, s: &mut Session<'_>) -> Result<bool> {
        let comm = s.comm();
        let r = (|| {
            s.connect()?;
            s.count_call(|_, _| {});
            let inner = s.inner();
            let ctx = comm.planless_ctx(&mut inner.links);
            let c = self.call;
            // SAFETY: the caller's contract.
            unsafe {
                arena::all_reduce(
                    ctx,
                    &mut inner.arena,
                    c.bufs.send,
                    c.bufs.recv,
                    self.count,
                    c.dtype,
                    c.op,
                    self.probe,
                )
            }
        })();
        if self.probe && r.is_ok() {
            comm.probe.set(comm.probe.get().probed(matches!(r, Ok(true))));
        }
        r
    }
}
