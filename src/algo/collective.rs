//! The collectives, and the plan builder of each (collective, algorithm) pair.

use super::tuning::Algo;
use super::{chain, direct, rd, ring, tree, Plan, Step};

/// A collective operation with its rank arguments (counts and buffers come separately).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// `ncclAllReduce`.
    AllReduce,
    /// `ncclBroadcast` / `ncclBcast` from `root`.
    Broadcast {
        /// Source rank.
        root: usize,
    },
    /// `ncclReduce` to `root`.
    Reduce {
        /// Destination rank.
        root: usize,
    },
    /// `ncclAllGather`.
    AllGather,
    /// `ncclReduceScatter`.
    ReduceScatter,
    /// `ncclAlltoAll`.
    AllToAll,
    /// `ncclGather` to `root`.
    Gather {
        /// Destination rank.
        root: usize,
    },
    /// `ncclScatter` from `root`.
    Scatter {
        /// Source rank.
        root: usize,
    },
    /// `ncclSend` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
    },
    /// `ncclRecv` from `peer`.
    Recv {
        /// Source rank.
        peer: usize,
    },
}

impl Collective {
    /// Name as in logs and error messages (`all_reduce`, `broadcast`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Reduce { .. } => "reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "alltoall",
            Collective::Gather { .. } => "gather",
            Collective::Scatter { .. } => "scatter",
            Collective::Send { .. } => "send",
            Collective::Recv { .. } => "recv",
        }
    }

    /// The name of calls in errors and the flight record: the collective's for one call,
    /// `group(...)` (the first 8 names, then the count) for several.
    pub fn group_name(colls: impl ExactSizeIterator<Item = Collective>) -> std::borrow::Cow<'static, str> {
        let n = colls.len();
        let names: Vec<&str> = colls.take(8).map(Collective::name).collect();
        match names.as_slice() {
            [one] if n == 1 => std::borrow::Cow::Borrowed(one),
            _ => {
                let more = if n > 8 { format!(", ... ({n} calls)") } else { String::new() };
                std::borrow::Cow::Owned(format!("group({}{more})", names.join(", ")))
            }
        }
    }

    /// Whether it combines values with a reduction operator.
    pub const fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::Reduce { .. } | Collective::ReduceScatter)
    }

    /// The root or peer rank argument, if any.
    pub const fn rank_arg(self) -> Option<usize> {
        match self {
            Collective::Broadcast { root }
            | Collective::Reduce { root }
            | Collective::Gather { root }
            | Collective::Scatter { root } => Some(root),
            Collective::Send { peer } | Collective::Recv { peer } => Some(peer),
            _ => None,
        }
    }

    /// The algorithms that can run it (the first is the fallback).
    pub const fn algorithms(self) -> &'static [Algo] {
        match self {
            Collective::AllReduce => &[Algo::Ring, Algo::Tree, Algo::Rd, Algo::Direct],
            Collective::Broadcast { .. } | Collective::Reduce { .. } => &[Algo::Ring, Algo::Tree],
            Collective::AllGather | Collective::ReduceScatter => &[Algo::Ring],
            _ => &[Algo::Direct],
        }
    }

    /// Elements in (send, receive) buffer of `rank` for a per-rank `count` on `n` ranks; 0
    /// where the buffer is not used on this rank (NCCL: "only significant at the root").
    pub fn buffer_counts(self, rank: usize, n: usize, count: usize) -> (usize, usize) {
        let at_root = |root: usize| rank == root;
        match self {
            Collective::AllReduce => (count, count),
            Collective::Broadcast { root } => (if at_root(root) { count } else { 0 }, count),
            Collective::Reduce { root } => (count, if at_root(root) { count } else { 0 }),
            Collective::AllGather => (count, count * n),
            Collective::ReduceScatter => (count * n, count),
            Collective::AllToAll => (count * n, count * n),
            Collective::Gather { root } => (count, if at_root(root) { count * n } else { 0 }),
            Collective::Scatter { root } => (if at_root(root) { count * n } else { 0 }, count),
            Collective::Send { .. } => (count, 0),
            Collective::Recv { .. } => (0, count),
        }
    }
}

/// Builds rank `rank`'s plan of `coll` with `algo` (which must be one of
/// [`Collective::algorithms`]) for a per-rank `count` of `elem`-byte elements.
///
/// `in_place` says the call uses one buffer, in NCCL's in-place layout: all-gather's input is
/// block `rank` of it, reduce-scatter's output is block `rank`, the root's own block for gather
/// and scatter. The engine then sees that buffer as both the send and the receive buffer.
#[allow(clippy::too_many_arguments)]
pub fn build(
    coll: Collective,
    algo: Algo,
    rank: usize,
    n: usize,
    count: usize,
    elem: usize,
    chunk: usize,
    in_place: bool,
) -> Option<Plan> {
    let own = if in_place { rank * count * elem } else { 0 };
    Some(match (coll, algo) {
        (Collective::AllReduce, Algo::Ring) => ring::all_reduce(rank, n, count, elem, chunk),
        (Collective::AllReduce, Algo::Tree) => tree::all_reduce(rank, n, count, elem, chunk),
        (Collective::AllReduce, Algo::Rd) => rd::all_reduce(rank, n, count, elem, chunk),
        (Collective::AllReduce, Algo::Direct) => direct::all_reduce(rank, n, count, elem, chunk),
        (Collective::Broadcast { root }, Algo::Ring) => chain::broadcast(rank, n, count, elem, chunk, root),
        (Collective::Broadcast { root }, Algo::Tree) => tree::broadcast(rank, n, count, elem, chunk, root),
        (Collective::Reduce { root }, Algo::Ring) => chain::reduce(rank, n, count, elem, chunk, root),
        (Collective::Reduce { root }, Algo::Tree) => tree::reduce(rank, n, count, elem, chunk, root),
        (Collective::AllGather, Algo::Ring) => ring::all_gather(rank, n, count, elem, chunk, in_place),
        (Collective::ReduceScatter, Algo::Ring) => ring::reduce_scatter(rank, n, count, elem, chunk, in_place),
        (Collective::AllToAll, Algo::Direct) => direct::all_to_all(rank, n, count, elem, in_place),
        (Collective::Gather { root }, Algo::Direct) => direct::gather(rank, n, count, elem, root, own),
        (Collective::Scatter { root }, Algo::Direct) => direct::scatter(rank, n, count, elem, root, own),
        (Collective::Send { peer }, Algo::Direct) => direct::send(peer, count * elem),
        (Collective::Recv { peer }, Algo::Direct) => direct::recv(peer, count * elem, false),
        _ => return None,
    })
}

