//! Table-driven cases of [`super::path`] and the probe's back-off, each with its reason.

use super::host::*;
use crate::algo::tuning::TransportKind;
use crate::algo::Collective;

/// A two-rank all-reduce of `bytes` over shared memory, on a host with a CPU per rank, default
/// settings (sharing on, `OXCCL_ARENA` unset), no back-off.
fn base(bytes: usize, nranks: usize) -> PathRequest {
    PathRequest {
        coll: Collective::AllReduce,
        bytes,
        nranks,
        transport: TransportKind::Shm,
        grouped: false,
        forced: false,
        deterministic: false,
        crowded: false,
        arena: None,
        local_register: true,
        backoff: Backoff::default(),
    }
}

const LANE: Path = Path::Lane;
const PROBE: Path = Path::Arena { probe: true };
const ARENA: Path = Path::Arena { probe: false };
const PLAN: Path = Path::Plan;

#[test]
fn every_host_call_gets_its_executor_from_the_table() {
    let big = ARENA_PROBE_MIN;
    let skipping = Backoff { skip: 3, backoff: 4 };
    let cases: Vec<(&str, PathRequest, Path)> = vec![
        ("8 B on 2 ranks: the lane", base(8, 2), LANE),
        ("the lane's largest message", base(LANE_MAX_BYTES, 4), LANE),
        ("one byte over the lane's slot: a plan", base(LANE_MAX_BYTES + 1, 2), PLAN),
        ("an empty call has nothing to move: a plan", base(0, 2), PLAN),
        ("the lane pairs ranks by rounds: 3 ranks run a plan", base(8, 3), PLAN),
        ("the lane on 2^20 ranks", base(8, 1 << LANE_MAX_ROUNDS), LANE),
        ("no lane past 2^20 ranks", base(8, 1 << (LANE_MAX_ROUNDS + 1)), PLAN),
        ("over TCP no plan-less path", PathRequest { transport: TransportKind::Tcp, ..base(8, 2) }, PLAN),
        ("other collectives run plans", PathRequest { coll: Collective::AllGather, ..base(8, 2) }, PLAN),
        ("a forced algorithm runs its plan", PathRequest { forced: true, ..base(8, 2) }, PLAN),
        ("a forced algorithm: no probe", PathRequest { forced: true, ..base(big, 2) }, PLAN),
        ("merged into a group: a plan", PathRequest { grouped: true, ..base(8, 2) }, PLAN),
        ("deterministic: not the lane (its own order)", PathRequest { deterministic: true, ..base(8, 2) }, PLAN),
        (
            "deterministic on a crowded host: the arena folds in rank order",
            PathRequest { deterministic: true, crowded: true, ..base(8, 4) },
            ARENA,
        ),
        ("2 ranks from the probe's minimum: probe", base(big, 2), PROBE),
        ("below the probe's minimum the barrier costs too much", base(big - 1, 2), PLAN),
        ("the probe asks 2 ranks only", base(big, 3), PLAN),
        ("sharing off: nothing to probe", PathRequest { local_register: false, ..base(big, 2) }, PLAN),
        ("in the back-off: no probe", PathRequest { backoff: skipping, ..base(big, 2) }, PLAN),
        ("OXCCL_ARENA=0: no arena, no probe", PathRequest { arena: Some(false), ..base(big, 2) }, PLAN),
        ("OXCCL_ARENA=1: the arena from 2 ranks, no probe", PathRequest { arena: Some(true), ..base(big, 2) }, ARENA),
        ("OXCCL_ARENA=1 keeps the lane for small calls", PathRequest { arena: Some(true), ..base(8, 2) }, LANE),
        ("OXCCL_ARENA=1 on 3 ranks", PathRequest { arena: Some(true), ..base(8, 3) }, ARENA),
        ("crowded: the arena from 3 ranks", PathRequest { crowded: true, ..base(1 << 20, 3) }, ARENA),
        ("crowded, 2 ranks: not the arena (the pair paths)", PathRequest { crowded: true, ..base(4096, 2) }, PLAN),
        ("crowded, 2 ranks, large: the probe still asks", PathRequest { crowded: true, ..base(big, 2) }, PROBE),
        ("crowded but OXCCL_ARENA=0", PathRequest { crowded: true, arena: Some(false), ..base(1 << 20, 4) }, PLAN),
        ("crowded, small, power of two: the lane first", PathRequest { crowded: true, ..base(8, 4) }, LANE),
        ("crowded, an empty call: a plan", PathRequest { crowded: true, ..base(0, 3) }, PLAN),
    ];
    for (why, r, want) in cases {
        assert_eq!(path(&r), want, "{why}: {r:?}");
        assert_eq!(want.planless(), want != PLAN, "{why}");
    }
}

#[test]
fn the_probe_backs_off_doubling_up_to_its_cap_and_a_shared_probe_resets_it() {
    let mut b = Backoff::default();
    let mut skips = Vec::new();
    for _ in 0..13 {
        b = b.probed(false);
        assert_eq!(b.skip, b.backoff, "skips what it backs off");
        skips.push(b.skip);
    }
    assert_eq!(skips, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]);
    assert_eq!(skips[12], PROBE_MAX_SKIP);
    // Skipped calls count down to the next probe, never below zero.
    let r = |b| PathRequest { backoff: b, ..base(ARENA_PROBE_MIN, 2) };
    let mut b = Backoff::default().probed(false).probed(false);
    assert_eq!(b.skip, 2);
    for _ in 0..2 {
        assert_eq!(path(&r(b)), Path::Plan, "skipping");
        b = b.skipped();
    }
    assert_eq!(path(&r(b)), Path::Arena { probe: true }, "due again");
    assert_eq!(b.skipped().skip, 0);
    // A probe that finds every buffer shared ends the back-off.
    assert_eq!(b.probed(true), Backoff::default());
    assert_eq!(b.probed(true).probed(false).skip, 1, "and the next unshared one starts over");
}

#[test]
fn only_calls_the_probe_could_ask_about_count_as_skipped() {
    let big = ARENA_PROBE_MIN;
    assert!(base(big, 2).may_probe());
    for (why, r) in [
        ("small", base(big - 1, 2)),
        ("3 ranks", base(big, 3)),
        ("TCP", PathRequest { transport: TransportKind::Tcp, ..base(big, 2) }),
        ("all-gather", PathRequest { coll: Collective::AllGather, ..base(big, 2) }),
        ("sharing off", PathRequest { local_register: false, ..base(big, 2) }),
        ("OXCCL_ARENA=1", PathRequest { arena: Some(true), ..base(big, 2) }),
    ] {
        assert!(!r.may_probe(), "{why}");
    }
}
