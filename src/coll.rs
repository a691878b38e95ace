//! Collective calls on host buffers: checking a call, and building its plan ([`Op`]). The
//! raw-pointer entry points that check and run one call are in `crate::group` (`raw.rs`).
//!
//! A call is checked (ranks in range, buffers present where NCCL says they matter, sizes that
//! fit the address space, buffers that overlap only in NCCL's in-place layout), then
//! [`algo::select()`] picks its route (a plan-less path, a special plan, or the cost model's
//! algorithm and chunk size) and `algo` builds this rank's plan. The result is an [`Op`]: run it
//! at once ([`Communicator::run`]) or collect it in a group ([`crate::call::Batch`]).

use crate::algo::select::{Path, PlanInputs};
use crate::algo::{self, tuning, Collective, Plan};
use crate::comm::{byte_len, Caller, Communicator};
use crate::engine::{Buffers, Operands};
use crate::error::{Error, Result};
use crate::mismatch;
use crate::types::{DataType, ReduceOp};
use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::Mutex;

/// One checked collective call of one rank, ready to run: its plan and buffers. `'a` is the
/// lifetime of the buffers it borrows.
pub struct Op<'a> {
    pub(crate) coll: Collective,
    pub(crate) plan: Arc<Plan>,
    pub(crate) call: Operands,
    /// NCCL's count argument (for the operation's signature, [`crate::mismatch`]).
    pub(crate) count: usize,
    /// Whether the call runs without a plan of its own (the lane or the arena:
    /// [`crate::algo::select::path`]); its `plan` is then empty until the call joins a group
    /// of several operations ([`Communicator::planned`]).
    pub(crate) planless: bool,
    /// A PreMulSum call's pre-scaled copy of this rank's send buffer (`call.bufs.send` points
    /// into it), owned by the op so that it lives until the op has run
    /// ([`crate::call::premul`]).
    pub(crate) scaled: Option<Vec<u64>>,
    _bufs: PhantomData<&'a mut [u8]>,
}

// SAFETY: an `Op` only carries the addresses of buffers that its creator guaranteed to stay
// valid and otherwise untouched for `'a`; running it on another thread within `'a` (a scoped
// thread of a group) is as sound as running it on this one.
unsafe impl Send for Op<'_> {}

impl std::fmt::Debug for Op<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Op({:?}, {} steps)", self.coll, self.plan.nodes.len())
    }
}

impl Op<'_> {
    /// The collective this call runs.
    pub fn collective(&self) -> Collective {
        self.coll
    }
}

/// Logs a tuning decision at INFO, once per distinct decision in the process.
fn log_choice(
    rank: usize,
    n: usize,
    coll: Collective,
    bytes: usize,
    kind: tuning::TransportKind,
    label: &'static str,
    c: &tuning::Choice,
) {
    if crate::log::level() < crate::log::Level::Info {
        return;
    }
    /// (collective, bytes, ranks, algorithm) already logged.
    type Seen = HashSet<(&'static str, usize, usize, &'static str)>;
    static SEEN: Mutex<Option<Seen>> = Mutex::new(None);
    let mut seen = crate::sync::lock(&SEEN);
    let set = seen.get_or_insert_with(HashSet::new);
    if set.len() > 4096 || !set.insert((coll.name(), bytes, n, label)) {
        return;
    }
    drop(seen);
    crate::info!(
        "rank {rank}: {} of {bytes} B on {n} ranks over {}: algorithm {}, chunk {} KiB, predicted {:.1} us",
        coll.name(),
        kind.name(),
        label,
        c.chunk >> 10,
        c.predicted_us
    );
}

use crate::algo::select::Route;

/// Debug builds: checks a freshly built plan with [`algo::validate`] (steps writing the same
/// bytes must be ordered), so that a builder bug fails at once instead of racing in the
/// engine. Plans of more than 4096 steps are skipped (the check is quadratic at worst).
fn debug_validate(plan: &Plan, coll: Collective, in_place: bool) {
    if cfg!(debug_assertions) && plan.nodes.len() <= 4096 {
        let layout = algo::validate::layout(coll, in_place);
        if let Err(e) = algo::validate::check(plan, &|_| layout) {
            panic!("{} plan breaks the engine's invariant: {e}", coll.name());
        }
    }
}

