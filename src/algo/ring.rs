//! Chunked, pipelined ring all-reduce: reduce-scatter then all-gather.
//!
//! The buffer is cut into `n` segments; rank `r` sends to `r+1` and receives from `r-1`. In
//! reduce-scatter step `s`, rank `r` sends segment `r-s` and receives segment `r-s-1`, which it
//! reduces with its own input; after `n-1` steps it holds segment `r+1` fully reduced. The
//! all-gather then circulates the reduced segments for `n-1` more steps. Each segment is cut
//! into chunks, and a chunk is forwarded as soon as its own reduction is done, so transfer of
//! chunk `k+1` overlaps reduction of chunk `k`.

use super::{byte_chunks, chunk_at, partition, trivial_reduction, Action, Plan, Region, Step};
use std::collections::HashMap;

/// Builds rank `rank`'s ring all-reduce plan for `count` elements of `elem` bytes on `n` ranks,
/// with chunks of at most `chunk_bytes`, in the order of [`all_reduce_ahead`] with no bound.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    all_reduce_ahead(rank, n, count, elem, chunk_bytes, usize::MAX)
}

/// [`all_reduce`] whose steps are interleaved chunk by chunk: a step of chunk `c` at ring step
/// `g` (`0..2(n-1)`: reduce-scatter, then all-gather) goes before every step of a later
/// position `c + ahead * g`. With `ahead = 0` every chunk goes round the whole ring before the
/// next starts (NCCL's order: a send stream `chunk 0 scatter, chunk 0 gather, chunk 1 ...`); with
/// `ahead = k` a rank sends the scatter of up to `k` chunks before the first gather, so it can
/// work while its peer catches up; with no bound (`usize::MAX`) each ring step's chunks all go
/// before the next step's. The order decides what the send and receive streams of a link carry
/// next: short-range orders keep a chunk's bytes in the caches from its reduction to its
/// forwarding, and let the engine forward a reduced chunk as it is reduced (`engine::fuse`).
/// Every rank orders the same positions the same way, so each link's two streams match.
pub fn all_reduce_ahead(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, ahead: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if let Some(p) = trivial_reduction(n, count, total, 0) {
        return p;
    }
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    let segs = partition(count, n);
    let chunk_elems = (chunk_bytes / elem).max(1);
    let seg_at = |s: isize| segs[s.rem_euclid(n as isize) as usize];
    let most = segs.iter().map(|&(_, len)| len.div_ceil(chunk_elems)).max().unwrap_or(0);
    let steps = 2 * (n - 1);
    let mut order: Vec<(usize, usize)> = (0..steps).flat_map(|g| (0..most).map(move |c| (g, c))).collect();
    order.sort_by_key(|&(g, c)| (c.saturating_add(ahead.saturating_mul(g)), g, c));
    // Index of the recv step that last produced (segment, chunk) on this rank.
    let mut produced: HashMap<(usize, usize), usize> = HashMap::new();
    let r = rank as isize;
    let nn = n as isize;
    for (g, c) in order {
        let scatter = g < n - 1;
        // Reduce-scatter step s sends segment r-s and receives r-s-1; all-gather step s sends
        // the reduced segment r+1-s and receives r-s.
        let s = if scatter { g as isize } else { (g - (n - 1)) as isize };
        let (send_at, recv_at) = if scatter { (r - s, r - s - 1) } else { (r + 1 - s, r - s) };
        let send_seg = send_at.rem_euclid(nn) as usize;
        let recv_seg = recv_at.rem_euclid(nn) as usize;
        let (sfirst, slen) = seg_at(send_at);
        let (rfirst, rlen) = seg_at(recv_at);
        if let Some((off, len)) = chunk_at(slen, chunk_elems, c) {
            let bytes = ((sfirst + off) * elem, len * elem);
            let (src, deps) = match produced.get(&(send_seg, c)) {
                Some(&i) => (Region::recv(bytes.0, bytes.1), vec![i]),
                None => (Region::send(bytes.0, bytes.1), vec![]),
            };
            plan.push(Step::Send { peer: next, src }, deps);
        }
        if let Some((off, len)) = chunk_at(rlen, chunk_elems, c) {
            let (o, l) = ((rfirst + off) * elem, len * elem);
            let action = if !scatter {
                Action::Store
            } else if g == n - 2 {
                Action::ReduceFinal { with: Region::send(o, l) }
            } else {
                Action::Reduce { with: Region::send(o, l) }
            };
            let i = plan.push(Step::Recv { peer: prev, dst: Region::recv(o, l), action }, vec![]);
            produced.insert((recv_seg, c), i);
        }
    }
    plan
}

/// Block `s` steps behind `rank` on a ring of `n` (`(rank - s) mod n`).
fn behind(rank: usize, s: usize, n: usize) -> usize {
    (rank + n - s % n) % n
}

