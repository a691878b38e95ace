//! The plan validator: proves the invariant the engine's unsafe buffer views rely on.
//!
//! The engine runs a step as soon as the steps it depends on are done (sends to one peer, and
//! receives from one peer, additionally one at a time in plan order), so two steps with no
//! such ordering between them may run at the same time. It hands out mutable views of the
//! call's buffers for one step at a time, which is sound only if no two unordered steps write
//! the same bytes. [`check`] rejects any plan where they could. A read racing a write may
//! still be ordered through another rank (a rank's send completes before the peer's answer
//! to it arrives), which one plan cannot show: the simulator (`algo::sim`, tests) catches
//! those races as wrong results. Tests run the validator over every builder; debug builds
//! run it on every plan a communicator builds ([`crate::coll`]).

use super::{Buf, Collective, Plan, Region, Step};

/// Where a call's send buffer lies relative to its receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Separate memory.
    Apart,
    /// In place: send byte `x` is receive byte `x + d` (`d` may be negative).
    InPlace(i64),
}

/// The layout of a call of `coll` built with `in_place`: the call layer ([`crate::coll`])
/// then hands the engine one buffer as both the send and the receive buffer (an in-place
/// all-gather's plan finds its own block inside it, a reduce-scatter's result goes to its own
/// block of it).
pub fn layout(coll: Collective, in_place: bool) -> Layout {
    match coll {
        Collective::Send { .. } | Collective::Recv { .. } => Layout::Apart,
        _ if in_place => Layout::InPlace(0),
        _ => Layout::Apart,
    }
}

/// One byte range a step touches, in the call's address space (`Apart`: send bytes are
/// numbered after every receive byte; scratch is a space of its own).
#[derive(Clone, Copy, Debug)]
struct Access {
    node: usize,
    call: usize,
    space: u8,
    start: i64,
    end: i64,
    write: bool,
}

fn access(node: usize, r: Region, write: bool, layout: Layout) -> Option<Access> {
    if r.len == 0 {
        return None;
    }
    let (off, len) = (r.off as i64, r.len as i64);
    let (space, start) = match (r.buf, layout) {
        (Buf::Recv, _) => (0, off),
        (Buf::Send, Layout::InPlace(d)) => (0, off + d),
        (Buf::Send, Layout::Apart) => (1, off),
        (Buf::Scratch, _) => (2, off),
    };
    Some(Access { node, call: r.call, space, start, end: start + len, write })
}

/// What step `i` writes.
fn writes(i: usize, step: &Step, layout: Layout, out: &mut Vec<Access>) {
    let mut add = |r: Region| out.extend(access(i, r, true, layout));
    match *step {
        Step::Send { .. } => {}
        Step::Recv { dst, .. }
        | Step::Finish { dst }
        | Step::Fold { dst, .. }
        | Step::Encode { dst, .. }
        | Step::Decode { dst, .. } => add(dst),
        // A copy onto itself is skipped.
        Step::Copy { src, dst } if src != dst => add(dst),
        Step::Copy { .. } => {}
    }
}

/// For every step, the steps certainly done before it starts (bit `j` of row `i`).
fn happens_before(plan: &Plan) -> Result<Vec<Vec<u64>>, String> {
    let n = plan.nodes.len();
    let words = n.div_ceil(64);
    let mut before = vec![vec![0u64; words]; n];
    let mut last_send: std::collections::HashMap<usize, usize> = Default::default();
    let mut last_recv: std::collections::HashMap<usize, usize> = Default::default();
    for (i, node) in plan.nodes.iter().enumerate() {
        let mut preds: Vec<usize> = node.deps.clone();
        match node.step {
            Step::Send { peer, .. } => preds.extend(last_send.insert(peer, i)),
            Step::Recv { peer, .. } => preds.extend(last_recv.insert(peer, i)),
            _ => {}
        }
        for d in preds {
            if d >= i {
                return Err(format!("step {i} depends on step {d}, which does not come before it"));
            }
            let (done, row) = before.split_at_mut(i);
            for (w, x) in row[0].iter_mut().zip(&done[d]) {
                *w |= x;
            }
            row[0][d / 64] |= 1 << (d % 64);
        }
    }
    Ok(before)
}

