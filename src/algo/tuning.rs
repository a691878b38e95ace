//! The cost model: which algorithm and chunk size run a collective.
//!
//! Trees, chains and recursive doubling are pipelines. A chunk of `c` bytes needs `depth` hops
//! to cross one (the trees' way up and down, the chain's `n-1` links, recursive doubling's
//! rounds), each costing one message latency `alpha` plus `c * beta` on the wire; after that a
//! chunk completes every `alpha + width * c * beta`, `width` being how many chunks the busiest
//! rank sends per pipeline step (2 or 4 in the double tree, one per round in recursive
//! doubling). Rings have no fill or drain: every rank sends in every one of the `depth` steps
//! (`2(n-1)` for all-reduce, `n-1` for all-gather and reduce-scatter), each step moving one
//! segment (`S/n`) in `k` chunks. Reductions cost `gamma` per byte reduced on the busiest rank.
//! With `k = ceil(S_path / c)` chunks of the `S_path` bytes each stage moves:
//!
//! ```text
//! pipeline: T = depth*(alpha + c*beta) + (k-1)*alpha + (S_path - c)*width*beta + reduced*gamma
//! ring:     T = depth*(k*alpha + S_path*beta)                                 + reduced*gamma
//! ```
//!
//! `alpha`, `beta` and `gamma` belong to the transport ([`TransportKind`]); they were calibrated
//! by fitting this formula to measured sweeps (`benches/algo_sweep.sh`; the sweep of record is
//! in docs/perf-log/2026-11.md, "\[B\] Algorithm sweep").
//! [`choose`] evaluates every algorithm the collective has, each at every chunk size from 16 KiB
//! to 4 MiB, and takes the cheapest. `OXCCL_ALGO` (or `NCCL_ALGO`) restricts the algorithms
//! (`ring`, `tree`, `rd`, comma-separated, or `^tree` to exclude); `OXCCL_CHUNK_SIZE` fixes the
//! chunk size. The choice depends only on the call's shape and these settings, so every rank of
//! a communicator makes the same one.

use super::tree;
use super::Collective;
use std::fmt;

/// A family of schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Pipelined ring (all-reduce, all-gather, reduce-scatter) or chain (broadcast, reduce).
    Ring,
    /// Double binary tree (all-reduce) or binary tree (broadcast, reduce).
    Tree,
    /// Recursive doubling (all-reduce).
    Rd,
    /// Every message straight to its destination (all-to-all, gather, scatter, send, recv).
    Direct,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 4] = [Algo::Ring, Algo::Tree, Algo::Rd, Algo::Direct];

    /// The name used by `OXCCL_ALGO` and in logs.
    pub const fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Rd => "rd",
            Algo::Direct => "direct",
        }
    }

    /// Parses a name (case-insensitive; `recursive_doubling` is accepted for `rd`).
    pub fn parse(s: &str) -> Option<Algo> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ring" => Some(Algo::Ring),
            "tree" => Some(Algo::Tree),
            "rd" | "recursive_doubling" | "recursivedoubling" => Some(Algo::Rd),
            "direct" => Some(Algo::Direct),
            _ => None,
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of algorithms the tuner may pick from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgoSet(u8);

impl AlgoSet {
    /// Every algorithm.
    pub const ALL: AlgoSet = AlgoSet(0b1111);

    /// Just one algorithm.
    pub fn only(a: Algo) -> AlgoSet {
        AlgoSet(a.bit())
    }

    /// Whether `a` is in the set.
    pub fn contains(self, a: Algo) -> bool {
        self.0 & a.bit() != 0
    }

    /// Parses NCCL's `NCCL_ALGO` syntax: a comma-separated list (`ring,tree`), or the same
    /// list after `^` to exclude. Returns the set and the names it did not know (NCCL's
    /// `collnet`, `nvls`, ... have no host equivalent).
    pub fn parse(s: &str) -> (AlgoSet, Vec<String>) {
        let (exclude, list) = match s.trim().strip_prefix('^') {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let mut bits = 0u8;
        let mut unknown = Vec::new();
        for name in list.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            match Algo::parse(name) {
                Some(a) => bits |= a.bit(),
                None => unknown.push(name.to_string()),
            }
        }
        (AlgoSet(if exclude { Self::ALL.0 & !bits } else { bits }), unknown)
    }
}