/// The bytes of one rank's block of `count` elements of `dtype`, or `ncclInvalidArgument` when
/// that block, or `n` of them, would not fit the address space.
fn check_len(count: usize, dtype: DataType, n: usize) -> Result<usize> {
    let blk = byte_len(count, dtype)?;
    if blk.checked_mul(n).is_none_or(|t| t > isize::MAX as usize) {
        return Err(Error::invalid_argument(format!("count {count} times {n} ranks overflows the address space")));
    }
    Ok(blk)
}

/// `ncclInvalidArgument` when a buffer the call uses (a non-zero length) is NULL.
fn check_null(b: &Buffers, count: usize) -> Result<()> {
    if b.send.is_null() && b.send_len > 0 {
        return Err(Error::invalid_argument(format!("sendbuff is NULL with count {count}")));
    }
    if b.recv.is_null() && b.recv_len > 0 {
        return Err(Error::invalid_argument(format!("recvbuff is NULL with count {count}")));
    }
    Ok(())
}

/// `ncclInvalidArgument` when the engine's two buffers share bytes without being one buffer
/// (after NCCL's in-place layouts were mapped to one).
fn check_overlap(b: &Buffers) -> Result<()> {
    if !std::ptr::eq(b.send, b.recv) && overlaps(b.send as usize, b.send_len, b.recv as usize, b.recv_len) {
        return Err(Error::invalid_argument("sendbuff and recvbuff overlap, but not in NCCL's in-place layout"));
    }
    Ok(())
}

/// Whether `[a, a+la)` and `[b, b+lb)` share a byte.
pub(crate) fn overlaps(a: usize, la: usize, b: usize, lb: usize) -> bool {
    la > 0 && lb > 0 && a < b.saturating_add(lb) && b < a.saturating_add(la)
}

impl Communicator {
    /// Runs the all-reduce `c` of `count` elements for `caller` on the plan-less `path` ([`crate::algo::select::path`]'s
    /// answer for it: [`Path::Lane`] or [`Path::Arena`], the arena falling back to the call's
    /// plan when its probe finds a buffer that is not shared; [`Path::Plan`], which a call
    /// prepared for the lane meets when the settings changed before it ran, builds and runs its
    /// plan).
    ///
    /// # Safety
    /// `c`'s buffers must be valid for the all-reduce (as `Communicator::prepare` checks).
    pub(crate) unsafe fn run_planless(&self, c: &Operands, count: usize, path: Path, caller: Caller) -> Result<()> {
        match path {
            // SAFETY: the caller's contract.
            Path::Lane => unsafe { self.run_lane(c, count, caller) },
            // SAFETY: the caller's contract.
            Path::Arena { probe } => match unsafe { self.run_arena(c, count, probe, caller)? } {
                true => Ok(()),
                // SAFETY: the caller's contract.
                false => unsafe { self.run_plan(c, count, caller) },
            },
            // SAFETY: the caller's contract.
            Path::Plan => unsafe { self.run_plan(c, count, caller) },
        }
    }

    /// Runs the all-reduce `c` of `count` elements on its plan for `caller`.
    ///
    /// # Safety
    /// As [`Communicator::run_planless`].
    unsafe fn run_plan(&self, c: &Operands, count: usize, caller: Caller) -> Result<()> {
        const WHAT: &str = "all_reduce";
        let desc = mismatch::Desc::single(Collective::AllReduce, count, c.dtype, c.op);
        let in_place = std::ptr::eq(c.bufs.send, c.bufs.recv);
        let plan = self
            .plan_for(Collective::AllReduce, count, c.dtype, c.op, in_place)
            .map_err(|e| self.record(e.context(WHAT)))?;
        // SAFETY: the caller's contract.
        unsafe { self.execute(WHAT, &desc, &plan, std::slice::from_ref(c), caller) }
    }