/// Checks that every two steps of `plan` that write the same bytes are ordered (see the
/// module docs). `layout(call)` says where call `call`'s send buffer
/// lies. The error names the two steps and the bytes.
pub fn check(plan: &Plan, layout: &dyn Fn(usize) -> Layout) -> Result<(), String> {
    let before = happens_before(plan)?;
    let mut acc = Vec::new();
    for (i, node) in plan.nodes.iter().enumerate() {
        let call = match node.step {
            Step::Send { src: r, .. }
            | Step::Recv { dst: r, .. }
            | Step::Copy { dst: r, .. }
            | Step::Finish { dst: r }
            | Step::Fold { dst: r, .. }
            | Step::Encode { dst: r, .. }
            | Step::Decode { dst: r, .. } => r.call,
        };
        writes(i, &node.step, layout(call), &mut acc);
    }
    acc.sort_by_key(|a| (a.call, a.space, a.start));
    let ordered = |a: usize, b: usize| {
        let (lo, hi) = (a.min(b), a.max(b));
        before[hi][lo / 64] & (1 << (lo % 64)) != 0
    };
    // Sweep each address space: every access against the later-starting ones it overlaps.
    for (k, a) in acc.iter().enumerate() {
        for b in acc[k + 1..].iter().take_while(|b| b.call == a.call && b.space == a.space && b.start < a.end) {
            if a.node != b.node && (a.write || b.write) && !ordered(a.node, b.node) {
                let what = |x: &Access| if x.write { "writes" } else { "reads" };
                return Err(format!(
                    "steps {} ({:?}) and {} ({:?}) are not ordered, but step {} {} and step {} {} bytes {}..{} of call {}",
                    a.node,
                    plan.nodes[a.node].step,
                    b.node,
                    plan.nodes[b.node].step,
                    a.node,
                    what(a),
                    b.node,
                    what(b),
                    a.start.max(b.start),
                    a.end.min(b.end),
                    a.call
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::{build_on, ring, Action, Node};

    #[test]
    fn unordered_overlapping_writes_are_rejected_and_ordered_ones_pass() {
        let recv = |peer| Step::Recv { peer, dst: Region::recv(0, 8), action: Action::Store };
        let copy = || Step::Copy { src: Region::send(0, 8), dst: Region::recv(4, 8) };
        let bad = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![] }, Node { step: copy(), deps: vec![] }],
            scratch: vec![],
        };
        let e = check(&bad, &|_| Layout::Apart).expect_err("two writes of bytes 4..8 race");
        assert!(e.contains("bytes 4..8"), "{e}");
        let good = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![] }, Node { step: copy(), deps: vec![0] }],
            scratch: vec![],
        };
        assert_eq!(check(&good, &|_| Layout::Apart), Ok(()));
        // Receives from one peer run one at a time: no dependency needed between them.
        let two = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![] }, Node { step: recv(1), deps: vec![] }],
            scratch: vec![],
        };
        assert_eq!(check(&two, &|_| Layout::Apart), Ok(()));
        let racing = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![] }, Node { step: recv(2), deps: vec![] }],
            scratch: vec![],
        };
        assert!(check(&racing, &|_| Layout::Apart).is_err());
        // In place, the send and receive buffers alias: a copy between them writes the bytes
        // that an unordered receive writes.
        let send = || Step::Copy { src: Region::recv(8, 8), dst: Region::send(0, 8) };
        let p = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![] }, Node { step: send(), deps: vec![] }],
            scratch: vec![],
        };
        assert_eq!(check(&p, &|_| Layout::Apart), Ok(()));
        assert!(check(&p, &|_| Layout::InPlace(0)).is_err());
        assert_eq!(check(&p, &|_| Layout::InPlace(8)), Ok(()), "send buffer right after the receive bytes");
        let fwd = Plan {
            nodes: vec![Node { step: recv(1), deps: vec![1] }, Node { step: send(), deps: vec![] }],
            scratch: vec![],
        };
        assert!(check(&fwd, &|_| Layout::Apart).unwrap_err().contains("does not come before"));
    }

    #[test]
    fn every_builder_passes_at_1_to_12_ranks() {
        for n in 1..=12 {
            let scrambled = crate::algo::hier::ring_order(&(0..n).map(|r| (r * 7 + 3) % 3).collect::<Vec<_>>());
            for order in [ring::identity(n), scrambled] {
                for coll in super::super::sim::collectives(n) {
                    for &algo in coll.algorithms() {
                        for (count, elem, chunk) in [(0, 4, 64), (1, 1, 64), (5, 4, 4), (37, 2, 16), (37, 8, 1 << 20)] {
                            for in_place in [false, true] {
                                for r in 0..n {
                                    let (sc, rc) = coll.buffer_counts(r, n, count);
                                    let ip = in_place && sc > 0 && rc > 0;
                                    let plan = build_on(coll, algo, &order, r, count, elem, chunk, ip).unwrap();
                                    let layout = layout(coll, ip);
                                    check(&plan, &|_| layout).unwrap_or_else(|e| {
                                        panic!(
                                            "{coll:?} {algo:?} n={n} rank {r} count={count} in_place={in_place}: {e}"
                                        )
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        for groups in [vec![0, 0, 1, 1], vec![0, 1, 0, 1, 2], vec![0, 0, 0, 1]] {
            for r in 0..groups.len() {
                let plan = crate::algo::hier::all_reduce(r, &groups, 37, 4, 16);
                check(&plan, &|_| Layout::Apart).unwrap();
                check(&plan, &|_| Layout::InPlace(0)).unwrap();
            }
        }
        for r in 0..2 {
            let plan = crate::algo::oneshot::all_reduce(r, 37, 4, 16);
            check(&plan, &|_| Layout::Apart).unwrap();
            check(&plan, &|_| Layout::InPlace(0)).unwrap();
        }
    }
}
