//! Window plans: collectives over memory that every rank can load and store (the host arena's
//! shared pages, the CUDA IPC regions, and user buffers that the peers have mapped).
//!
//! A message plan ([`super::Plan`]) sends and receives; a window plan reads and writes the
//! window directly and synchronises with barriers. For one rank it is a list of [`WindowStep`]s run in
//! order: copies, folds (an element-wise reduction of several sources written to several
//! destinations) and barriers (every rank arrives, then waits for all). Between two barriers
//! ("a phase") no byte that one rank writes is read or written by another rank; the executors
//! rely on that, and the tests check it for every plan made here (`window/tests.rs` runs all
//! ranks' plans on host memory, phase by phase, with an order-sensitive fold, so they also
//! check that every rank folds in rank order and gets the same bits).
//!
//! Executors: the device executor (`crate::device::window`) runs every op on the caller's or the
//! communicator's stream (a copy, one kernel per fold, barriers of stream memory operations);
//! the host arena (`crate::engine::arena`) runs [`arena_all_reduce`] with `memcpy`,
//! `reduce::fold_ptrs` (into a fold's first destination, then copies) and the arena's
//! barriers, with the arena's two halves as areas 0 and 1.
//!
//! The plans:
//! - [`all_reduce_direct`]: the inputs and outputs of every rank are mapped by every rank.
//!   Rank r folds its segment of every input and writes it into every output: 2nS bytes of
//!   traffic for n ranks and S bytes, the least an all-reduce over shared memory can move
//!   (each input read once, each output written once). Two barriers.
//! - [`all_reduce_staged`]: only window areas are shared. Per chunk: copy the input into my
//!   input area; barrier; fold my segment of every rank's input area into every rank's result
//!   area; barrier; copy my result area out.
//! - [`all_reduce_small`]: one barrier: copy in, barrier, every rank folds every rank's slot;
//!   [`all_reduce_small_captured`] for calls captured into CUDA graphs (own slot, closing
//!   barrier).
//! - [`arena_all_reduce`]: the host arena's schedule: pieces of one slot per rank alternating
//!   between two areas, cache-line slices, staged through the slots except where a rank's
//!   input or output is shared; two barriers per piece, a closing one when anything is shared.
//! - [`collective`]: the one-shot flows of broadcast, reduce, all-gather, reduce-scatter,
//!   all-to-all, gather and scatter through the input areas;
//! - [`exchange::plan`]: the send/receive exchange, in rounds with pair barriers.

use super::Collective;

pub mod exchange;

/// The input area of a rank's window (staged copies of its input).
pub const INPUT_AREA: usize = 0;
/// The result area of a rank's window (segments the peers reduced for it).
pub const RESULT_AREA: usize = 1;
/// The first of the two small-message slots (parity 0; parity 1 is the next id).
pub const SMALL_AREA: usize = 2;
/// The small-message slot of calls captured into CUDA graphs (never used by other calls).
pub const CAPTURE_AREA: usize = 4;

/// Which memory of which rank an address lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mem {
    /// A rank's send buffer (as the call passed it).
    Input(usize),
    /// A rank's receive buffer.
    Output(usize),
    /// Area `id` of a rank's window.
    Area {
        /// The rank whose window it is.
        rank: usize,
        /// Which area ([`INPUT_AREA`], [`RESULT_AREA`], [`SMALL_AREA`] + parity; the host
        /// arena's slot halves).
        id: usize,
    },
}

/// A byte address in the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct At {
    /// The memory.
    pub mem: Mem,
    /// Byte offset in it.
    pub off: usize,
}

impl At {
    /// `off` bytes into rank `q`'s input.
    pub const fn input(q: usize, off: usize) -> At {
        At { mem: Mem::Input(q), off }
    }
    /// `off` bytes into rank `q`'s output.
    pub const fn output(q: usize, off: usize) -> At {
        At { mem: Mem::Output(q), off }
    }
    /// `off` bytes into area `id` of rank `q`'s window.
    pub const fn area(q: usize, id: usize, off: usize) -> At {
        At { mem: Mem::Area { rank: q, id }, off }
    }
}