/// Rank `rank`'s ring all-gather of `count` elements per rank.
///
/// Block `b` of the receive buffer is rank `b`'s input. In step `s` a rank sends block
/// `rank - s` (its own input at `s = 0`, after that the block it received in step `s - 1`)
/// and receives block `rank - s - 1`. `in_place`: the input already sits at block `rank` of the
/// receive buffer (NCCL's `sendbuff == recvbuff + rank * count`), which the engine also sees
/// as the send buffer.
pub fn all_gather(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, in_place: bool) -> Plan {
    all_gather_on(&identity(n), rank, count, elem, chunk_bytes, in_place)
}

/// The ring order `0, 1, ..., n-1`.
pub fn identity(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// The position of every rank in the ring `order` (its inverse permutation).
pub fn positions(order: &[usize]) -> Vec<usize> {
    let mut pos = vec![0; order.len()];
    for (i, &r) in order.iter().enumerate() {
        pos[r] = i;
    }
    pos
}

/// [`all_gather`] on the ring `order` (`order[i]` is the rank at position `i`; rank
/// `order[i]` sends to `order[i+1]`). Blocks stay where the ranks' numbers put them.
pub fn all_gather_on(
    order: &[usize],
    rank: usize,
    count: usize,
    elem: usize,
    chunk_bytes: usize,
    in_place: bool,
) -> Plan {
    let n = order.len();
    let mut plan = Plan::default();
    let blk = count * elem;
    if count == 0 {
        return plan;
    }
    let input = if in_place { rank * blk } else { 0 };
    plan.push(Step::Copy { src: Region::send(input, blk), dst: Region::recv(rank * blk, blk) }, vec![]);
    let me = positions(order)[rank];
    let (next, prev) = (order[(me + 1) % n], order[(me + n - 1) % n]);
    let pieces = byte_chunks(count, elem, chunk_bytes);
    let mut last: Vec<Option<usize>> = vec![None; pieces.len()];
    for s in 0..n.saturating_sub(1) {
        let (sb, rb) = (order[behind(me, s, n)], order[behind(me, s + 1, n)]);
        for (c, &(off, len)) in pieces.iter().enumerate() {
            let src = if s == 0 { Region::send(input + off, len) } else { Region::recv(sb * blk + off, len) };
            plan.push(Step::Send { peer: next, src }, last[c].into_iter().collect());
            let dst = Region::recv(rb * blk + off, len);
            last[c] = Some(plan.push(Step::Recv { peer: prev, dst, action: Action::Store }, vec![]));
        }
    }
    plan
}

/// Rank `rank`'s ring reduce-scatter: `count` elements per rank, rank `r` ends with block `r` of
/// the reduction.
///
/// In step `s` a rank sends the partial sum of block `rank - s - 1` (its own input at `s = 0`)
/// and receives block `rank - s - 2`, which it reduces with its input; the last step receives
/// its own block and finishes the operator into the output. Partial sums live in scratch
/// memory. `in_place`: the output is block `rank` of the send buffer (NCCL's
/// `recvbuff == sendbuff + rank * count`); the engine then sees one buffer as both.
pub fn reduce_scatter(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, in_place: bool) -> Plan {
    reduce_scatter_on(&identity(n), rank, count, elem, chunk_bytes, in_place)
}

/// [`reduce_scatter`] on the ring `order` (see [`all_gather_on`]).
pub fn reduce_scatter_on(
    order: &[usize],
    rank: usize,
    count: usize,
    elem: usize,
    chunk_bytes: usize,
    in_place: bool,
) -> Plan {
    let n = order.len();
    let mut plan = Plan::default();
    let blk = count * elem;
    let out = if in_place { rank * blk } else { 0 };
    if let Some(p) = trivial_reduction(n, count, blk, out) {
        return p;
    }
    let me = positions(order)[rank];
    let (next, prev) = (order[(me + 1) % n], order[(me + n - 1) % n]);
    let pieces = byte_chunks(count, elem, chunk_bytes);
    let mut last: Vec<Option<usize>> = vec![None; pieces.len()];
    for s in 0..n - 1 {
        let (sb, rb) = (order[behind(me, s + 1, n)], order[behind(me, s + 2, n)]);
        for (c, &(off, len)) in pieces.iter().enumerate() {
            let src = if s == 0 { Region::send(sb * blk + off, len) } else { Region::scratch(sb * blk + off, len) };
            plan.push(Step::Send { peer: next, src }, last[c].into_iter().collect());
            let with = Region::send(rb * blk + off, len);
            let step = if s == n - 2 {
                Step::Recv { peer: prev, dst: Region::recv(out + off, len), action: Action::ReduceFinal { with } }
            } else {
                Step::Recv { peer: prev, dst: Region::scratch(rb * blk + off, len), action: Action::Reduce { with } }
            };
            last[c] = Some(plan.push(step, vec![]));
        }
    }
    if n > 2 {
        plan = plan.with_scratch(n * blk);
    }
    plan
}
