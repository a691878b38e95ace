//! Fixed-order reductions: the schedules of `OXCCL_DETERMINISTIC=1`
//! ([`crate::config::Config::deterministic`]).
//!
//! Every element of the result is the left fold of the ranks' inputs in rank order,
//! `((x0 op x1) op x2) ... op x(n-1)`, computed by one [`Step::Fold`] on the element's owner
//! ([`crate::reduce::fold`]: `f32`/`f64` in their own precision, f16/bf16/fp8 in `f32` rounded
//! once). Nothing else combines values, so the bits depend neither on the chunk size, the
//! number of elements, the links, the placement of the ranks nor the timing.
//!
//! The schedule is a direct reduce-scatter: the data is cut into one segment per rank, each
//! segment into chunks; rank `p` owns segment `p` and receives every other rank's piece of each
//! of its chunks into scratch memory, copies its own piece beside them (at its rank's position)
//! and folds the `n` pieces. All-reduce then sends each folded chunk to every other rank (a
//! direct all-gather); reduce sends it to the root only; reduce-scatter keeps it. Every rank
//! sends and receives `(n - 1) / n` of the data in each phase, as the ring does.
//!
//! A chunk's pieces occupy one of at most [`SLOTS`] scratch slots; the receives into a reused
//! slot wait for the fold that last read it, which bounds the scratch memory to
//! `SLOTS * n * chunk` bytes whatever the size of the call.

use super::{partition, Action, Plan, Region, Step};

/// Chunk of a segment where the settings fix none (`OXCCL_CHUNK_SIZE`).
pub const DET_CHUNK: usize = 64 << 10;
/// Scratch slots for chunks in flight on the owner.
pub const SLOTS: usize = 4;

/// What happens to a folded chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Out {
    /// Stays in the receive buffer at its segment's offset and goes to every other rank.
    AllGather,
    /// Stays in the receive buffer from this byte offset on (reduce-scatter's own block).
    Owner(usize),
    /// Goes to this root, which stores it at its segment's offset.
    Root(usize),
}

/// Rank `rank`'s fixed-order all-reduce of `count` elements of `elem` bytes on `n` ranks.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk: usize) -> Plan {
    if let Some(p) = super::trivial_reduction(n, count, count * elem, 0) {
        return p;
    }
    build(rank, n, elem, chunk, &partition(count, n), Out::AllGather)
}

/// Rank `rank`'s fixed-order reduce-scatter: `count` elements per rank; block `p` of every
/// send buffer is folded into rank `p`'s receive buffer (in place: its own block of the one
/// buffer).
pub fn reduce_scatter(rank: usize, n: usize, count: usize, elem: usize, chunk: usize, in_place: bool) -> Plan {
    let blk = count * elem;
    let out = if in_place { rank * blk } else { 0 };
    if n == 1 && count > 0 {
        let mut plan = Plan::default();
        let c = plan.push(Step::Copy { src: Region::send(0, blk), dst: Region::recv(out, blk) }, vec![]);
        plan.push(Step::Finish { dst: Region::recv(out, blk) }, vec![c]);
        return plan;
    }
    if count == 0 {
        return Plan::default();
    }
    let segs: Vec<(usize, usize)> = (0..n).map(|p| (p * count, count)).collect();
    build(rank, n, elem, chunk, &segs, Out::Owner(out))
}

/// Rank `rank`'s fixed-order reduce of `count` elements to `root`.
pub fn reduce(rank: usize, n: usize, count: usize, elem: usize, chunk: usize, root: usize) -> Plan {
    if let Some(p) = super::trivial_reduction(n, count, count * elem, 0) {
        return p;
    }
    build(rank, n, elem, chunk, &partition(count, n), Out::Root(root))
}

/// The common schedule: segment `p` (elements `segs[p]` of the send buffer) is folded on rank
/// `p`, then handled as `out` says.
fn build(rank: usize, n: usize, elem: usize, chunk: usize, segs: &[(usize, usize)], out: Out) -> Plan {
    let mut plan = Plan::default();
    let ce = (chunk / elem).max(1);
    // Byte ranges (offset in the send buffer, length) of segment p's chunks.
    let pieces = |p: usize| -> Vec<(usize, usize)> {
        let (first, len) = segs[p];
        super::chunks(len, ce).map(|(o, l)| ((first + o) * elem, l * elem)).collect()
    };
    let mine = pieces(rank);
    let slots = mine.len().min(SLOTS);
    let slot_bytes = n * mine.first().map_or(0, |c| c.1);
    // Where a non-root rank of a reduce keeps its folded segment (after the slots).
    let acc_base = slots * slot_bytes;
    let seg_start = segs[rank].0 * elem;
    let result = |off: usize, len: usize| match out {
        Out::AllGather => Region::recv(off, len),
        Out::Owner(at) => Region::recv(at + off - seg_start, len),
        Out::Root(root) if root == rank => Region::recv(off, len),
        Out::Root(_) => Region::scratch(acc_base + off - seg_start, len),
    };
    // Reduce-scatter phase, sends: every other rank's segment to it, starting with the next.
    let mut sent_to: Vec<Vec<usize>> = vec![Vec::new(); n];
    for k in 1..n {
        let p = (rank + k) % n;
        for (o, l) in pieces(p) {
            sent_to[p].push(plan.push(Step::Send { peer: p, src: Region::send(o, l) }, vec![]));
        }
    }
    // The owner's side: each chunk's n pieces into a slot, in rank order, then the fold.
    let mut folds: Vec<usize> = Vec::with_capacity(mine.len());
    for (c, &(o, l)) in mine.iter().enumerate() {
        let base = (c % slots) * slot_bytes;
        let wait: Vec<usize> = c.checked_sub(slots).map(|d| folds[d]).into_iter().collect();
        let mut deps = Vec::with_capacity(n);
        deps.push(
            plan.push(Step::Copy { src: Region::send(o, l), dst: Region::scratch(base + rank * l, l) }, wait.clone()),
        );
        for k in 1..n {
            let q = (rank + n - k) % n;
            let dst = Region::scratch(base + q * l, l);
            deps.push(plan.push(Step::Recv { peer: q, dst, action: Action::Store }, wait.clone()));
        }
        folds.push(plan.push(Step::Fold { src: Region::scratch(base, n * l), dst: result(o, l) }, deps));
    }
    // The folded chunks to where they are needed; the other segments in (in place, only after
    // this rank's own piece of the same bytes has left).
    let (to, from): (Vec<usize>, Vec<usize>) = match out {
        Out::AllGather => ((1..n).map(|k| (rank + k) % n).collect(), (1..n).map(|k| (rank + n - k) % n).collect()),
        Out::Owner(_) => (vec![], vec![]),
        Out::Root(root) if root == rank => (vec![], (1..n).map(|k| (rank + n - k) % n).collect()),
        Out::Root(root) => (vec![root], vec![]),
    };
    for p in to {
        for (c, &(o, l)) in mine.iter().enumerate() {
            plan.push(Step::Send { peer: p, src: result(o, l) }, vec![folds[c]]);
        }
    }
    for q in from {
        for (c, (o, l)) in pieces(q).into_iter().enumerate() {
            let dst = Region::recv(o, l);
            plan.push(Step::Recv { peer: q, dst, action: Action::Store }, vec![sent_to[q][c]]);
        }
    }
    let acc = if matches!(out, Out::Root(r) if r != rank) { mine.iter().map(|c| c.1).sum() } else { 0 };
    plan.with_scratch(acc_base + acc)
}

#[cfg(test)]
mod tests;