/// One step of a rank's window plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowStep {
    /// Copies `len` bytes (nothing when `from` and `to` are the same bytes).
    Copy {
        /// Source.
        from: At,
        /// Destination.
        to: At,
        /// Bytes.
        len: usize,
    },
    /// Multiplies `len` bytes in place by the call's PreMulSum factor.
    Scale {
        /// Where.
        at: At,
        /// Bytes.
        len: usize,
    },
    /// Writes into every `to` the element-wise fold of the `from` ranges in their order (the
    /// left fold: `((f0 op f1) op f2) ...`; an average divides by `from.len()` at the end).
    /// Each `to` range is either disjoint from every `from` range or the same bytes as one of
    /// them (in place: every element is read before it is written).
    Fold {
        /// The sources, in fold order.
        from: Vec<At>,
        /// The destinations.
        to: Vec<At>,
        /// Bytes of each range.
        len: usize,
    },
    /// Every rank arrives, then waits until all ranks have arrived.
    Barrier,
}

/// One rank's window plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WindowPlan {
    /// The steps, in order.
    pub ops: Vec<WindowStep>,
}

impl WindowPlan {
    /// Barriers in the plan (every rank's plan of one call has the same number).
    pub fn barriers(&self) -> usize {
        self.ops.iter().filter(|o| matches!(o, WindowStep::Barrier)).count()
    }
}

/// Element ranges `(first, len)` of `n` segments of `count` elements, each starting on a
/// multiple of `align` elements (so 16-byte vector loads stay aligned when the buffers are);
/// the last segments may be empty.
pub fn segments(count: usize, n: usize, align: usize) -> Vec<(usize, usize)> {
    let align = align.max(1);
    let per = count.div_ceil(n.max(1)).div_ceil(align) * align;
    (0..n)
        .map(|q| {
            let lo = (q * per).min(count);
            (lo, ((q + 1) * per).min(count) - lo)
        })
        .collect()
}

/// Elements per 16 bytes: the segment alignment of the all-reduce plans.
pub fn align16(elem: usize) -> usize {
    (16 / elem.max(1)).max(1)
}

/// The direct all-reduce of rank `rank` of `n`: `count` elements of `elem` bytes, every rank's
/// input and output mapped here. Barrier; fold my segment of every input into every output;
/// barrier (nobody leaves while a peer may still read its input or write its output).
pub fn all_reduce_direct(rank: usize, n: usize, count: usize, elem: usize) -> WindowPlan {
    let (first, len) = segments(count, n, align16(elem))[rank];
    let mut ops = vec![WindowStep::Barrier];
    if len > 0 {
        let off = first * elem;
        ops.push(WindowStep::Fold {
            from: (0..n).map(|q| At::input(q, off)).collect(),
            to: (0..n).map(|q| At::output(q, off)).collect(),
            len: len * elem,
        });
    }
    ops.push(WindowStep::Barrier);
    WindowPlan { ops }
}

/// The staged all-reduce of rank `rank` of `n` through input and result areas of `area` bytes
/// each: chunks of at most `area` bytes, two barriers per chunk. Per chunk: copy the input in;
/// barrier; fold my segment of every rank's input area into every rank's result area;
/// barrier; copy my result area out. The fold's addresses depend only on the segment, not on
/// the call's buffers or the chunk, so a device table made for it serves every call.
///
/// A peer's result area is written only between the two barriers of a chunk, and read by its
/// owner after the second; its input area is written by its owner before the first barrier
/// and read between them. So the next chunk's writes (before its first barrier) cannot touch
/// what a peer still reads.
pub fn all_reduce_staged(rank: usize, n: usize, count: usize, elem: usize, area: usize) -> WindowPlan {
    let chunk = (area / elem).max(1);
    let mut ops = Vec::new();
    let mut first = 0;
    while first < count {
        let c = chunk.min(count - first);
        let (at, len) = (first * elem, c * elem);
        ops.push(WindowStep::Copy { from: At::input(rank, at), to: At::area(rank, INPUT_AREA, 0), len });
        ops.push(WindowStep::Barrier);
        let (s0, seg) = segments(c, n, align16(elem))[rank];
        if seg > 0 {
            let off = s0 * elem;
            ops.push(WindowStep::Fold {
                from: (0..n).map(|q| At::area(q, INPUT_AREA, off)).collect(),
                to: (0..n).map(|q| At::area(q, RESULT_AREA, off)).collect(),
                len: seg * elem,
            });
        }
        ops.push(WindowStep::Barrier);
        ops.push(WindowStep::Copy { from: At::area(rank, RESULT_AREA, 0), to: At::output(rank, at), len });
        first += c;
    }
    WindowPlan { ops }
}

