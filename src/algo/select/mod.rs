//! The one place that chooses how a call runs, from one table of thresholds with their reasons
//! next to them:
//! - [`path`] ([`PathRequest`]): which executor runs a host call: the shared-memory lane, the
//!   host arena (with its sharing probe and the probe's back-off), or a plan on the engine;
//! - [`select`] ([`Request`]): the plan: all-reduce's special paths (one-shot exchange, pair
//!   stream, hierarchical over hosts, direct on a crowded host) first, then the cost model
//!   ([`tuning::choose`]); fixed-order schedules under `OXCCL_DETERMINISTIC`;
//! - [`recipe`] ([`PlanInputs`]): a host route turned into this rank's plan builder and its
//!   cache key.
//!
//! Pure: everything a choice depends on is in its request (state such as the probe's back-off
//! is a value handed in), so every rank that asks the same question gets the same answer. The
//! executors run the route they are given and decide nothing.

use super::tuning::{self, Algo, AlgoSet, Choice, TransportKind};
use super::{Collective, Encoding, DEFAULT_CHUNK};

mod device;
#[cfg(test)]
mod device_tests;
mod host;
#[cfg(test)]
mod host_tests;
mod plan;

pub use device::{
    device, device_flow, exchange_block, ipc_all_reduce, ipc_direct, ipc_ll, ipc_refusal, ipc_small, oneshot_blocks,
    oneshot_supported, DeviceCall, DeviceFlow, DeviceRequest, DeviceRoute, IpcAllReduce, IpcAllReduceFlow,
    IpcPlacement, ScalarKind, EXCHANGE_ALIGN, IPC_DIRECT_MIN, IPC_LL_BYTES, IPC_MAX_RANKS, IPC_SMALL_BYTES,
};
pub use host::{
    lane_fits, path, Backoff, Path, PathRequest, ARENA_MIN_RANKS, ARENA_PROBE_MIN, LANE_MAX_BYTES, LANE_MAX_ROUNDS,
    PROBE_MAX_SKIP,
};
pub use plan::{recipe, Note, PlanInputs, PlanRecipe};

/// Everything the choice of one call depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// The collective.
    pub coll: Collective,
    /// NCCL's count argument times the element size (bytes per rank).
    pub bytes: usize,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// The link kind the cost model assumes.
    pub transport: TransportKind,
    /// Algorithms the settings allow; `None`: all, and the special paths are open.
    pub allowed: Option<AlgoSet>,
    /// Fixed pipeline chunk in bytes; `None`: the cost model's (or [`DEFAULT_CHUNK`]).
    pub chunk: Option<usize>,
    /// Whether the reduction is exact and commutative ([`super::oneshot::exact_commutative`]),
    /// so the one-shot exchange's order of operands cannot change the result.
    pub exact: bool,
    /// Largest all-reduce (bytes) on two ranks that takes the one-shot exchange.
    pub oneshot_bytes: usize,
    /// Whether the ranks are spread over several hosts, some sharing one
    /// ([`super::hier::applies`]).
    pub hierarchical: bool,
    /// Whether this host has more ranks than CPUs for them ([`crate::wait::host_cpus`]): the
    /// same on every rank of a host.
    pub crowded: bool,
    /// Whether reductions must be bitwise reproducible
    /// ([`crate::config::Config::deterministic`]): they take [`Route::Deterministic`].
    pub deterministic: bool,
    /// The wire encoding between hosts the settings ask for ([`crate::config::Config::compress`]
    /// or [`tuning::Overrides::compress`]).
    pub compress: Encoding,
    /// Whether the call's values may be compressed: `f32` elements under sum or average.
    pub compressible: bool,
    /// Number of hosts the ranks are on.
    pub hosts: usize,
}

/// Smallest all-reduce (bytes per rank) that takes the direct schedule on a crowded host.
pub const CROWDED_DIRECT_MIN: usize = 256 << 10;
/// Chunk of the direct schedule on a crowded host.
pub const CROWDED_CHUNK: usize = 64 << 10;

