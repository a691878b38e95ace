//! Table-driven cases of [`super::device`], [`super::device_flow`], [`super::ipc_all_reduce`]
//! and [`super::ipc_refusal`], each with its reason.

use super::device::*;
use crate::algo::Collective;

const AR: Collective = Collective::AllReduce;
const AG: Collective = Collective::AllGather;
const RS: Collective = Collective::ReduceScatter;
const SEND: Collective = Collective::Send { peer: 1 };
const RECV: Collective = Collective::Recv { peer: 0 };

fn call(coll: Collective) -> DeviceCall {
    DeviceCall { coll, elem: 4, empty: false, scalar: ScalarKind::None }
}

fn with(coll: Collective, scalar: ScalarKind) -> DeviceCall {
    DeviceCall { scalar, ..call(coll) }
}

const AREA: usize = 1 << 20;

#[test]
fn every_device_call_gets_its_flow_from_the_table() {
    use DeviceFlow::*;
    let ipc = Some(AREA);
    let cases: Vec<(&str, DeviceCall, usize, Option<usize>, DeviceFlow)> = vec![
        ("a plain all-reduce has its own flow in either mode", call(AR), 4, None, AllReduce),
        ("... in IPC mode too", call(AR), 4, ipc, AllReduce),
        ("an all-reduce with a factor runs staged (scaled on the host)", with(AR, ScalarKind::Host), 4, ipc, Staged),
        ("all-gather: one-shot in IPC mode (2 device copies per byte)", call(AG), 4, ipc, OneShot),
        ("all-gather with the proxy: staged", call(AG), 4, None, Staged),
        ("one rank: nothing to exchange, staged", call(AG), 1, ipc, Staged),
        ("broadcast", call(Collective::Broadcast { root: 2 }), 4, ipc, OneShot),
        ("reduce", call(Collective::Reduce { root: 0 }), 4, ipc, OneShot),
        ("gather", call(Collective::Gather { root: 0 }), 4, ipc, OneShot),
        ("scatter", call(Collective::Scatter { root: 0 }), 4, ipc, OneShot),
        ("all-to-all: one block per destination fits 16 B", call(Collective::AllToAll), 4, Some(16), OneShot),
        ("all-to-all: 15 B holds no 4 blocks of 4 B", call(Collective::AllToAll), 4, Some(15), Staged),
        ("reduce-scatter with a host factor: applied before the one-shot", with(RS, ScalarKind::Host), 4, ipc, OneShot),
        ("reduce with a host factor", with(Collective::Reduce { root: 1 }, ScalarKind::Host), 4, ipc, OneShot),
        ("a device factor is read in stream order: staged", with(RS, ScalarKind::Device), 4, ipc, Staged),
        ("all-gather has no factor to apply: staged", with(AG, ScalarKind::Host), 4, ipc, Staged),
        ("a send: the exchange in IPC mode", call(SEND), 4, ipc, Exchange),
        ("a receive: the exchange in IPC mode", call(RECV), 4, ipc, Exchange),
        ("a send with the proxy: staged", call(SEND), 4, None, Staged),
        ("a 4-rank exchange of 255 B has 0-byte blocks (64 B granules): staged", call(SEND), 4, Some(255), Staged),
        ("... 256 B: 64-byte blocks hold a 4-byte element", call(SEND), 4, Some(256), Exchange),
    ];
    for (why, c, n, area, want) in cases {
        assert_eq!(device_flow(&c, n, area), want, "{why}: {c:?} on {n} ranks, area {area:?}");
    }
    assert_eq!(exchange_block(3, 1000), 320, "a third of the area, in 64-byte granules");
    assert_eq!(exchange_block(0, 1000), 960, "no ranks: the whole area");
}

#[test]
fn a_group_runs_on_ipc_only_when_every_call_has_a_flow() {
    use DeviceFlow::*;
    let req = |calls, deterministic, ipc_area| DeviceRequest { calls, nranks: 4, deterministic, ipc_area };
    let ipc = Some(AREA);
    let ag_send = [call(AG), call(SEND), call(AR)];
    let staged_one = [call(AG), with(RS, ScalarKind::Device)];
    let (ar, ag, ag_send_only) = ([call(AR)], [call(AG)], [call(AG), call(SEND)]);
    let empty_staged = [call(AG), DeviceCall { empty: true, ..with(RS, ScalarKind::Device) }];
    let cases: Vec<(&str, DeviceRequest<'_>, DeviceRoute)> = vec![
        ("one plain all-reduce: straight on its stream", req(&ar, false, None), DeviceRoute::AllReduce),
        ("... whatever the mode", req(&ar, false, ipc), DeviceRoute::AllReduce),
        ("deterministic: the host's fixed-order schedule", req(&ar, true, ipc), DeviceRoute::Staged),
        (
            "an all-reduce in a group runs its flow among the others",
            req(&ag_send, false, ipc),
            DeviceRoute::Ipc(vec![OneShot, Exchange, AllReduce]),
        ),
        ("with the proxy everything is staged", req(&ag_send, false, None), DeviceRoute::Staged),
        ("one staged call stages the whole group", req(&staged_one, false, ipc), DeviceRoute::Staged),
        ("an empty call needs no flow", req(&empty_staged, false, ipc), DeviceRoute::Ipc(vec![OneShot, Staged])),
        ("deterministic and a reduction in the group: staged", req(&ag_send, true, ipc), DeviceRoute::Staged),
        (
            "deterministic, nothing reduces: IPC flows",
            req(&ag_send_only, true, ipc),
            DeviceRoute::Ipc(vec![OneShot, Exchange]),
        ),
        ("a single all-gather in IPC mode", req(&ag, false, ipc), DeviceRoute::Ipc(vec![OneShot])),
    ];
    for (why, r, want) in cases {
        assert_eq!(device(&r), want, "{why}: {r:?}");
    }
    let one_rank = DeviceRequest { calls: &ag, nranks: 1, deterministic: false, ipc_area: ipc };
    assert_eq!(device(&one_rank), DeviceRoute::Staged, "one rank has no peers to map");
}

