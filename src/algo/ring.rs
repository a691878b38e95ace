//! Chunked, pipelined ring all-reduce: reduce-scatter then all-gather.
//!
//! The buffer is cut into `n` segments; rank `r` sends to `r+1` and receives from `r-1`. In
//! reduce-scatter step `s`, rank `r` sends segment `r-s` and receives segment `r-s-1`, which it
//! reduces with its own input; after `n-1` steps it holds segment `r+1` fully reduced. The
//! all-gather then circulates the reduced segments for `n-1` more steps. Each segment is cut
//! into chunks, and a chunk is forwarded as soon as its own reduction is done, so transfer of
//! chunk `k+1` overlaps reduction of chunk `k`.

use super::{byte_chunks, chunks, trivial_reduction, partition, Action, Plan, Region, Step};
use std::collections::HashMap;

/// Builds rank `rank`'s ring all-reduce plan for `count` elements of `elem` bytes on `n` ranks,
/// with chunks of at most `chunk_bytes`.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
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
    // Index of the recv step that last produced (segment, chunk) on this rank.
    let mut produced: HashMap<(usize, usize), usize> = HashMap::new();
    let r = rank as isize;
    // Reduce-scatter.
    for s in 0..(n as isize - 1) {
        let send_seg = (r - s).rem_euclid(n as isize) as usize;
        let (sfirst, slen) = seg_at(r - s);
        let recv_seg = (r - s - 1).rem_euclid(n as isize) as usize;
        let (rfirst, rlen) = seg_at(r - s - 1);
        let last = s == n as isize - 2;
        let send_chunks: Vec<_> = chunks(slen, chunk_elems).collect();
        let recv_chunks: Vec<_> = chunks(rlen, chunk_elems).collect();
        for c in 0..send_chunks.len().max(recv_chunks.len()) {
            if let Some(&(off, len)) = send_chunks.get(c) {
                let bytes = ((sfirst + off) * elem, len * elem);
                let (src, deps) = match produced.get(&(send_seg, c)) {
                    Some(&i) => (Region::recv(bytes.0, bytes.1), vec![i]),
                    None => (Region::send(bytes.0, bytes.1), vec![]),
                };
                plan.push(Step::Send { peer: next, src }, deps);
            }
            if let Some(&(off, len)) = recv_chunks.get(c) {
                let (o, l) = ((rfirst + off) * elem, len * elem);
                let with = Region::send(o, l);
                let action = if last { Action::ReduceFinal { with } } else { Action::Reduce { with } };
                let i = plan.push(Step::Recv { peer: prev, dst: Region::recv(o, l), action }, vec![]);
                produced.insert((recv_seg, c), i);
            }
        }
    }
    // All-gather.
    for s in 0..(n as isize - 1) {
        let send_seg = (r + 1 - s).rem_euclid(n as isize) as usize;
        let (sfirst, slen) = seg_at(r + 1 - s);
        let recv_seg = (r - s).rem_euclid(n as isize) as usize;
        let (rfirst, rlen) = seg_at(r - s);
        let send_chunks: Vec<_> = chunks(slen, chunk_elems).collect();
        let recv_chunks: Vec<_> = chunks(rlen, chunk_elems).collect();
        for c in 0..send_chunks.len().max(recv_chunks.len()) {
            if let Some(&(off, len)) = send_chunks.get(c) {
                let deps = produced.get(&(send_seg, c)).map(|&i| vec![i]).unwrap_or_default();
                plan.push(Step::Send { peer: next, src: Region::recv((sfirst + off) * elem, len * elem) }, deps);
            }
            if let Some(&(off, len)) = recv_chunks.get(c) {
                let dst = Region::recv((rfirst + off) * elem, len * elem);
                let i = plan.push(Step::Recv { peer: prev, dst, action: Action::Store }, vec![]);
                produced.insert((recv_seg, c), i);
            }
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
    let mut plan = Plan::default();
    let blk = count * elem;
    if count == 0 {
        return plan;
    }
    let input = if in_place { rank * blk } else { 0 };
    plan.push(Step::Copy { src: Region::send(input, blk), dst: Region::recv(rank * blk, blk) }, vec![]);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let pieces = byte_chunks(count, elem, chunk_bytes);
    let mut last: Vec<Option<usize>> = vec![None; pieces.len()];
    for s in 0..n.saturating_sub(1) {
        let (sb, rb) = (behind(rank, s, n), behind(rank, s + 1, n));
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
    let mut plan = Plan::default();
    let blk = count * elem;
    let out = if in_place { rank * blk } else { 0 };
    if let Some(p) = trivial_reduction(n, count, blk, out) {
        return p;
    }
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let pieces = byte_chunks(count, elem, chunk_bytes);
    let mut last: Vec<Option<usize>> = vec![None; pieces.len()];
    for s in 0..n - 1 {
        let (sb, rb) = (behind(rank, s + 1, n), behind(rank, s + 2, n));
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
