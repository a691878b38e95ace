//! Chunked, pipelined ring all-reduce: reduce-scatter then all-gather.
//!
//! The buffer is cut into `n` segments; rank `r` sends to `r+1` and receives from `r-1`. In
//! reduce-scatter step `s`, rank `r` sends segment `r-s` and receives segment `r-s-1`, which it
//! reduces with its own input; after `n-1` steps it holds segment `r+1` fully reduced. The
//! all-gather then circulates the reduced segments for `n-1` more steps. Each segment is cut
//! into chunks, and a chunk is forwarded as soon as its own reduction is done, so transfer of
//! chunk `k+1` overlaps reduction of chunk `k`.

use super::{chunks, partition, Action, Plan, Region, Step};
use std::collections::HashMap;

/// Builds rank `rank`'s ring all-reduce plan for `count` elements of `elem` bytes on `n` ranks,
/// with chunks of at most `chunk_bytes`.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if count == 0 {
        return plan;
    }
    if n == 1 {
        plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(0, total) }, vec![]);
        let c = plan.nodes.len() - 1;
        plan.push(Step::Finish { dst: Region::recv(0, total) }, vec![c]);
        return plan;
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