/// Per-communicator settings that take precedence over the environment and the cost model.
/// Every rank of a communicator must use the same ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Algorithms allowed (`None`: the communicator's [`crate::config::Config::algos`], or all).
    pub algos: Option<AlgoSet>,
    /// Fixed chunk size in bytes (`None`: the communicator's [`crate::config::Config::chunk`],
    /// or the cost model's choice).
    pub chunk: Option<usize>,
    /// Fixed-order reductions (`None`: the communicator's
    /// [`crate::config::Config::deterministic`], `OXCCL_DETERMINISTIC`).
    pub deterministic: Option<bool>,
    /// The wire encoding between hosts of `f32` sum/avg all-reduces (`None`: the
    /// communicator's [`crate::config::Config::compress`], `OXCCL_COMPRESS`).
    pub compress: Option<crate::reduce::codec::Encoding>,
}

/// The kind of link a communicator's collectives travel over; each has its own cost constants.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// In-memory pipes between threads of one process.
    Mem,
    /// TCP sockets: the inter-host link (a ring across hosts goes at the pace of its TCP hops).
    Tcp,
    /// Shared-memory rings between processes of one host.
    Shm,
}

impl TransportKind {
    /// Name for logs.
    pub const fn name(self) -> &'static str {
        match self {
            TransportKind::Mem => "mem",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
        }
    }

    /// The kind that the collectives of a communicator over processes with these host
    /// identities travel over: the slowest kind among its links. Ranks that all share one host
    /// talk over shared memory unless `shm_allowed` is false (`OXCCL_TRANSPORT=tcp`); any rank on
    /// another host makes some link TCP. Depends only on values every rank has, so every rank
    /// gets the same kind (and so the same algorithm choices).
    pub fn for_hosts(hosts: &[String], shm_allowed: bool) -> TransportKind {
        let one_host = hosts.windows(2).all(|w| w[0] == w[1]);
        if one_host && shm_allowed {
            TransportKind::Shm
        } else {
            TransportKind::Tcp
        }
    }
}

/// Cost constants of one transport (microseconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// Latency of one message hop, µs.
    pub alpha: f64,
    /// Transfer time per byte, µs.
    pub beta: f64,
    /// Reduction time per byte, µs.
    pub gamma: f64,
}

impl Params {
    /// The calibrated constants of a transport (see docs/PERFORMANCE.md for how).
    pub const fn of(kind: TransportKind) -> Params {
        match kind {
            // TCP over loopback on the 2-vCPU reference machine.
            TransportKind::Tcp => Params { alpha: 14.0, beta: 1.0 / 900.0, gamma: 1.0 / 8000.0 },
            // Shared-memory rings between processes of one host: least-squares fit to a 2..8-rank
            // sweep on the 2-vCPU reference machine under load. alpha is a hop with more ranks
            // than cores (the receiver must be scheduled), not an idle core's few µs.
            TransportKind::Shm => Params { alpha: 60.0, beta: 1.0 / 2900.0, gamma: 1.0 / 15600.0 },
            // Bounded in-memory pipes, ranks as threads.
            TransportKind::Mem => Params { alpha: 4.0, beta: 1.0 / 2500.0, gamma: 1.0 / 8000.0 },
        }
    }
}

/// What the tuner decided for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The algorithm.
    pub algo: Algo,
    /// The pipeline chunk in bytes.
    pub chunk: usize,
    /// The model's prediction, µs.
    pub predicted_us: f64,
}

impl Choice {
    /// `algo` in chunks of `chunk`, chosen ahead of the model (a special path or a fixed rule),
    /// with the model's prediction for it on `kind` links (NaN where it has none).
    pub fn fixed(coll: Collective, algo: Algo, bytes: usize, n: usize, chunk: usize, kind: TransportKind) -> Choice {
        let predicted_us = predict(coll, algo, bytes, n, chunk, &Params::of(kind)).unwrap_or(f64::NAN);
        Choice { algo, chunk, predicted_us }
    }
}

/// Chunk sizes the tuner tries: 16 KiB .. 4 MiB.
pub const CHUNK_CANDIDATES: [usize; 9] =
    [16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20];

/// Shape of one algorithm's pipeline for a message of `bytes` on `n` ranks.
struct Shape {
    /// Pipelines (trees, chains, recursive doubling): hops a chunk takes from first send to
    /// last arrival. Rings: steps, in each of which every rank sends each chunk of a segment.
    depth: f64,
    /// A pipeline (else a ring, whose ranks all work in every step: no fill, no drain).
    pipelined: bool,
    /// Chunks the busiest rank sends per pipeline step.
    width: f64,
    /// Bytes that flow through each pipeline stage (cut into chunks).
    path: f64,
    /// Bytes the busiest rank reduces.
    reduced: f64,
}