#[test]
fn ipc_all_reduces_up_to_the_small_slot_take_the_one_shot() {
    assert!(ipc_small(8) && ipc_small(0) && ipc_small(IPC_SMALL_BYTES), "one barrier, fits a slot");
    assert!(!ipc_small(IPC_SMALL_BYTES + 1), "past the slot: reduce-scatter + all-gather");
}

#[test]
fn ipc_is_refused_up_front_only_for_the_setting_several_hosts_or_too_many_ranks() {
    assert_eq!(ipc_refusal(true, true, 2), None);
    assert_eq!(ipc_refusal(true, true, IPC_MAX_RANKS), None);
    let cases = [
        ("OXCCL_CUDA_IPC=0", ipc_refusal(false, true, 2), "OXCCL_CUDA_IPC=0"),
        ("several hosts", ipc_refusal(true, false, 2), "ranks on several hosts"),
        ("too many ranks", ipc_refusal(true, true, IPC_MAX_RANKS + 1), "513 ranks, more than the 512 CUDA IPC serves"),
        ("the setting first", ipc_refusal(false, false, IPC_MAX_RANKS + 1), "OXCCL_CUDA_IPC=0"),
    ];
    for (why, got, want) in cases {
        assert_eq!(got.as_deref(), Some(want), "{why}");
    }
}

#[test]
fn an_ipc_all_reduce_takes_its_flow_from_size_placement_capture_and_setting() {
    use IpcAllReduceFlow::*;
    let (small, big) = (IPC_SMALL_BYTES, IPC_DIRECT_MIN);
    let mid = IPC_SMALL_BYTES + 1; // above the small slot, below the direct flow
    let (sep, loc, mixed) = (
        IpcPlacement { separate: true, local: false },
        IpcPlacement { separate: false, local: true },
        IpcPlacement { separate: false, local: false },
    );
    // (bytes, captured, placement, OXCCL_CUDA_DIRECT, flow, reason)
    let table = [
        (small, false, sep, true, Small, "a small message always takes the small slot"),
        (small, true, loc, true, SmallCaptured, "captured: the small flow with the capture flags"),
        (mid, false, sep, true, Staged, "below the direct minimum: staged"),
        (big, false, loc, true, Board, "one process: the buffers published on the device"),
        (big, false, loc, false, Staged, "one process with OXCCL_CUDA_DIRECT=0: staged"),
        (big, false, sep, true, Rounds { publish: true }, "processes of their own: rounds"),
        (big, false, sep, false, Rounds { publish: false }, "rounds, this rank's buffers through its regions"),
        (big, true, sep, true, Shared { publish: true }, "captured between processes: a host exchange"),
        (big, true, sep, false, Shared { publish: false }, "captured, the rank offers nothing: staged by all"),
        (big, false, mixed, true, Staged, "several ranks per process, over processes: staged"),
    ];
    for (bytes, captured, placement, cuda_direct, flow, why) in table {
        let r = IpcAllReduce { bytes, captured, placement, cuda_direct, ll: false, seq: 1 };
        assert_eq!(ipc_all_reduce(&r), flow, "{why}: {r:?}");
    }
}

#[test]
fn an_ipc_all_reduce_takes_the_ll_flow_only_when_set_up_small_uncaptured_and_numbered() {
    use IpcAllReduceFlow::*;
    let sep = IpcPlacement { separate: true, local: false };
    // (bytes, captured, LL set up, sequence number, flow, reason)
    let table = [
        (8, false, true, 1, Ll, "set up, 8 bytes: one kernel launch"),
        (IPC_LL_BYTES, false, true, 7, Ll, "the largest LL message"),
        (IPC_LL_BYTES + 1, false, true, 7, Small, "past the LL slots: the small flow"),
        (0, false, true, 7, Small, "an empty message: nothing to launch, the small flow as before"),
        (8, true, true, 7, SmallCaptured, "captured: a replay would repeat the LL flag"),
        (8, false, false, 7, Small, "the ranks did not set it up"),
        (8, false, true, 0, Small, "sequence number 0 is the zeroed slots' value"),
        (IPC_DIRECT_MIN, false, true, 7, Rounds { publish: true }, "a large message never takes it"),
    ];
    for (bytes, captured, ll, seq, flow, why) in table {
        let r = IpcAllReduce { bytes, captured, placement: sep, cuda_direct: true, ll, seq };
        assert_eq!(ipc_all_reduce(&r), flow, "{why}: {r:?}");
        assert_eq!(ipc_ll(&r), flow == Ll, "{why}: ipc_ll agrees with the flow");
    }
    const _: () = assert!(IPC_LL_BYTES <= IPC_SMALL_BYTES, "the LL flow only replaces the small flow");
}