/// The small all-reduce of rank `rank` of `n` as call parity `parity` (0 or 1): copy the input
/// into my small slot of that parity, barrier, fold every rank's slot into my output.
///
/// No closing barrier: a slot of one parity is written again two calls later, by which time
/// every peer has started the call in between, which it does only after finishing this one
/// (its reads of the slot included), and the writer waits for that at the in-between call's
/// barrier.
pub fn all_reduce_small(rank: usize, n: usize, count: usize, elem: usize, parity: usize) -> WindowPlan {
    let (len, id) = (count * elem, SMALL_AREA + (parity & 1));
    WindowPlan {
        ops: vec![
            WindowStep::Copy { from: At::input(rank, 0), to: At::area(rank, id, 0), len },
            WindowStep::Barrier,
            WindowStep::Fold { from: (0..n).map(|q| At::area(q, id, 0)).collect(), to: vec![At::output(rank, 0)], len },
        ],
    }
}

/// The small all-reduce of a call captured into a CUDA graph: through its own slot
/// ([`CAPTURE_AREA`], which no other kind of call uses), with a closing barrier. A graph may be
/// launched at any point of the communicator's sequence of calls, so the parity rule of
/// [`all_reduce_small`] cannot hold for it; the closing barrier makes every rank's fold of the
/// slot finish before any rank writes it again (the next replay).
pub fn all_reduce_small_captured(rank: usize, n: usize, count: usize, elem: usize) -> WindowPlan {
    let len = count * elem;
    WindowPlan {
        ops: vec![
            WindowStep::Copy { from: At::input(rank, 0), to: At::area(rank, CAPTURE_AREA, 0), len },
            WindowStep::Barrier,
            WindowStep::Fold {
                from: (0..n).map(|q| At::area(q, CAPTURE_AREA, 0)).collect(),
                to: vec![At::output(rank, 0)],
                len,
            },
            WindowStep::Barrier,
        ],
    }
}

/// Slice alignment of the host arena's all-reduce ([`arena_all_reduce`]), bytes: a cache line,
/// so that no two ranks write into one line of a slot or an output.
pub const ARENA_ALIGN: usize = 64;

/// Pieces of the host arena's all-reduce of `count` elements of `elem` bytes through slots of
/// `slot` bytes ([`arena_all_reduce`]): the call's first piece uses the half it is given, the
/// next call's first piece the half after its last.
pub fn arena_pieces(count: usize, elem: usize, slot: usize) -> usize {
    count.div_ceil((slot / elem.max(1)).max(1))
}