fn log2_floor(n: usize) -> f64 {
    (usize::BITS - 1 - n.max(1).leading_zeros()) as f64
}

fn shape(coll: Collective, algo: Algo, bytes: usize, n: usize) -> Option<Shape> {
    let (s, nf) = (bytes as f64, n as f64);
    let frac = (nf - 1.0) / nf;
    let reduces = coll.reduces();
    let red = |x: f64| if reduces { x } else { 0.0 };
    Some(match (coll, algo) {
        (Collective::AllReduce, Algo::Ring) => {
            Shape { depth: 2.0 * (nf - 1.0), pipelined: false, width: 1.0, path: s / nf, reduced: s * frac }
        }
        (Collective::AllReduce, Algo::Tree) => {
            let h = tree::height(n, |r| tree::dtree(n, r)[0]).max(tree::height(n, |r| tree::dtree(n, r)[1]));
            // Per chunk of each tree, a rank sends one message up (unless it is the root) and
            // one to each child, and reduces one half-chunk per child: its busiest rank sends
            // 4 and reduces 2 on many ranks (interior in one tree, a leaf in the other), but on
            // 2 ranks each rank is one tree's root and the other's leaf: 2 sends, 1 reduction.
            let (sends, kids) = (0..n)
                .map(|r| {
                    let both = tree::dtree(n, r);
                    let sends = both.iter().map(|t| usize::from(t.parent.is_some()) + t.kids().count()).sum::<usize>();
                    (sends, both.iter().map(|t| t.kids().count()).sum::<usize>())
                })
                .fold((0, 0), |(a, b), (x, y)| (a.max(x), b.max(y)));
            Shape {
                depth: 2.0 * h as f64,
                pipelined: true,
                width: sends as f64,
                path: s / 2.0,
                reduced: kids as f64 * s / 2.0,
            }
        }
        (Collective::AllReduce, Algo::Rd) => {
            let r = super::rd::rounds(n) as f64;
            Shape { depth: r, pipelined: true, width: r, path: s, reduced: s * log2_floor(n) }
        }
        (Collective::Broadcast { .. } | Collective::Reduce { .. }, Algo::Ring) => {
            Shape { depth: nf - 1.0, pipelined: true, width: 1.0, path: s, reduced: red(s) }
        }
        (Collective::Broadcast { .. } | Collective::Reduce { .. }, Algo::Tree) => {
            let h = tree::height(n, |r| tree::btree(n, r));
            Shape { depth: h as f64, pipelined: true, width: 2.0, path: s, reduced: red(2.0 * s) }
        }
        (Collective::AllGather | Collective::ReduceScatter, Algo::Ring) => {
            Shape { depth: nf - 1.0, pipelined: false, width: 1.0, path: s / nf, reduced: red(s * frac) }
        }
        (Collective::AllToAll | Collective::Gather { .. } | Collective::Scatter { .. }, Algo::Direct) => {
            Shape { depth: nf - 1.0, pipelined: false, width: 1.0, path: s / nf, reduced: 0.0 }
        }
        (Collective::Send { .. } | Collective::Recv { .. }, Algo::Direct) => {
            Shape { depth: 1.0, pipelined: false, width: 1.0, path: s, reduced: 0.0 }
        }
        _ => return None,
    })
}

/// Predicted time in µs of `algo` running `coll` on a message of `bytes` over `n` ranks with
/// chunks of `chunk` bytes, or `None` when the collective has no such algorithm.
pub fn predict(coll: Collective, algo: Algo, bytes: usize, n: usize, chunk: usize, p: &Params) -> Option<f64> {
    if !coll.algorithms().contains(&algo) {
        return None;
    }
    if n <= 1 || bytes == 0 {
        return Some(0.0);
    }
    let sh = shape(coll, algo, bytes, n)?;
    let c = (chunk as f64).min(sh.path).max(1.0);
    let k = (sh.path / c).ceil().max(1.0);
    let moving = if sh.pipelined {
        sh.depth * (p.alpha + c * p.beta) + (k - 1.0) * p.alpha + (sh.path - c) * sh.width * p.beta
    } else {
        sh.depth * (k * p.alpha + sh.path * p.beta)
    };
    Some(moving + sh.reduced * p.gamma)
}

