//! Pipelined chains for rooted collectives (NCCL's ring broadcast and reduce).
//!
//! Broadcast: the data flows `root -> root+1 -> ... -> root+n-1`; every rank stores each chunk
//! and forwards it at once, so after the pipeline fills every link carries one chunk at a time
//! and a rank sends the message exactly once. Reduce is the mirror image: partial results flow
//! `root+1 -> root+2 -> ... -> root`, each rank adding its input to each chunk on the way;
//! non-root ranks keep their partial results in scratch memory.

use super::{chunks, Action, Plan, Region, Step};

/// Position of `rank` in the chain that starts at `first`.
fn position(rank: usize, n: usize, first: usize) -> usize {
    (rank + n - first) % n
}

/// Byte ranges `(off, len)` of the chunks of `count` elements.
fn byte_chunks(count: usize, elem: usize, chunk_bytes: usize) -> impl Iterator<Item = (usize, usize)> {
    chunks(count, (chunk_bytes / elem).max(1)).map(move |(o, l)| (o * elem, l * elem))
}

/// Rank `rank`'s chain broadcast of `count` elements from `root`.
pub fn broadcast(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let pos = position(rank, n, root);
    let next = (pos + 1 < n).then_some((rank + 1) % n);
    let prev = (rank + n - 1) % n;
    if pos == 0 {
        let total = count * elem;
        plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(0, total) }, vec![]);
    }
    for (off, len) in byte_chunks(count, elem, chunk_bytes) {
        let (src, deps) = if pos == 0 {
            (Region::send(off, len), vec![])
        } else {
            let i = plan.push(Step::Recv { peer: prev, dst: Region::recv(off, len), action: Action::Store }, vec![]);
            (Region::recv(off, len), vec![i])
        };
        if let Some(next) = next {
            plan.push(Step::Send { peer: next, src }, deps);
        }
    }
    plan
}

/// Rank `rank`'s chain reduce of `count` elements to `root`.
pub fn reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if count == 0 {
        return plan;
    }
    if n == 1 {
        let c = plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(0, total) }, vec![]);
        plan.push(Step::Finish { dst: Region::recv(0, total) }, vec![c]);
        return plan;
    }
    // The chain starts right after the root and ends at it.
    let pos = position(rank, n, (root + 1) % n);
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    let is_root = rank == root;
    for (off, len) in byte_chunks(count, elem, chunk_bytes) {
        let input = Region::send(off, len);
        if pos == 0 {
            plan.push(Step::Send { peer: next, src: input }, vec![]);
        } else if is_root {
            let action = Action::ReduceFinal { with: input };
            plan.push(Step::Recv { peer: prev, dst: Region::recv(off, len), action }, vec![]);
        } else {
            let acc = Region::scratch(off, len);
            let i = plan.push(Step::Recv { peer: prev, dst: acc, action: Action::Reduce { with: input } }, vec![]);
            plan.push(Step::Send { peer: next, src: acc }, vec![i]);
        }
    }
    if pos != 0 && !is_root {
        plan = plan.with_scratch(total);
    }
    plan
}