/// The host arena's all-reduce of rank `rank` of `n`: `count` elements of `elem` bytes in
/// pieces of at most `slot` bytes per rank, alternating between the arena's two halves (area
/// ids 0 and 1, from `first_half`). `shared[q]`: whether rank `q`'s input and output are mapped
/// by every rank (read where they lie) rather than staged through its slot.
///
/// Per piece, cut into [`ARENA_ALIGN`]-aligned slices ([`segments`]): copy the others' slices
/// of my input into my slot (unless my input is shared); barrier; fold my slice of every rank's
/// input (my own where it lies, a peer's shared input, else its slot) in rank order into my
/// output, and into my slot unless my output is shared; barrier; copy the others' slices out of
/// their slots (or their shared outputs). A closing barrier when any buffer is shared: nobody
/// leaves while another rank may still read its buffers. Per rank and piece of m elements with
/// a slice of s: (m - s) copied in, n s folded from, s (or 2 s) written, m - s copied out.
///
/// Reuse of the halves: rank r writes half h for piece k + 2 only before the first barrier of
/// that piece, after it passed the first barrier of piece k + 1, which every rank reaches only
/// after it copied piece k's results out of half h; across calls the same holds, as the next
/// call starts on the other half than this one's last piece.
///
/// The ops before the first barrier depend only on `shared[rank]` (and the first piece), so an
/// executor can run them before it has learnt how the peers share.
pub fn arena_all_reduce(
    rank: usize,
    n: usize,
    count: usize,
    elem: usize,
    slot: usize,
    shared: &[(bool, bool)],
    first_half: usize,
) -> WindowPlan {
    assert_eq!(shared.len(), n, "one sharing entry per rank");
    let per_piece = (slot / elem.max(1)).max(1);
    let align = (ARENA_ALIGN / elem.max(1)).max(1);
    let (in_shared, out_shared) = shared[rank];
    let mut ops = Vec::new();
    let (mut start, mut h) = (0, first_half & 1);
    while start < count {
        let m = per_piece.min(count - start);
        let seg = segments(m, n, align);
        // Byte offset of element `i` of the piece in the call's buffers.
        let at = |i: usize| (start + i) * elem;
        let (lo, len) = seg[rank];
        if !in_shared {
            for (a, b) in [(0, lo), (lo + len, m)] {
                if a < b {
                    ops.push(WindowStep::Copy {
                        from: At::input(rank, at(a)),
                        to: At::area(rank, h, a * elem),
                        len: (b - a) * elem,
                    });
                }
            }
        }
        ops.push(WindowStep::Barrier);
        if len > 0 {
            let from = (0..n)
                .map(|q| if q == rank || shared[q].0 { At::input(q, at(lo)) } else { At::area(q, h, lo * elem) })
                .collect();
            let mut to = vec![At::output(rank, at(lo))];
            if !out_shared {
                to.push(At::area(rank, h, lo * elem));
            }
            ops.push(WindowStep::Fold { from, to, len: len * elem });
        }
        ops.push(WindowStep::Barrier);
        for q in (0..n).filter(|&q| q != rank) {
            let (lo, len) = seg[q];
            if len > 0 {
                let from = if shared[q].1 { At::output(q, at(lo)) } else { At::area(q, h, lo * elem) };
                ops.push(WindowStep::Copy { from, to: At::output(rank, at(lo)), len: len * elem });
            }
        }
        start += m;
        h ^= 1;
    }
    if shared.iter().any(|&(i, o)| i || o) && count > 0 {
        ops.push(WindowStep::Barrier);
    }
    WindowPlan { ops }
}

/// The one-shot flow of `coll` (broadcast, reduce, all-gather, reduce-scatter, all-to-all,
/// gather, scatter) on rank `rank` of `n`, `count` elements of `elem` bytes, through input
/// areas of `area` bytes, which must hold one element per staged block (else the plan is
/// empty). Per chunk: stage what the peers need into my input area (and, with `scaled`, apply
/// the PreMulSum factor to it); barrier; pull or fold from the peers' input areas; barrier.
/// Every rank's plan has the same number of chunks, at least one for a non-empty call.
pub fn collective(
    coll: Collective,
    rank: usize,
    n: usize,
    count: usize,
    elem: usize,
    area: usize,
    scaled: bool,
) -> WindowPlan {
    let c_max = area / (super::select::oneshot_blocks(coll, n) * elem);
    let mut ops = Vec::new();
    if c_max == 0 {
        return WindowPlan { ops };
    }
    let mut first = 0;
    while first < count {
        let c = c_max.min(count - first);
        let chunk = Chunk { rank, n, at: first * elem, len: c * elem, blk: count * elem, scaled };
        chunk.steps(coll, &mut ops);
        first += c;
    }
    WindowPlan { ops }
}

/// One chunk of a one-shot window collective ([`collective`]) on one rank: bytes `at..at+len`
/// of each rank's block of `blk` bytes.
#[derive(Clone, Copy)]
struct Chunk {
    rank: usize,
    n: usize,
    at: usize,
    len: usize,
    blk: usize,
    scaled: bool,
}

