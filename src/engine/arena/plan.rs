//! The host arena's executor of window plans ([`window::arena_all_reduce`]): where a plan's
//! memories lie in this process, one copy or fold, and the plans kept from call to call.

use crate::algo::window::{self, At, Mem, WindowPlan, WindowStep};
use crate::error::{Error, Result};
use crate::reduce;
use crate::transport::shm::arena::Arena;
use crate::types::{DataType, ReduceOp};

/// A call's plan, kept for the next call of the same shape: building one allocates per piece,
/// which small calls feel (about 2 µs per 1 KiB call on 4 ranks over 2 CPUs).
pub(super) struct Kept {
    /// Elements of the call.
    count: usize,
    /// Bytes per element.
    es: usize,
    /// Per rank: input shared, output shared.
    shares: Vec<(bool, bool)>,
    /// The plan.
    pub(super) plan: WindowPlan,
    /// The index of its first barrier (the number of ops when it has none).
    pub(super) first: usize,
    /// The index of its last barrier.
    pub(super) last: usize,
}

impl Kept {
    /// Rank `rank`'s plan of `count` elements of `es` bytes through slots of `slot` bytes,
    /// starting on half `h0`; validated in debug builds.
    pub(super) fn build(
        rank: usize,
        count: usize,
        es: usize,
        slot: usize,
        shares: Vec<(bool, bool)>,
        h0: usize,
    ) -> Result<Kept> {
        let n = shares.len();
        let plan = window::arena_all_reduce(rank, n, count, es, slot, &shares, h0);
        if cfg!(debug_assertions) {
            let len = count * es;
            let b = window::Bounds { input: len, output: len, areas: vec![slot, slot], nranks: n };
            window::validate(&plan, &b).map_err(|e| Error::internal(format!("rank {rank}: host arena plan: {e}")))?;
        }
        let first = plan.ops.iter().position(|o| matches!(o, WindowStep::Barrier)).unwrap_or(plan.ops.len());
        let last = plan.ops.iter().rposition(|o| matches!(o, WindowStep::Barrier)).unwrap_or(first);
        Ok(Kept { count, es, shares, plan, first, last })
    }

    /// Whether the ops before the first barrier are those of a call of `count` elements of
    /// `es` bytes where rank `rank` shares `own` (they depend on nothing else).
    pub(super) fn head_fits(&self, count: usize, es: usize, rank: usize, own: (bool, bool)) -> bool {
        self.count == count && self.es == es && self.shares.get(rank) == Some(&own)
    }

    /// Whether the plan is that of a call of `count` elements of `es` bytes with `shares`.
    pub(super) fn fits(&self, count: usize, es: usize, shares: impl Iterator<Item = (bool, bool)>) -> bool {
        self.count == count && self.es == es && self.shares.iter().copied().eq(shares)
    }
}

/// Where the memories of a call's plan lie in this process.
pub(super) struct Bufs {
    /// This rank.
    pub(super) rank: usize,
    /// The call's input.
    pub(super) send: *const u8,
    /// The call's output.
    pub(super) recv: *mut u8,
    /// Per rank, the address of its input in this process when shared.
    pub(super) send_at: Vec<Option<usize>>,
    /// Per rank, the address of its output in this process when shared.
    pub(super) recv_at: Vec<Option<usize>>,
}

impl Bufs {
    /// The address of `a` here: this rank's buffers, a peer's shared buffer mapped here, or a
    /// slot of the arena (area id = half).
    fn ptr(&self, arena: &Arena, a: &At) -> Result<*mut u8> {
        let peer = |at: &[Option<usize>], q: usize| {
            at.get(q).copied().flatten().map(|p| p as *mut u8).ok_or_else(|| {
                Error::internal(format!("rank {}: host arena plan: rank {q}'s buffer is not shared", self.rank))
            })
        };
        let base = match a.mem {
            Mem::Input(q) if q == self.rank => self.send.cast_mut(),
            Mem::Output(q) if q == self.rank => self.recv,
            Mem::Input(q) => peer(&self.send_at, q)?,
            Mem::Output(q) => peer(&self.recv_at, q)?,
            Mem::Area { rank, id } => arena.data(id, rank),
        };
        Ok(base.wrapping_add(a.off))
    }
}

/// Runs one copy or fold of a call's plan: a copy is a `memcpy`; a fold is
/// [`reduce::fold_ptrs`] (the left fold in rank order: `OXCCL_DETERMINISTIC`'s contract) into
/// its first destination, copied into the others.
///
/// # Safety
/// `step` is an op of the call's [`window::arena_all_reduce`] plan, run in order with the
/// plan's barriers, on the buffers of [`super::all_reduce`]'s contract (`count * dtype.size()`
/// bytes each) and the peers' shared buffers mapped for as many bytes. Its ranges lie inside
/// their memories (`window::validate`, run in debug builds), and between two barriers no byte a
/// rank writes is read or written by another rank (the simulation in `algo/window/tests.rs`
/// checks every shape); a fold's destination is either disjoint from its sources or one of
/// them (in place, this rank's input; `fold_ptrs` reads each block before it writes it).
pub(super) unsafe fn exec(
    arena: &Arena,
    bufs: &Bufs,
    step: &WindowStep,
    dtype: DataType,
    op: ReduceOp,
    srcs: &mut Vec<*const u8>,
) -> Result<()> {
    match step {
        WindowStep::Copy { from, to, len } => {
            let (s, d) = (bufs.ptr(arena, from)?, bufs.ptr(arena, to)?);
            if s != d {
                // SAFETY: the contract: both ranges inside their memories, disjoint (different
                // memories, or different bytes of one), nobody else touches them in this phase.
                unsafe { std::ptr::copy_nonoverlapping(s.cast_const(), d, *len) };
            }
        }
        WindowStep::Fold { from, to, len } => {
            srcs.clear();
            for a in from {
                srcs.push(bufs.ptr(arena, a)?.cast_const());
            }
            let Some((first, rest)) = to.split_first() else {
                return Err(Error::internal(format!(
                    "rank {}: host arena plan: a fold without destination",
                    bufs.rank
                )));
            };
            let dst = bufs.ptr(arena, first)?;
            // SAFETY: the contract (`fold_ptrs`'s: sources readable, the destination writable,
            // either one of the sources or disjoint from them, nothing else writing them).
            unsafe { reduce::fold_ptrs(dtype, op, dst, srcs, *len) };
            for t in rest {
                let d = bufs.ptr(arena, t)?;
                if d != dst {
                    // SAFETY: the fold's result into another destination of the fold (a
                    // different memory: the output and this rank's slot).
                    unsafe { std::ptr::copy_nonoverlapping(dst.cast_const(), d, *len) };
                }
            }
        }
        WindowStep::Scale { .. } | WindowStep::Barrier => {
            return Err(Error::internal(format!("rank {}: host arena plan: unexpected {step:?}", bufs.rank)));
        }
    }
    Ok(())
}
