//! Which executor runs a host call: the shared-memory lane, the host arena (with or without its
//! sharing probe and that probe's back-off), or the call's plan on the engine. Pure: the
//! back-off is a value ([`Backoff`]) the communicator keeps and hands in with each
//! [`PathRequest`], and every rank that makes the same calls holds the same one.

use super::super::tuning::TransportKind;
use super::super::Collective;

/// Largest all-reduce (bytes per rank) that takes [`Path::Lane`]: one lane slot of the
/// shared-memory transport (`transport::shm::lane`, which checks at compile time that its
/// slot holds it). Above it a plan's first exchange already costs what the lane saves
/// (docs/PERFORMANCE.md, route table).
pub const LANE_MAX_BYTES: usize = 1000;
/// Most partner rounds of [`Path::Lane`] (log2 of the largest communicator it serves).
pub const LANE_MAX_ROUNDS: usize = 20;
/// Fewest ranks of the arena on a crowded host without `OXCCL_ARENA=1`: on two ranks the pair
/// paths (one-shot, ring stream) need no barrier per call.
pub const ARENA_MIN_RANKS: usize = 3;
/// Smallest all-reduce (bytes) on two ranks that first asks, at one arena barrier, whether
/// every buffer is in shareable host memory (then the arena reads them in place: 1.2-2x the
/// pair ring from 64 KiB on, docs/PERFORMANCE.md, route table). Below it the barrier costs
/// more than a percent of a call that then runs without it.
pub const ARENA_PROBE_MIN: usize = 256 << 10;
/// Most calls skipped between two probes that find an unshared buffer: a program whose buffers
/// are never shared pays for one barrier in this many calls.
pub const PROBE_MAX_SKIP: u32 = 1024;

/// Where the sharing probe's back-off stands: after a probe that found an unshared buffer the
/// next calls skip it (1, 2, 4, ... up to [`PROBE_MAX_SKIP`] calls); a probe that finds every
/// buffer shared ends the skipping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Calls left to skip.
    pub skip: u32,
    /// Calls skipped after the last unshared probe.
    pub backoff: u32,
}

impl Backoff {
    /// After a probe whose outcome was `all` (every buffer shared).
    pub fn probed(self, all: bool) -> Backoff {
        let next = if all { 0 } else { (self.backoff * 2).clamp(1, PROBE_MAX_SKIP) };
        Backoff { skip: next, backoff: next }
    }

    /// After a call that could have probed and did not ([`PathRequest::may_probe`]).
    pub fn skipped(self) -> Backoff {
        Backoff { skip: self.skip.saturating_sub(1), ..self }
    }
}

/// Everything the choice of a host call's executor depends on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PathRequest {
    /// The collective.
    pub coll: Collective,
    /// NCCL's count argument times the element size (bytes per rank).
    pub bytes: usize,
    /// Ranks of the communicator.
    pub nranks: usize,
    /// The communicator's link kind: the plan-less paths need shared memory.
    pub transport: TransportKind,
    /// Whether the call runs with other operations of its communicator in one group (merged
    /// into one plan).
    pub grouped: bool,
    /// Whether an algorithm is forced (`OXCCL_ALGO`, `NCCL_ALGO`, `Communicator::set_tuning`):
    /// then the call runs the forced algorithm's plan.
    pub forced: bool,
    /// Whether reductions must be bitwise reproducible: the lane reduces in an order of its
    /// own, the arena folds in rank order as the schedules of `algo::det` do.
    pub deterministic: bool,
    /// Whether this host has more ranks than CPUs ([`super::Request::crowded`]).
    pub crowded: bool,
    /// `OXCCL_ARENA`: `Some(true)` forces the arena (from two ranks, no probe), `Some(false)`
    /// turns it off, `None` leaves it to `crowded` and the probe.
    pub arena: Option<bool>,
    /// `OXCCL_LOCAL_REGISTER`: whether host buffers may be shared with peers (the probe's
    /// question).
    pub local_register: bool,
    /// The probe's back-off.
    pub backoff: Backoff,
}

impl PathRequest {
    /// Whether this call is one the sharing probe could ask about: a two-rank all-reduce from
    /// [`ARENA_PROBE_MIN`] bytes over shared memory, sharing on, `OXCCL_ARENA` unset. A call
    /// for which this holds and that does not probe counts in the back-off
    /// ([`Backoff::skipped`]).
    pub fn may_probe(&self) -> bool {
        self.coll == Collective::AllReduce
            && self.transport == TransportKind::Shm
            && self.nranks == 2
            && self.bytes >= ARENA_PROBE_MIN
            && self.local_register
            && self.arena.is_none()
    }
}

/// Which executor runs a host call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The small all-reduce through the shared-memory lane (`engine::lane`).
    Lane,
    /// The all-reduce through the host arena (`engine::arena`); `probe`: first ask at one
    /// barrier whether every buffer is shareable, and run the call's plan when one is not.
    Arena {
        /// Whether the arena first probes the buffers.
        probe: bool,
    },
    /// The call's plan ([`super::select`]) on the engine.
    Plan,
}

impl Path {
    /// Whether the call runs without a plan of its own (the lane or the arena).
    pub fn planless(self) -> bool {
        self != Path::Plan
    }
}

/// Whether `nranks` ranks take the lane for `bytes` per rank: a power-of-two communicator of
/// at most 2^[`LANE_MAX_ROUNDS`] ranks, 1 to [`LANE_MAX_BYTES`] bytes.
pub fn lane_fits(nranks: usize, bytes: usize) -> bool {
    nranks >= 2
        && nranks.is_power_of_two()
        && nranks.trailing_zeros() as usize <= LANE_MAX_ROUNDS
        && bytes > 0
        && bytes <= LANE_MAX_BYTES
}

/// Chooses the executor of the host call `r`, in order:
/// 1. not an all-reduce, not over shared memory, in a group of several operations, or an
///    algorithm forced → [`Path::Plan`];
/// 2. not deterministic and [`lane_fits`] → [`Path::Lane`];
/// 3. the probe due ([`PathRequest::may_probe`], no calls left to skip) → arena with probe;
/// 4. the arena on (`OXCCL_ARENA`, default: crowded) and at least [`ARENA_MIN_RANKS`] ranks
///    (two with `OXCCL_ARENA=1`), a non-empty call → arena without probe;
/// 5. otherwise [`Path::Plan`].
///
/// Depends only on values every rank shares (but `crowded`, see [`super::Request::crowded`]),
/// so every rank of a matched call takes the same path.
pub fn path(r: &PathRequest) -> Path {
    if r.coll != Collective::AllReduce || r.transport != TransportKind::Shm || r.grouped || r.forced {
        return Path::Plan;
    }
    if !r.deterministic && lane_fits(r.nranks, r.bytes) {
        return Path::Lane;
    }
    if r.may_probe() && r.backoff.skip == 0 {
        return Path::Arena { probe: true };
    }
    let min_ranks = if r.arena == Some(true) { 2 } else { ARENA_MIN_RANKS };
    if r.arena.unwrap_or(r.crowded) && r.nranks >= min_ranks && r.bytes > 0 {
        return Path::Arena { probe: false };
    }
    Path::Plan
}