/// Smallest all-reduce (bytes) on two ranks over shared memory (not taking the one-shot
/// exchange) that takes [`Route::PairStream`], whatever the cost model says.
pub const PAIR_STREAM_MIN: usize = 256 << 10;
/// Chunk of [`Route::PairStream`] below [`PAIR_STREAM_FINE_MIN`]: one of the ring's publication
/// slices.
pub const PAIR_STREAM_CHUNK: usize = 64 << 10;
/// Smallest all-reduce (bytes) whose [`Route::PairStream`] runs in [`PAIR_STREAM_FINE_CHUNK`].
pub const PAIR_STREAM_FINE_MIN: usize = 16 << 20;
/// Chunk of [`Route::PairStream`] from [`PAIR_STREAM_FINE_MIN`], where the message streams from
/// memory: with the chunk's reduction forwarded block by block, what one chunk of the schedule
/// keeps live (its input, output and the ring's copies of both directions) stays inside a
/// core's second-level cache.
pub const PAIR_STREAM_FINE_CHUNK: usize = 32 << 10;

/// The chunk of [`Route::PairStream`] for an all-reduce of `bytes` (`fixed`: the settings' chunk,
/// which wins).
pub fn pair_stream_chunk(bytes: usize, fixed: Option<usize>) -> usize {
    fixed.unwrap_or(if bytes >= PAIR_STREAM_FINE_MIN { PAIR_STREAM_FINE_CHUNK } else { PAIR_STREAM_CHUNK })
}

/// How a call runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Route {
    /// Two-rank small all-reduce: each rank sends its whole buffer and reduces what arrives.
    OneShot,
    /// Two-rank all-reduce over shared memory above the one-shot exchange: the ring in chunks
    /// of [`pair_stream_chunk`], each chunk reduced, forwarded and gathered before the next
    /// starts ([`super::ring::all_reduce_ahead`] with no lookahead), so a chunk's bytes are
    /// still in the caches when they are forwarded and gathered, where the step-by-step ring
    /// streams the whole message through the caches once per step (docs/PERFORMANCE.md,
    /// route table).
    PairStream,
    /// All-reduce over several hosts: within each host, then across, then within again.
    Hierarchical,
    /// The algorithm and chunk size of the cost model (or of the settings that force one).
    Tuned(Choice),
    /// A reduction under `OXCCL_DETERMINISTIC`: the fixed-order schedule of [`super::det`]
    /// in chunks of this many bytes (the settings' chunk, else [`super::det::DET_CHUNK`]),
    /// whatever the algorithm settings.
    Deterministic(usize),
    /// An `f32` sum/avg all-reduce over several hosts (or reduce-scatter or reduce with one
    /// rank per host) with `OXCCL_COMPRESS` on: the plan of
    /// [`super::compress`], the inter-host stage in this encoding, in chunks of this many bytes
    /// (the settings' chunk, else [`super::compress::COMPRESS_CHUNK`]).
    Compressed(Encoding, usize),
}

impl Route {
    /// Short name for logs and oxccl-perf's `auto:<name>` label.
    pub fn name(&self) -> &'static str {
        match self {
            Route::OneShot => "oneshot",
            Route::PairStream => "ring-stream",
            Route::Hierarchical => "hier",
            Route::Tuned(c) => c.algo.name(),
            Route::Deterministic(_) => "det",
            Route::Compressed(..) => "compressed",
        }
    }
}