impl Chunk {
    /// Appends the chunk's steps: stage this rank's input into its input area, a barrier, the
    /// copies and folds out of the areas, a barrier.
    fn steps(&self, coll: Collective, ops: &mut Vec<WindowStep>) {
        let Chunk { rank, n, at, len, blk, scaled } = *self;
        let stage = |ops: &mut Vec<WindowStep>, from: usize, to: usize| {
            ops.push(WindowStep::Copy { from: At::input(rank, from), to: At::area(rank, INPUT_AREA, to), len });
            if scaled {
                ops.push(WindowStep::Scale { at: At::area(rank, INPUT_AREA, to), len });
            }
        };
        let mut post = Vec::new();
        let pull = |q: usize, from: usize, to: usize| WindowStep::Copy {
            from: At::area(q, INPUT_AREA, from),
            to: At::output(rank, to),
            len,
        };
        let local =
            |from: usize, to: usize| WindowStep::Copy { from: At::input(rank, from), to: At::output(rank, to), len };
        let fold = |from: usize, to: usize| WindowStep::Fold {
            from: (0..n).map(|q| At::area(q, INPUT_AREA, from)).collect(),
            to: vec![At::output(rank, to)],
            len,
        };
        match coll {
            Collective::Broadcast { root } => {
                if rank == root {
                    stage(ops, at, 0);
                    post.push(local(at, at));
                } else {
                    post.push(pull(root, 0, at));
                }
            }
            Collective::Reduce { root } => {
                stage(ops, at, 0);
                if rank == root {
                    post.push(fold(0, at));
                }
            }
            Collective::AllGather | Collective::Gather { .. } => {
                stage(ops, at, 0);
                if !matches!(coll, Collective::Gather { root } if root != rank) {
                    for q in 0..n {
                        post.push(if q == rank { local(at, q * blk + at) } else { pull(q, 0, q * blk + at) });
                    }
                }
            }
            Collective::AllToAll => {
                for d in (0..n).filter(|&d| d != rank) {
                    stage(ops, d * blk + at, d * len);
                }
                for q in 0..n {
                    post.push(if q == rank {
                        local(q * blk + at, q * blk + at)
                    } else {
                        pull(q, rank * len, q * blk + at)
                    });
                }
            }
            Collective::Scatter { root } => {
                if rank == root {
                    for d in (0..n).filter(|&d| d != rank) {
                        stage(ops, d * blk + at, d * len);
                    }
                    post.push(local(rank * blk + at, at));
                } else {
                    post.push(pull(root, rank * len, at));
                }
            }
            Collective::ReduceScatter => {
                for d in 0..n {
                    stage(ops, d * blk + at, d * len);
                }
                post.push(fold(rank * len, at));
            }
            Collective::AllReduce | Collective::Send { .. } | Collective::Recv { .. } => {}
        }
        ops.push(WindowStep::Barrier);
        ops.append(&mut post);
        ops.push(WindowStep::Barrier);
    }
}

/// Sizes of the memories a plan may touch, for [`validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Bytes of each rank's input.
    pub input: usize,
    /// Bytes of each rank's output.
    pub output: usize,
    /// Bytes of each area, by id.
    pub areas: Vec<usize>,
    /// Ranks.
    pub nranks: usize,
}

/// Checks one rank's plan against `b`: every range inside its memory, folds of at least one
/// source, no empty op. Executors run it in debug builds before they run a plan.
pub fn validate(plan: &WindowPlan, b: &Bounds) -> Result<(), String> {
    let inside = |a: &At, len: usize| -> Result<(), String> {
        let (rank, size) = match a.mem {
            Mem::Input(q) => (q, b.input),
            Mem::Output(q) => (q, b.output),
            Mem::Area { rank, id } => (rank, b.areas.get(id).copied().ok_or(format!("{a:?}: no area {id}"))?),
        };
        if rank >= b.nranks {
            return Err(format!("{a:?}: rank {rank} of {}", b.nranks));
        }
        if a.off.checked_add(len).is_none_or(|end| end > size) {
            return Err(format!("{a:?} + {len} bytes: past the {size} bytes of its memory"));
        }
        Ok(())
    };
    for (i, op) in plan.ops.iter().enumerate() {
        let r = match op {
            WindowStep::Copy { from, to, len } => {
                if *len == 0 {
                    Err("empty copy".to_string())
                } else {
                    inside(from, *len).and(inside(to, *len))
                }
            }
            WindowStep::Scale { at, len } => inside(at, *len),
            WindowStep::Fold { from, to, len } => {
                if from.is_empty() || to.is_empty() || *len == 0 {
                    Err("a fold needs sources, destinations and bytes".to_string())
                } else {
                    from.iter().chain(to).try_for_each(|a| inside(a, *len))
                }
            }
            WindowStep::Barrier => Ok(()),
        };
        r.map_err(|e| format!("op {i} ({op:?}): {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