/// [`build`] on the ring order `order` (`order[i]`: the rank at position `i`, e.g. ranks
/// grouped by host, see [`super::hier::ring_order`]): rings, chains and trees run over the
/// positions, so neighbours in `order` are neighbours in the schedule; the data layout (blocks of
/// all-gather and reduce-scatter, roots) keeps the ranks' numbers. Direct algorithms ignore the
/// order. With the identity order this is exactly [`build`].
#[allow(clippy::too_many_arguments)]
pub fn build_on(
    coll: Collective,
    algo: Algo,
    order: &[usize],
    rank: usize,
    count: usize,
    elem: usize,
    chunk: usize,
    in_place: bool,
) -> Option<Plan> {
    let n = order.len();
    if order.iter().enumerate().all(|(i, &r)| i == r) {
        return build(coll, algo, rank, n, count, elem, chunk, in_place);
    }
    let pos = ring::positions(order);
    let virtual_coll = match coll {
        Collective::AllGather if algo == Algo::Ring => {
            return Some(ring::all_gather_on(order, rank, count, elem, chunk, in_place))
        }
        Collective::ReduceScatter if algo == Algo::Ring => {
            return Some(ring::reduce_scatter_on(order, rank, count, elem, chunk, in_place))
        }
        // These plans touch no rank-numbered block: build them for this rank's position and
        // rename the peers.
        Collective::AllReduce => Collective::AllReduce,
        Collective::Broadcast { root } => Collective::Broadcast { root: pos[root] },
        Collective::Reduce { root } => Collective::Reduce { root: pos[root] },
        _ => return build(coll, algo, rank, n, count, elem, chunk, in_place),
    };
    let mut plan = build(virtual_coll, algo, pos[rank], n, count, elem, chunk, in_place)?;
    for node in &mut plan.nodes {
        match &mut node.step {
            Step::Send { peer, .. } | Step::Recv { peer, .. } => *peer = order[*peer],
            _ => {}
        }
    }
    Some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_collectives(n: usize) -> Vec<Collective> {
        let mut v = vec![Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll];
        for root in [0, n / 2, n - 1] {
            v.extend([
                Collective::Broadcast { root },
                Collective::Reduce { root },
                Collective::Gather { root },
                Collective::Scatter { root },
            ]);
        }
        v
    }

    /// The contract of `super`: between every pair of ranks, the sends of one match the
    /// receives of the other in number, order and length; dependencies point backwards.
    #[test]
    fn every_plan_pair_matches() {
        for n in 1..=10 {
            // The identity ring, and a scrambled one (ranks grouped by a made-up host table).
            let scrambled = super::super::hier::ring_order(&(0..n).map(|r| (r * 7 + 3) % 3).collect::<Vec<_>>());
            for order in [ring::identity(n), scrambled] {
                for coll in all_collectives(n) {
                    for &algo in coll.algorithms() {
                        for (count, elem, chunk, in_place) in [
                            (0, 4, 64, false),
                            (1, 1, 64, true),
                            (5, 4, 4, false),
                            (37, 2, 16, true),
                            (37, 8, 1 << 20, false),
                        ] {
                            let plans: Vec<Plan> = (0..n)
                                .map(|r| {
                                    build_on(coll, algo, &order, r, count, elem, chunk, in_place).expect("supported")
                                })
                                .collect();
                            for (r, p) in plans.iter().enumerate() {
                                for (i, node) in p.nodes.iter().enumerate() {
                                    assert!(
                                        node.deps.iter().all(|&d| d < i),
                                        "{coll:?} {algo:?} n={n} rank {r} step {i}"
                                    );
                                }
                            }
                            for a in 0..n {
                                for b in 0..n {
                                    let sends = crate::algo::message_lens(&plans[a], b, true);
                                    let recvs = crate::algo::message_lens(&plans[b], a, false);
                                    assert_eq!(
                                        sends, recvs,
                                        "{coll:?} {algo:?} n={n} count={count} chunk={chunk}: {a} -> {b}"
                                    );
                                    assert!(a != b || sends.is_empty());
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn buffer_counts_follow_nccl() {
        assert_eq!(Collective::AllGather.buffer_counts(1, 4, 3), (3, 12));
        assert_eq!(Collective::ReduceScatter.buffer_counts(1, 4, 3), (12, 3));
        assert_eq!(Collective::Reduce { root: 0 }.buffer_counts(1, 4, 3), (3, 0));
        assert_eq!(Collective::Broadcast { root: 1 }.buffer_counts(1, 4, 3), (3, 3));
        assert_eq!(Collective::Gather { root: 2 }.buffer_counts(2, 4, 3), (3, 12));
        assert_eq!(Collective::Scatter { root: 2 }.buffer_counts(0, 4, 3), (0, 3));
        assert!(build(Collective::AllGather, Algo::Tree, 0, 2, 1, 4, 64, false).is_none());
    }
}