/// Chooses how the call `r` runs.
pub fn select(r: &Request) -> Route {
    let reduction = matches!(r.coll, Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce { .. });
    if r.compress.lossy() && r.compressible && r.hosts > 1 && reduction {
        // Asked for by the settings, whatever the algorithm settings; fixed order too, so it
        // also serves OXCCL_DETERMINISTIC (the same bits run after run).
        return Route::Compressed(r.compress, r.chunk.unwrap_or(super::compress::COMPRESS_CHUNK));
    }
    if r.deterministic && r.coll.reduces() {
        // Only fixed-order schedules: every other route's reductions depend on the algorithm,
        // the chunk, the size or the placement.
        return Route::Deterministic(r.chunk.unwrap_or(super::det::DET_CHUNK));
    }
    if r.coll == Collective::AllReduce && r.allowed.is_none() {
        if r.nranks == 2 && r.bytes <= r.oneshot_bytes && r.exact {
            return Route::OneShot;
        }
        if r.hierarchical {
            return Route::Hierarchical;
        }
        if r.nranks == 2 && r.transport == TransportKind::Shm && !r.crowded && r.bytes >= PAIR_STREAM_MIN {
            // The ring moves ~4.5 passes of the message per rank where recursive doubling (the
            // model's pick up to a few MiB) moves ~5; in NCCL's chunk order its reductions are
            // forwarded as computed and each chunk's bytes stay in the caches
            // (docs/PERFORMANCE.md, route table).
            return Route::PairStream;
        }
        if r.crowded && r.transport == TransportKind::Shm && r.nranks >= 3 && r.bytes >= CROWDED_DIRECT_MIN {
            // Ranks outnumber the CPUs: every step of a schedule waits for its ranks to get a
            // CPU, and the direct schedule has 2 steps where the ring has 2 (n - 1), with the
            // ring's traffic (docs/PERFORMANCE.md, route table: 4 ranks on 2 CPUs, 1-128 MiB).
            let chunk = r.chunk.unwrap_or(CROWDED_CHUNK);
            return Route::Tuned(Choice::fixed(r.coll, Algo::Direct, r.bytes, r.nranks, chunk, r.transport));
        }
    }
    Route::Tuned(tuned(r))
}

/// The cost model's choice for `r`, ignoring the special paths.
pub fn tuned(r: &Request) -> Choice {
    let bytes = model_bytes(r.coll, r.nranks, r.bytes);
    let mut c = tuning::choose(r.coll, bytes, r.nranks, r.transport, r.allowed.unwrap_or(AlgoSet::ALL), r.chunk);
    if r.chunk.is_none() && c.algo == Algo::Rd {
        let capped = pair_chunk(r.nranks, r.transport, c.chunk);
        if capped != c.chunk {
            c.chunk = capped;
            let p = tuning::Params::of(r.transport);
            c.predicted_us = tuning::predict(r.coll, c.algo, bytes, r.nranks, c.chunk, &p).unwrap_or(c.predicted_us);
        }
    }
    c
}

/// The chunk of the special paths: the fixed one, else [`DEFAULT_CHUNK`] (capped by
/// [`pair_chunk`]).
pub fn special_chunk(r: &Request) -> usize {
    r.chunk.unwrap_or_else(|| pair_chunk(r.nranks, r.transport, DEFAULT_CHUNK))
}

/// Largest pipeline chunk of a two-rank exchange over shared memory: two of the shared-memory
/// ring's 64 KiB publication slices, well inside a core's L2.
pub const SHM_PAIR_CHUNK: usize = 128 << 10;

/// Caps the chunk of a two-rank exchange (one-shot, or recursive doubling, which is the same
/// single round on two ranks) over shared memory at [`SHM_PAIR_CHUNK`]. There every chunk's
/// send is ready at once and its receive waits only for that send, so chunks add no hop; the
/// cost model (whose per-hop latency describes ranks outnumbering cores) would pick one chunk
/// per megabyte, which makes the receive wait until the whole message is in the ring and then
/// streams input, rings and output through the core's cache a whole message apart
/// (docs/PERFORMANCE.md, route table). Rings and trees keep the model's chunk: there a chunk is a
/// pipeline hop. Depends only on values every rank shares, so plans match.
pub fn pair_chunk(nranks: usize, transport: TransportKind, chunk: usize) -> usize {
    if nranks == 2 && transport == TransportKind::Shm {
        chunk.min(SHM_PAIR_CHUNK)
    } else {
        chunk
    }
}