    /// Checks a call and builds this rank's plan for it.
    ///
    /// `count` is NCCL's count argument (per rank: all-gather's `sendcount`, reduce-scatter's
    /// `recvcount`, all-to-all's per-peer count). Buffers that the collective does not use on
    /// this rank (the send buffer of a non-root broadcast rank, the receive buffer of a
    /// non-root reduce or gather rank, ...) may be NULL. `op` is ignored by collectives that
    /// do not reduce.
    ///
    /// # Safety
    /// For the lifetime `'a` of the returned op, `send` must be readable and `recv` writable
    /// for the sizes the collective uses (see [`Collective::buffer_counts`]), and nothing else
    /// may access them while it runs; they may overlap only in NCCL's in-place layout.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn prepare<'a>(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Op<'a>> {
        self.prepare_inner(coll, send, recv, count, dtype, op).map_err(|e| self.record(e.context(coll.name())))
    }

    /// Checks a call on its addresses (ranks and peers in range, lengths, buffers present,
    /// overlap outside NCCL's in-place layouts) without building a plan: for calls that another
    /// executor runs (device buffers). Errors are recorded like [`Communicator::prepare`]'s.
    pub(crate) fn check_call(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        self.check_args(coll, send, recv, count, dtype).map(drop).map_err(|e| self.record(e.context(coll.name())))
    }

    /// The checks of a call; returns the engine's buffers (NCCL's in-place layouts mapped to one
    /// buffer), whether the call is in place, and the bytes of one rank's block.
    pub(crate) fn check_args(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
    ) -> Result<(Buffers, bool, usize)> {
        let (rank, n) = (self.rank(), self.size());
        if let Some(r) = coll.rank_arg() {
            if r >= n {
                let what =
                    if matches!(coll, Collective::Send { .. } | Collective::Recv { .. }) { "peer" } else { "root" };
                return Err(Error::invalid_argument(format!("{what} {r} is out of range for {n} ranks")));
            }
        }
        let blk = check_len(count, dtype, n)?;
        let (sc, rc) = coll.buffer_counts(rank, n, count);
        let (send_len, recv_len) = (sc * dtype.size(), rc * dtype.size());
        check_null(&Buffers { send, send_len, recv, recv_len }, count)?;
        let (s, r) = (send as usize, recv as usize);
        let mine = rank * blk;
        let at_root = |root: usize| rank == root;
        // NCCL's in-place layouts; afterwards the engine sees one buffer as both send and recv.
        let one = |base: usize, len: usize| Buffers {
            send: base as *const u8,
            send_len: len,
            recv: base as *mut u8,
            recv_len: len,
        };
        let (bufs, in_place) = match coll {
            _ if blk == 0 => (Buffers { send, send_len, recv, recv_len }, false),
            Collective::AllGather if s == r.wrapping_add(mine) => (one(r, recv_len), true),
            Collective::ReduceScatter if r == s.wrapping_add(mine) => (one(s, send_len), true),
            Collective::Gather { root } if at_root(root) && s == r.wrapping_add(mine) => (one(r, recv_len), true),
            Collective::Scatter { root } if at_root(root) && r == s.wrapping_add(mine) => (one(s, send_len), true),
            Collective::AllReduce | Collective::AllToAll | Collective::Broadcast { .. } | Collective::Reduce { .. }
                if s == r =>
            {
                (Buffers { send, send_len, recv, recv_len }, send_len > 0 && recv_len > 0)
            }
            _ => (Buffers { send, send_len, recv, recv_len }, false),
        };
        check_overlap(&bufs)?;
        Ok((bufs, in_place, blk))
    }

    fn prepare_inner<'a>(
        &self,
        coll: Collective,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Op<'a>> {
        let (bufs, in_place, _) = self.check_args(coll, send, recv, count, dtype)?;
        let rank = self.rank();
        let req = self.path_request(coll, count, dtype, false);
        let path = algo::select::path(&req);
        self.count_probe_skip(&req, path);
        let planless = path.planless();
        let plan = match coll {
            // A message to oneself becomes a copy when its group ends.
            Collective::Send { peer } | Collective::Recv { peer } if peer == rank => Arc::new(Plan::default()),
            _ if planless => self.fixed.no_plan.clone(),
            _ => self.plan_for(coll, count, dtype, op, in_place)?,
        };
        Ok(Op { coll, plan, call: Operands { bufs, dtype, op }, count, planless, scaled: None, _bufs: PhantomData })
    }

    /// `op` as one operation of a group that merges it with others: with its plan built if it
    /// was prepared for a plan-less path (a grouped call runs a plan, [`algo::select::path`]).
    pub(crate) fn planned<'a>(&self, mut op: Op<'a>) -> Result<Op<'a>> {
        let c = &op.call;
        let grouped = algo::select::path(&self.path_request(op.coll, op.count, c.dtype, true));
        if op.planless && grouped == algo::select::Path::Plan {
            let in_place = std::ptr::eq(c.bufs.send, c.bufs.recv);
            op.plan = self.plan_for(op.coll, op.count, c.dtype, c.op, in_place)?;
            op.planless = false;
        }
        Ok(op)
    }

    /// The algorithm and chunk size this communicator would use for `coll` on `count`
    /// elements of `dtype` (its settings, its [`crate::config::Config`], then the cost model).
    pub fn tuning_choice(&self, coll: Collective, count: usize, dtype: DataType) -> tuning::Choice {
        algo::select::tuned(&self.request(coll, count, dtype, ReduceOp::Sum))
    }

    /// What [`algo::select`] needs to know about a call on this communicator.
    fn request(&self, coll: Collective, count: usize, dtype: DataType, op: ReduceOp) -> algo::Request {
        let ov = self.tuning();
        algo::Request {
            coll,
            bytes: count.saturating_mul(dtype.size()),
            nranks: self.size(),
            transport: self.transport(),
            allowed: ov.algos.or(self.config.algos),
            chunk: ov.chunk.or(self.config.chunk),
            exact: algo::oneshot::exact_commutative(dtype, op),
            oneshot_bytes: self.config.oneshot_bytes,
            hierarchical: self.fixed.hier_groups.is_some(),
            crowded: self.fixed.crowded,
            deterministic: self.deterministic(),
            compress: self.compression(),
            compressible: dtype == DataType::Float32 && matches!(op, ReduceOp::Sum | ReduceOp::Avg),
            hosts: self.fixed.hosts,
        }
    }

    /// What a call runs (`plan_for` builds the plan for this route), as [`algo::select()`]
    /// chooses it: one of all-reduce's special paths ahead of the cost model (unless
    /// `OXCCL_ALGO`, `NCCL_ALGO` or [`Communicator::set_tuning`] forces algorithms), or the
    /// cost model's choice. oxccl-perf labels its `auto` rows with it.
    pub fn route(&self, coll: Collective, count: usize, dtype: DataType, op: ReduceOp) -> Route {
        algo::select(&self.request(coll, count, dtype, op))
    }

    /// Chooses the algorithm and chunk size of a call and builds this rank's plan (cached per
    /// call shape, so a repeated call does not rebuild it).
    ///
    /// All-reduce has two special paths ahead of the cost model: two ranks and a small message
    /// whose reduction is exact and commutative take the one-shot exchange (`OXCCL_ONESHOT_BYTES`);
    /// ranks spread over several hosts with some sharing one take the hierarchical plan.
    ///
    /// The last call shape's plan is remembered: a loop repeating one call skips the choice
    /// (cost model) and the cache lookup.
    pub(crate) fn plan_for(
        &self,
        coll: Collective,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        in_place: bool,
    ) -> Result<Arc<Plan>> {
        let key = (coll, count, dtype, op, in_place);
        let mut last = crate::sync::lock(&self.last_plan);
        if let Some((k, p)) = last.as_ref() {
            if *k == key {
                return Ok(p.clone());
            }
        }
        let plan = self.choose_plan(coll, count, dtype, op, in_place)?;
        *last = Some((key, plan.clone()));
        Ok(plan)
    }

    /// Builds (or finds in the cache) the plan of the route [`algo::select()`] chooses, with
    /// the recipe [`algo::select::recipe`] makes of it; logs the choice.
    fn choose_plan(
        &self,
        coll: Collective,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        in_place: bool,
    ) -> Result<Arc<Plan>> {
        let (rank, n) = (self.rank(), self.size());
        let req = self.request(coll, count, dtype, op);
        let route = algo::select(&req);
        let inputs = PlanInputs {
            rank,
            count,
            elem: dtype.size(),
            in_place,
            ring: self.ring_order(),
            groups: &self.fixed.groups,
            hier_groups: self.fixed.hier_groups.as_deref(),
        };
        let recipe = algo::select::recipe(&req, route, &inputs)
            .ok_or_else(|| Error::internal(format!("{} route without host groups", route.name())))?;
        if let Some((label, bytes, c)) = &recipe.choice {
            log_choice(rank, n, coll, *bytes, self.transport(), label, c);
        }
        let (note, tuned, build) = (recipe.note, recipe.tuned, recipe.build);
        let mut built = None;
        let plan = self.plans.get(recipe.key, || {
            if let Some(note) = note {
                crate::info!("rank {rank}: {}", note.text(coll, count));
            }
            let p = build();
            built = Some(p.is_some());
            let p = p.unwrap_or_default();
            if tuned {
                debug_validate(&p, coll, in_place);
            }
            p
        });
        if built == Some(false) {
            return Err(Error::internal(format!("no {} plan for {}", route.name(), coll.name())));
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::tuning::{Algo, AlgoSet, Overrides};

    #[test]
    fn route_is_what_plan_for_runs() {
        let comms = Communicator::in_memory(2);
        let c = &comms[0];
        let ar = Collective::AllReduce;
        // Two ranks, small, exact and commutative: the one-shot exchange, ahead of the model.
        assert_eq!(c.route(ar, 16, DataType::Float32, ReduceOp::Sum), Route::OneShot);
        // Above OXCCL_ONESHOT_BYTES, or a float max (operand order may show): the model.
        let big = c.config().oneshot_bytes / 4 + 1;
        let tuned = Route::Tuned(c.tuning_choice(ar, big, DataType::Float32));
        assert_eq!(c.route(ar, big, DataType::Float32, ReduceOp::Sum), tuned);
        assert!(matches!(c.route(ar, 16, DataType::Float32, ReduceOp::Max), Route::Tuned(_)));
        // Forcing an algorithm turns the special paths off.
        c.set_tuning(Overrides { algos: Some(AlgoSet::only(Algo::Tree)), ..Default::default() });
        let r = c.route(ar, 16, DataType::Float32, ReduceOp::Sum);
        assert!(matches!(r, Route::Tuned(ch) if ch.algo == Algo::Tree), "{r:?}");
        assert_eq!(r.name(), "tree");
        // Three ranks: the model's choice; other collectives never take the special paths.
        let three = Communicator::in_memory(3);
        let r = three[0].route(ar, 16, DataType::Float32, ReduceOp::Sum);
        assert_eq!(r, Route::Tuned(three[0].tuning_choice(ar, 16, DataType::Float32)));
        let b = Collective::Broadcast { root: 0 };
        assert!(matches!(comms[1].route(b, 16, DataType::Float32, ReduceOp::Sum), Route::Tuned(_)));
    }

    #[test]
    fn a_communicator_takes_its_own_config_over_the_environment() {
        let ar = Collective::AllReduce;
        let cfg = crate::config::Config { oneshot_bytes: 0, ..Default::default() };
        let comms = Communicator::in_memory_with_config(2, cfg);
        assert!(matches!(comms[0].route(ar, 16, DataType::Float32, ReduceOp::Sum), Route::Tuned(_)));
        let cfg =
            crate::config::Config { algos: Some(AlgoSet::only(Algo::Ring)), chunk: Some(4096), ..Default::default() };
        let comms = Communicator::in_memory_with_config(2, cfg);
        let r = comms[1].route(ar, 16, DataType::Float32, ReduceOp::Sum);
        assert!(matches!(r, Route::Tuned(ch) if ch.algo == Algo::Ring && ch.chunk == 4096), "{r:?}");
        // The settings of set_tuning still come first.
        comms[1].set_tuning(Overrides { algos: Some(AlgoSet::only(Algo::Tree)), ..Default::default() });
        let r = comms[1].route(ar, 16, DataType::Float32, ReduceOp::Sum);
        assert!(matches!(r, Route::Tuned(ch) if ch.algo == Algo::Tree && ch.chunk == 4096), "{r:?}");
    }
}