/// Picks the cheapest allowed algorithm and chunk size. `allowed` is narrowed to what the
/// collective supports; if that leaves nothing, every algorithm of the collective is allowed.
/// `chunk` fixes the chunk size (`OXCCL_CHUNK_SIZE`).
pub fn choose(
    coll: Collective,
    bytes: usize,
    n: usize,
    kind: TransportKind,
    allowed: AlgoSet,
    chunk: Option<usize>,
) -> Choice {
    let params = Params::of(kind);
    let algos = coll.algorithms();
    let usable: Vec<Algo> = algos.iter().copied().filter(|&a| allowed.contains(a)).collect();
    let usable = if usable.is_empty() { algos.to_vec() } else { usable };
    let chunks: &[usize] = match &chunk {
        Some(c) => std::slice::from_ref(c),
        None => &CHUNK_CANDIDATES,
    };
    let mut best: Option<Choice> = None;
    for &algo in &usable {
        for &c in chunks {
            let t = predict(coll, algo, bytes, n, c, &params).unwrap_or(f64::INFINITY);
            if best.is_none_or(|b| t < b.predicted_us) {
                best = Some(Choice { algo, chunk: c, predicted_us: t });
            }
        }
    }
    best.unwrap_or(Choice { algo: algos[0], chunk: chunks[0], predicted_us: f64::INFINITY })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_sets_parse_like_nccl_algo() {
        let (s, u) = AlgoSet::parse("ring");
        assert!(s.contains(Algo::Ring) && !s.contains(Algo::Tree) && u.is_empty());
        let (s, _) = AlgoSet::parse("^tree");
        assert!(s.contains(Algo::Ring) && s.contains(Algo::Rd) && !s.contains(Algo::Tree));
        let (s, u) = AlgoSet::parse("Tree, collnet ,rd");
        assert!(s.contains(Algo::Tree) && s.contains(Algo::Rd) && !s.contains(Algo::Ring));
        assert_eq!(u, vec!["collnet".to_string()]);
        for a in Algo::ALL {
            assert_eq!(Algo::parse(a.name()), Some(a));
        }
    }

    #[test]
    fn choice_respects_overrides_and_support() {
        let ar = Collective::AllReduce;
        let c = choose(ar, 1 << 20, 4, TransportKind::Tcp, AlgoSet::only(Algo::Tree), Some(4096));
        assert_eq!((c.algo, c.chunk), (Algo::Tree, 4096));
        // All-gather has only the ring: forcing the tree falls back to it.
        let c = choose(Collective::AllGather, 1 << 20, 4, TransportKind::Tcp, AlgoSet::only(Algo::Tree), None);
        assert_eq!(c.algo, Algo::Ring);
        let c = choose(Collective::AllToAll, 1 << 20, 4, TransportKind::Mem, AlgoSet::ALL, None);
        assert_eq!(c.algo, Algo::Direct);
    }

    const KINDS: [TransportKind; 3] = [TransportKind::Mem, TransportKind::Tcp, TransportKind::Shm];

    #[test]
    fn tiny_messages_take_the_fewest_hops() {
        // 8 bytes: every algorithm costs its hop count times alpha (plus a few ns), so the one
        // with the fewest sequential hops wins: recursive doubling's rounds(n) against the
        // ring's 2(n-1) and the double tree's 2*height.
        let ar = Collective::AllReduce;
        for kind in KINDS {
            let p = Params::of(kind);
            for n in 2..=16 {
                let c = choose(ar, 8, n, kind, AlgoSet::ALL, None);
                let hops = |a| predict(ar, a, 8, n, c.chunk, &p).unwrap() / p.alpha;
                let fewest = [Algo::Ring, Algo::Tree, Algo::Rd].into_iter().map(hops).fold(f64::INFINITY, f64::min);
                assert_ne!(c.algo, Algo::Ring, "{kind:?} n={n}");
                assert!((hops(c.algo) - fewest).abs() < 0.01, "{kind:?} n={n}: {} is not the fewest hops", c.algo);
                assert!((c.predicted_us / p.alpha - super::super::rd::rounds(n) as f64).abs() < 0.01);
            }
        }
    }

    #[test]
    fn huge_messages_on_two_ranks_take_a_bandwidth_algorithm() {
        // 64 MiB on 2 ranks: recursive doubling (the exchange) reduces all S bytes on each rank,
        // the ring and the double tree S/2 each, moving the same S bytes; the tree's two halves
        // need fewer message latencies (k+1 against the ring's 2k), so it wins, by alpha terms
        // only: the bytes terms of the two are equal.
        let (ar, s) = (Collective::AllReduce, 64usize << 20);
        for kind in KINDS {
            let p = Params::of(kind);
            let c = choose(ar, s, 2, kind, AlgoSet::ALL, None);
            assert_eq!(c.algo, Algo::Tree, "{kind:?}");
            let bytes_only = s as f64 * (p.beta + p.gamma / 2.0);
            let k = (s as f64 / 2.0 / c.chunk as f64).ceil();
            assert!((c.predicted_us - (bytes_only + (k + 1.0) * p.alpha)).abs() < 1e-6 * bytes_only, "{kind:?}: {c:?}");
            let ring = predict(ar, Algo::Ring, s, 2, c.chunk, &p).unwrap();
            assert!((ring - (bytes_only + 2.0 * k * p.alpha)).abs() < 1e-6 * bytes_only, "{kind:?}: ring {ring}");
            assert!(predict(ar, Algo::Rd, s, 2, c.chunk, &p).unwrap() > ring);
        }
    }

    #[test]
    fn the_choice_moves_from_latency_to_bandwidth_algorithms_once() {
        // Sweeping the size up, the choice moves from recursive doubling (fewest hops, most
        // bytes) to the double tree to the ring (most hops, fewest bytes per rank), never back
        // (but for ties: on 2 ranks with one chunk per half, the ring and the tree cost the same).
        let ar = Collective::AllReduce;
        const ORDER: [Algo; 3] = [Algo::Rd, Algo::Tree, Algo::Ring];
        let order = |a| ORDER.iter().position(|&x| x == a).unwrap();
        for kind in KINDS {
            let p = Params::of(kind);
            for n in 2..=16 {
                let mut last = 0;
                for shift in 3..=26 {
                    let c = choose(ar, 1 << shift, n, kind, AlgoSet::ALL, None);
                    let best = |a| {
                        CHUNK_CANDIDATES
                            .iter()
                            .map(|&ch| predict(ar, a, 1 << shift, n, ch, &p).unwrap())
                            .fold(f64::INFINITY, f64::min)
                    };
                    let tied: Vec<usize> =
                        (0..3).filter(|&i| best(ORDER[i]) <= c.predicted_us * (1.0 + 1e-12)).collect();
                    assert!(tied.contains(&order(c.algo)));
                    assert!(*tied.last().unwrap() >= last, "{kind:?} n={n}: back to {} at 2^{shift} B", c.algo);
                    last = tied[0];
                }
                assert!(last > 0, "{kind:?} n={n}: 64 MiB should not take recursive doubling");
                if n >= 3 {
                    assert_eq!(last, 2, "{kind:?} n={n}: 64 MiB should take the ring");
                }
            }
        }
    }

    #[test]
    fn transport_kind_is_the_slowest_link() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(TransportKind::for_hosts(&h(&["a", "a", "a"]), true), TransportKind::Shm);
        assert_eq!(TransportKind::for_hosts(&h(&["a", "a", "a"]), false), TransportKind::Tcp);
        assert_eq!(TransportKind::for_hosts(&h(&["a", "b", "a"]), true), TransportKind::Tcp);
        assert_eq!(TransportKind::for_hosts(&h(&["a"]), true), TransportKind::Shm);
    }

    #[test]
    fn model_prefers_low_latency_for_small_and_the_ring_for_large_on_many_ranks() {
        let p = Params::of(TransportKind::Tcp);
        let t = |a, bytes| predict(Collective::AllReduce, a, bytes, 16, 512 << 10, &p).unwrap();
        // Small: the ring's 30 hops cost more than the tree's or recursive doubling's few.
        assert!(t(Algo::Tree, 8) < t(Algo::Ring, 8));
        assert!(t(Algo::Rd, 8) < t(Algo::Ring, 8));
        // Large: recursive doubling moves log2(n) times the data.
        assert!(t(Algo::Ring, 64 << 20) < t(Algo::Rd, 64 << 20));
        // A prediction grows with the size.
        for a in [Algo::Ring, Algo::Tree, Algo::Rd] {
            assert!(t(a, 1 << 10) <= t(a, 1 << 20) && t(a, 1 << 20) <= t(a, 64 << 20));
        }
        assert_eq!(predict(Collective::AllGather, Algo::Tree, 100, 4, 64, &p), None);
    }
}