/// Bytes the cost model sees for a call of `bytes_per_rank`: the whole message, as nccl-tests
/// sizes it.
pub fn model_bytes(coll: Collective, n: usize, bytes_per_rank: usize) -> usize {
    match coll {
        Collective::AllGather
        | Collective::ReduceScatter
        | Collective::AllToAll
        | Collective::Gather { .. }
        | Collective::Scatter { .. } => bytes_per_rank.saturating_mul(n),
        _ => bytes_per_rank,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A plain request: exact, no override, one host.
    pub(crate) fn req(coll: Collective, bytes: usize, nranks: usize) -> Request {
        Request {
            coll,
            bytes,
            nranks,
            transport: TransportKind::Tcp,
            allowed: None,
            chunk: None,
            exact: true,
            oneshot_bytes: 256 << 10,
            hierarchical: false,
            crowded: false,
            deterministic: false,
            compress: Encoding::Exact,
            compressible: true,
            hosts: 1,
        }
    }

    #[test]
    fn compression_applies_to_f32_sum_reductions_between_hosts_only() {
        let ar = Collective::AllReduce;
        let on = |hosts, compressible| Request { compress: Encoding::Fp8, hosts, compressible, ..req(ar, 1 << 20, 4) };
        assert_eq!(select(&on(2, true)), Route::Compressed(Encoding::Fp8, super::super::compress::COMPRESS_CHUNK));
        assert_eq!(
            select(&Request { deterministic: true, chunk: Some(4096), ..on(2, true) }),
            Route::Compressed(Encoding::Fp8, 4096)
        );
        // A reduce-scatter or reduce, with one rank per host (req's 4 ranks on 4 hosts) or
        // several (on 2 hosts), too.
        for coll in [Collective::ReduceScatter, Collective::Reduce { root: 0 }, Collective::Reduce { root: 3 }] {
            for hosts in [2, 4] {
                let r = Request { coll, ..on(hosts, true) };
                assert!(matches!(select(&r), Route::Compressed(Encoding::Fp8, _)), "{r:?}");
            }
        }
        // One host, another type or operator, another collective, or off: as without it.
        for r in [
            on(1, true),
            on(2, false),
            Request { coll: Collective::ReduceScatter, ..on(1, true) },
            Request { coll: Collective::Broadcast { root: 0 }, ..on(4, true) },
            Request { compress: Encoding::Exact, ..on(2, true) },
        ] {
            assert_eq!(select(&r), select(&Request { compress: Encoding::Exact, ..r }), "{r:?}");
            assert!(!matches!(select(&r), Route::Compressed(..)));
        }
    }

    #[test]
    fn deterministic_reductions_take_the_fixed_order_schedule_whatever_else_is_set() {
        let det = |coll, bytes, n| Request { deterministic: true, ..req(coll, bytes, n) };
        for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::Reduce { root: 1 }] {
            for (bytes, n) in [(4, 2), (16, 2), (1 << 20, 4), (128 << 20, 3)] {
                assert_eq!(select(&det(coll, bytes, n)), Route::Deterministic(crate::algo::det::DET_CHUNK));
                let special = Request {
                    hierarchical: true,
                    crowded: true,
                    transport: TransportKind::Shm,
                    allowed: Some(AlgoSet::only(Algo::Tree)),
                    chunk: Some(4096),
                    ..det(coll, bytes, n)
                };
                assert_eq!(select(&special), Route::Deterministic(4096), "{special:?}");
            }
        }
        // Collectives that do not reduce keep their routes.
        let ag = det(Collective::AllGather, 1 << 20, 4);
        assert_eq!(select(&ag), Route::Tuned(tuned(&ag)));
    }

    #[test]
    fn crowded_shared_memory_hosts_run_mid_and_large_all_reduces_direct() {
        let ar = Collective::AllReduce;
        let crowded = |bytes, n| Request { crowded: true, transport: TransportKind::Shm, ..req(ar, bytes, n) };
        let direct = |r: &Request| matches!(select(r), Route::Tuned(c) if c.algo == Algo::Direct);
        assert!(direct(&crowded(CROWDED_DIRECT_MIN, 4)) && direct(&crowded(128 << 20, 3)));
        assert!(matches!(select(&crowded(1 << 20, 4)), Route::Tuned(c) if c.chunk == CROWDED_CHUNK));
        // Not below the size, not on 2 ranks, not over TCP, not when the host has a CPU per
        // rank, not for other collectives, not when an algorithm is forced.
        assert!(!direct(&crowded(CROWDED_DIRECT_MIN - 1, 4)) && !direct(&crowded(1 << 20, 2)));
        assert!(!direct(&Request { transport: TransportKind::Tcp, ..crowded(1 << 20, 4) }));
        assert!(!direct(&Request { crowded: false, ..crowded(1 << 20, 4) }));
        assert!(!direct(&Request { coll: Collective::AllGather, ..crowded(1 << 20, 4) }));
        assert!(!direct(&Request { allowed: Some(AlgoSet::only(Algo::Ring)), ..crowded(1 << 20, 4) }));
    }

    #[test]
    fn two_ranks_over_shared_memory_stream_the_ring_above_the_one_shot() {
        let ar = Collective::AllReduce;
        let pair = |bytes| Request { transport: TransportKind::Shm, ..req(ar, bytes, 2) };
        assert_eq!(select(&pair(256 << 10)), Route::OneShot);
        assert_eq!(select(&pair((256 << 10) + 1)), Route::PairStream);
        // Not exactly commutative (float max/min): no one-shot, the stream from its minimum.
        assert_eq!(select(&Request { exact: false, ..pair(PAIR_STREAM_MIN) }), Route::PairStream);
        assert_eq!(select(&pair(1 << 30)), Route::PairStream);
        // Its chunk: a publication slice, finer once the message streams from memory, the
        // settings' chunk when one is fixed.
        assert_eq!(pair_stream_chunk(PAIR_STREAM_MIN, None), PAIR_STREAM_CHUNK);
        assert_eq!(pair_stream_chunk(PAIR_STREAM_FINE_MIN - 1, None), PAIR_STREAM_CHUNK);
        assert_eq!(pair_stream_chunk(PAIR_STREAM_FINE_MIN, None), PAIR_STREAM_FINE_CHUNK);
        assert_eq!(pair_stream_chunk(1 << 20, Some(4096)), 4096);
        // Not on a crowded host, not over TCP, not on 3 ranks, not when an algorithm is forced,
        // not for other collectives.
        for bytes in [PAIR_STREAM_MIN + 1, PAIR_STREAM_FINE_MIN] {
            for r in [
                Request { crowded: true, ..pair(bytes) },
                Request { transport: TransportKind::Tcp, ..pair(bytes) },
                Request { nranks: 3, ..pair(bytes) },
                Request { allowed: Some(AlgoSet::only(Algo::Ring)), ..pair(bytes) },
                Request { coll: Collective::AllGather, ..pair(bytes) },
            ] {
                assert_eq!(select(&r), Route::Tuned(tuned(&r)), "{r:?}");
            }
        }
    }

    #[test]
    fn one_shot_only_for_small_exact_two_rank_all_reduce() {
        let ar = Collective::AllReduce;
        assert_eq!(select(&req(ar, 256 << 10, 2)), Route::OneShot);
        assert!(matches!(select(&req(ar, (256 << 10) + 1, 2)), Route::Tuned(_)));
        assert!(matches!(select(&req(ar, 16, 3)), Route::Tuned(_)));
        assert!(matches!(select(&Request { exact: false, ..req(ar, 16, 2) }), Route::Tuned(_)));
        assert!(matches!(select(&req(Collective::Broadcast { root: 0 }, 16, 2)), Route::Tuned(_)));
        let forced = Request { allowed: Some(AlgoSet::only(Algo::Tree)), ..req(ar, 16, 2) };
        assert!(matches!(select(&forced), Route::Tuned(c) if c.algo == Algo::Tree), "settings close special paths");
    }

    #[test]
    fn hierarchical_when_hosts_group_ranks_else_the_cost_model() {
        let r = Request { hierarchical: true, ..req(Collective::AllReduce, 1 << 20, 8) };
        assert_eq!(select(&r), Route::Hierarchical);
        let r = Request { hierarchical: true, ..req(Collective::AllGather, 1 << 20, 8) };
        let expect = tuning::choose(r.coll, 8 << 20, 8, r.transport, AlgoSet::ALL, None);
        assert_eq!(select(&r), Route::Tuned(expect), "all-gather is sized as the whole message");
        let r = Request { chunk: Some(64 << 10), ..req(Collective::AllReduce, 1 << 20, 8) };
        assert!(matches!(select(&r), Route::Tuned(c) if c.chunk == 64 << 10));
        let r = req(Collective::AllReduce, 16, 2);
        assert_eq!((special_chunk(&r), special_chunk(&Request { chunk: Some(4096), ..r })), (DEFAULT_CHUNK, 4096));
        let shm = Request { transport: TransportKind::Shm, ..r };
        assert_eq!(special_chunk(&shm), SHM_PAIR_CHUNK.min(DEFAULT_CHUNK));
    }
}
