//! Collectives whose data goes straight from its source to its destination: all-to-all,
//! gather, scatter, and point-to-point send and receive.
//!
//! Every message is one step; the engine moves all of them at once, so the links run in
//! parallel and the socket buffers pipeline the bytes. Sends start with the next rank and go
//! round (`rank+1, rank+2, ...`), receives mirror that, so no rank is everyone's first target.

use super::{Action, Plan, Region, Step};

/// Rank `rank`'s all-to-all: block `p` of the send buffer goes to rank `p`, block `p` of the
/// receive buffer comes from rank `p`; blocks are `count * elem` bytes.
///
/// In place (one buffer) a block can only be overwritten once it has been sent: incoming blocks
/// land in scratch memory and are copied over after the outgoing block has left.
pub fn all_to_all(rank: usize, n: usize, count: usize, elem: usize, in_place: bool) -> Plan {
    let mut plan = Plan::default();
    let blk = count * elem;
    if count == 0 {
        return plan;
    }
    plan.push(Step::Copy { src: Region::send(rank * blk, blk), dst: Region::recv(rank * blk, blk) }, vec![]);
    let mut sent = vec![0; n];
    let mut got = vec![0; n];
    for i in 1..n {
        let (to, from) = ((rank + i) % n, (rank + n - i) % n);
        sent[to] = plan.push(Step::Send { peer: to, src: Region::send(to * blk, blk) }, vec![]);
        let dst = if in_place { Region::scratch(from * blk, blk) } else { Region::recv(from * blk, blk) };
        got[from] = plan.push(Step::Recv { peer: from, dst, action: Action::Store }, vec![]);
    }
    if in_place && n > 1 {
        for i in 1..n {
            let from = (rank + n - i) % n;
            let step = Step::Copy { src: Region::scratch(from * blk, blk), dst: Region::recv(from * blk, blk) };
            plan.push(step, vec![got[from], sent[from]]);
        }
        plan = plan.with_scratch(n * blk);
    }
    plan
}

/// Rank `rank`'s gather to `root`: block `p` of the root's receive buffer comes from rank `p`.
/// `input` is the byte offset of this rank's block in its send buffer (non-zero in place).
pub fn gather(rank: usize, n: usize, count: usize, elem: usize, root: usize, input: usize) -> Plan {
    let mut plan = Plan::default();
    let blk = count * elem;
    if count == 0 {
        return plan;
    }
    if rank != root {
        plan.push(Step::Send { peer: root, src: Region::send(input, blk) }, vec![]);
        return plan;
    }
    plan.push(Step::Copy { src: Region::send(input, blk), dst: Region::recv(rank * blk, blk) }, vec![]);
    for i in 1..n {
        let from = (rank + i) % n;
        plan.push(Step::Recv { peer: from, dst: Region::recv(from * blk, blk), action: Action::Store }, vec![]);
    }
    plan
}

/// Rank `rank`'s scatter from `root`: block `p` of the root's send buffer goes to rank `p`.
/// `output` is the byte offset of this rank's block in its receive buffer (non-zero in place).
pub fn scatter(rank: usize, n: usize, count: usize, elem: usize, root: usize, output: usize) -> Plan {
    let mut plan = Plan::default();
    let blk = count * elem;
    if count == 0 {
        return plan;
    }
    if rank != root {
        plan.push(Step::Recv { peer: root, dst: Region::recv(output, blk), action: Action::Store }, vec![]);
        return plan;
    }
    for i in 1..n {
        let to = (rank + i) % n;
        plan.push(Step::Send { peer: to, src: Region::send(to * blk, blk) }, vec![]);
    }
    plan.push(Step::Copy { src: Region::send(rank * blk, blk), dst: Region::recv(output, blk) }, vec![]);
    plan
}

/// Sends `bytes` bytes of the send buffer to `peer` (a different rank).
pub fn send(peer: usize, bytes: usize) -> Plan {
    let mut plan = Plan::default();
    if bytes > 0 {
        plan.push(Step::Send { peer, src: Region::send(0, bytes) }, vec![]);
    }
    plan
}

/// Receives `bytes` bytes from `peer` (a different rank) into the receive buffer, or into
/// scratch memory when `staged` (the caller copies them over later).
pub fn recv(peer: usize, bytes: usize, staged: bool) -> Plan {
    let mut plan = Plan::default();
    if bytes > 0 {
        let dst = if staged { Region::scratch(0, bytes) } else { Region::recv(0, bytes) };
        plan.push(Step::Recv { peer, dst, action: Action::Store }, vec![]);
        if staged {
            plan = plan.with_scratch(bytes);
        }
    }
    plan
}

/// Rank `rank`'s direct all-reduce on `n` ranks: reduce-scatter then all-gather with every
/// message straight to its owner. Segment `p` of every rank's input goes to rank `p`, which
/// reduces the `n - 1` incoming copies into its own (in a fixed order, so every rank's result
/// is its owner's, bit for bit), then sends the reduced segment to every other rank. Two
/// dependent phases instead of the ring's `2 (n - 1)` steps, with the ring's traffic: where
/// ranks outnumber cores, each rank needs the CPU fewer times per call. Segments are cut into
/// chunks of at most `chunk_bytes`.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    if let Some(p) = super::trivial_reduction(n, count, count * elem, 0) {
        return p;
    }
    let mut plan = Plan::default();
    let segs = super::partition(count, n);
    let chunk_elems = (chunk_bytes / elem).max(1);
    let bytes = |first: usize, (off, len): (usize, usize)| ((first + off) * elem, len * elem);
    let (mfirst, mlen) = segs[rank];
    let mine: Vec<(usize, usize)> = super::chunks(mlen, chunk_elems).map(|c| bytes(mfirst, c)).collect();
    // Reduce-scatter: segment p of the input to rank p, starting with the next rank.
    let mut sent_to = vec![Vec::new(); n];
    for k in 1..n {
        let p = (rank + k) % n;
        let (first, len) = segs[p];
        for c in super::chunks(len, chunk_elems) {
            let (o, l) = bytes(first, c);
            sent_to[p].push(plan.push(Step::Send { peer: p, src: Region::send(o, l) }, vec![]));
        }
    }
    // Incoming copies of this rank's segment, from the previous rank backwards; each chunk's
    // reductions are chained so the order is fixed.
    let mut last: Vec<Option<usize>> = vec![None; mine.len()];
    for k in 1..n {
        let q = (rank + n - k) % n;
        for (c, &(o, l)) in mine.iter().enumerate() {
            let with = if last[c].is_some() { Region::recv(o, l) } else { Region::send(o, l) };
            let action = if k == n - 1 { Action::ReduceFinal { with } } else { Action::Reduce { with } };
            let deps = last[c].into_iter().collect();
            last[c] = Some(plan.push(Step::Recv { peer: q, dst: Region::recv(o, l), action }, deps));
        }
    }
    // All-gather: the reduced segment to every other rank; the others' segments in (after this
    // rank's input segment for that rank has gone: in place they share the bytes).
    for k in 1..n {
        let p = (rank + k) % n;
        for (c, &(o, l)) in mine.iter().enumerate() {
            plan.push(Step::Send { peer: p, src: Region::recv(o, l) }, last[c].into_iter().collect());
        }
    }
    for k in 1..n {
        let q = (rank + n - k) % n;
        let (first, len) = segs[q];
        for c in super::chunks(len, chunk_elems) {
            let (o, l) = bytes(first, c);
            plan.push(Step::Recv { peer: q, dst: Region::recv(o, l), action: Action::Store }, sent_to[q].clone());
        }
    }
    plan
}
