//! How a call on device buffers runs: the communicator's device mode (CUDA IPC or the proxy on
//! pinned host staging) and, per call or group, the device flow (the IPC all-reduce, the
//! one-shot collective through the peers' mapped regions, the send/receive exchange, or the
//! host plans on pinned staging). Pure: the device executors (`device/`) set up the mode and
//! run the flows they are given.

use super::super::Collective;

/// Most ranks CUDA IPC serves: the ranks its flag pages have room for (`device::ipc`).
pub const IPC_MAX_RANKS: usize = 512;
/// Largest IPC all-reduce (bytes) that takes the small one-shot flow (copy in, one barrier,
/// every rank reduces every slot into its output: n - 1 kernel launches and no closing
/// barrier), and so the size of each of the two small slots of an IPC region. Every rank of
/// the small flow reduces the whole message from every slot; above it the chunked flow (two
/// barriers) splits the reduction among the ranks, so each reduces 1/n of it.
pub const IPC_SMALL_BYTES: usize = 16 << 10;
/// Smallest IPC all-reduce (bytes) that takes the direct flow ([`ipc_direct`];
/// `algo::window::all_reduce_direct`: each rank folds its segment of every rank's input
/// straight into every rank's output, 2nS bytes of traffic instead of the staged flow's copies
/// in and out). Between processes its enqueue meets the peers' on the host (an exchange of the
/// buffers' IPC handles through the communicator's host links, a few microseconds between
/// processes of one host); in one process each rank publishes its buffers with four more stream
/// writes than the staged flow's two copies. Smaller calls, where those costs outweigh the
/// copies' bytes, keep the staged flow.
pub const IPC_DIRECT_MIN: usize = 1 << 20;
/// Largest IPC all-reduce (bytes) that takes the LL flow (`device::small`: one kernel launch
/// that copies, waits for the peers' lines and folds) when the ranks set it up.
pub const IPC_LL_BYTES: usize = 8 << 10;
/// The granule of a send/receive exchange's per-peer block (bytes): a cache line, so blocks of
/// different peers never share one.
pub const EXCHANGE_ALIGN: usize = 64;

/// Whether and how a device call scales its input (PreMulSum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalarKind {
    /// No factor.
    None,
    /// A factor in host memory, read when the call is enqueued.
    Host,
    /// A factor in device memory, read in stream order.
    Device,
}

/// One device call as the selector sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCall {
    /// The collective (with its root or peer).
    pub coll: Collective,
    /// Bytes of one element.
    pub elem: usize,
    /// Whether the call moves nothing (count 0): it needs no flow, so it never sends a group to
    /// staging, but under `deterministic` a reducing one still counts as a reduction.
    pub empty: bool,
    /// Its PreMulSum factor.
    pub scalar: ScalarKind,
}

/// The flow of one device call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceFlow {
    /// The plain all-reduce: the IPC kernels, or the proxy's in-place all-reduce.
    AllReduce,
    /// The one-shot flow through the peers' mapped regions (`device::oneshot`).
    OneShot,
    /// A send or receive: the exchange through the peers' mapped regions (`device::p2p`).
    Exchange,
    /// The host plans on pinned staging (`device::exec`).
    Staged,
}

/// Everything the route of a device call, or of one communicator's part of a group, depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRequest<'a> {
    /// The calls, in issue order.
    pub calls: &'a [DeviceCall],
    /// Ranks of the communicator.
    pub nranks: usize,
    /// Whether reductions must be bitwise reproducible: they run the host's fixed-order
    /// schedules on pinned staging (the IPC kernels reduce in an order of their own).
    pub deterministic: bool,
    /// The communicator's device mode: `Some(area)` in CUDA IPC mode (`area`: bytes of each
    /// rank's input area), `None` for the proxy or while the mode is not set up yet (the
    /// [`DeviceRoute::AllReduce`] answer does not depend on it).
    pub ipc_area: Option<usize>,
}

/// How a device call, or a group's calls of one communicator, run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceRoute {
    /// A single plain all-reduce straight on its stream (`device::all_reduce`: the IPC
    /// kernels, or the proxy's in-place all-reduce).
    AllReduce,
    /// Every call through its IPC flow ([`DeviceFlow`] per call, never `Staged` for a call
    /// that moves something; empty calls are skipped), in issue order on the internal stream.
    Ipc(Vec<DeviceFlow>),
    /// Every call as host plans on pinned staging, as one job.
    Staged,
}

/// The flow of call `c` alone on `nranks` ranks (`ipc_area` as in [`DeviceRequest`]).
///
/// The cost model is a count of copies per byte: on one host the one-shot flow moves each byte
/// through two device copies (into the owner's region, out of it into the receiver's buffer),
/// while the staged path makes a device-to-host copy, runs the host plan over the host links
/// (at least one more copy per byte, more for ring and tree plans) and a host-to-device copy.
/// One-shot therefore wins at every size and rank count it can run, so it is taken whenever it
/// applies: IPC mode, a collective it implements, a PreMulSum factor it can apply (a host one
/// on reduce and reduce-scatter), and an area holding one element per staged block. A send or
/// receive takes the exchange when one element fits a peer's block.
pub fn device_flow(c: &DeviceCall, nranks: usize, ipc_area: Option<usize>) -> DeviceFlow {
    if c.coll == Collective::AllReduce && c.scalar == ScalarKind::None {
        return DeviceFlow::AllReduce;
    }
    let p2p = matches!(c.coll, Collective::Send { .. } | Collective::Recv { .. });
    match ipc_area {
        Some(area) if nranks >= 2 && p2p && c.elem <= exchange_block(nranks, area) => DeviceFlow::Exchange,
        Some(area)
            if nranks >= 2
                && oneshot_supported(c.coll)
                && scalar_ok(c)
                && oneshot_blocks(c.coll, nranks) * c.elem <= area =>
        {
            DeviceFlow::OneShot
        }
        _ => DeviceFlow::Staged,
    }
}

/// Chooses how the device calls of `r` run:
/// 1. a single all-reduce without a PreMulSum factor, not deterministic → [`DeviceRoute::AllReduce`]
///    (in either mode);
/// 2. deterministic and some call reduces → [`DeviceRoute::Staged`];
/// 3. IPC mode on at least two ranks and every call that moves something has an IPC flow
///    ([`device_flow`]) →
///    [`DeviceRoute::Ipc`];
/// 4. otherwise [`DeviceRoute::Staged`]: anything staged in a group stages the whole group
///    (its calls run as one job of host plans).
pub fn device(r: &DeviceRequest<'_>) -> DeviceRoute {
    let fixed_order = r.deterministic && r.calls.iter().any(|c| c.coll.reduces());
    if let [c] = r.calls {
        if !fixed_order && device_flow(c, r.nranks, None) == DeviceFlow::AllReduce {
            return DeviceRoute::AllReduce;
        }
    }
    let flows: Vec<DeviceFlow> = r.calls.iter().map(|c| device_flow(c, r.nranks, r.ipc_area)).collect();
    let ipc = r.ipc_area.is_some() && r.nranks >= 2;
    let all_ipc = flows.iter().zip(r.calls).all(|(&f, c)| c.empty || f != DeviceFlow::Staged);
    if !fixed_order && ipc && all_ipc {
        DeviceRoute::Ipc(flows)
    } else {
        DeviceRoute::Staged
    }
}

/// Whether an IPC all-reduce of `bytes` takes the small one-shot flow ([`IPC_SMALL_BYTES`]).
pub fn ipc_small(bytes: usize) -> bool {
    bytes <= IPC_SMALL_BYTES
}

/// Whether an IPC all-reduce of `bytes` takes the direct flow ([`IPC_DIRECT_MIN`]);
/// `reachable`: the ranks can reach each other's buffers without one thread waiting for
/// itself: every rank in a process of its own (the buffers' IPC handles are exchanged through
/// the host), or every rank in one process (the buffers are published on the device). Ranks of
/// a communicator spread over processes that each hold several of them take the staged flow:
/// one thread may drive several ranks, and a host exchange would wait for itself.
pub fn ipc_direct(bytes: usize, reachable: bool) -> bool {
    reachable && bytes >= IPC_DIRECT_MIN
}

/// Where the ranks of a CUDA IPC communicator live, as every rank learns it from the set-up's
/// cards (the same answer on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcPlacement {
    /// No two ranks share a process: a host exchange of buffer handles cannot make one thread
    /// wait for itself.
    pub separate: bool,
    /// Every rank is in one process: the buffers can be published on the device (the boards).
    pub local: bool,
}

/// Everything the flow of one IPC all-reduce depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcAllReduce {
    /// Bytes of the message.
    pub bytes: usize,
    /// Whether the call is being captured into a CUDA graph.
    pub captured: bool,
    /// Where the ranks live.
    pub placement: IpcPlacement,
    /// Whether this rank may share its buffers with the peers (`OXCCL_CUDA_DIRECT` not `0`):
    /// when not, its part of a direct flow goes through its regions (or every rank stages).
    pub cuda_direct: bool,
    /// Whether the ranks set up the LL flow (`device::small`; decided at set-up from the
    /// cards, the same answer on every rank).
    pub ll: bool,
    /// The barrier sequence number the call's first barrier takes (every rank numbers its
    /// calls alike): the LL flow writes it as its flag, so 0 (the zeroed slots) cannot take it.
    pub seq: u32,
}

/// The flow of one IPC all-reduce (`device::ipc` runs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpcAllReduceFlow {
    /// The LL flow: one kernel launch (`device::small`).
    Ll,
    /// The small one-shot flow with the capture flags.
    SmallCaptured,
    /// The small one-shot flow.
    Small,
    /// The direct flow, the buffers published on the device (every rank in this process).
    Board,
    /// The direct flow between processes in rounds of the area size, without waiting for any
    /// peer on the host (`device::direct`); `publish`: this rank's buffers are published (else
    /// staged through its regions).
    Rounds {
        /// Whether this rank publishes its buffers.
        publish: bool,
    },
    /// The direct flow after a host exchange of the buffers' handles (a captured call between
    /// processes); staged when some rank cannot share its buffers (every rank learns it alike).
    /// `publish`: this rank offers its buffers.
    Shared {
        /// Whether this rank offers its buffers.
        publish: bool,
    },
    /// The staged flow through the regions.
    Staged,
}

/// Chooses the flow of one IPC all-reduce: the LL flow when the ranks set it up, for 1 to
/// [`IPC_LL_BYTES`] bytes, not captured (a replay would repeat its flag) and with a sequence
/// number other than 0 ([`ipc_ll`]); small messages ([`ipc_small`]) the small flow; from
/// [`IPC_DIRECT_MIN`], ranks that can reach each other's buffers ([`ipc_direct`]) the direct
/// flow: on the device when every rank is in this process (and may share its buffers), in
/// rounds between processes, or after a host exchange when captured; otherwise the staged flow.
pub fn ipc_all_reduce(r: &IpcAllReduce) -> IpcAllReduceFlow {
    let IpcPlacement { separate, local } = r.placement;
    let direct = ipc_direct(r.bytes, separate || local);
    if ipc_ll(r) {
        IpcAllReduceFlow::Ll
    } else if ipc_small(r.bytes) {
        if r.captured {
            IpcAllReduceFlow::SmallCaptured
        } else {
            IpcAllReduceFlow::Small
        }
    } else if direct && local && r.cuda_direct {
        IpcAllReduceFlow::Board
    } else if direct && separate && !r.captured {
        IpcAllReduceFlow::Rounds { publish: r.cuda_direct }
    } else if direct && separate {
        IpcAllReduceFlow::Shared { publish: r.cuda_direct }
    } else {
        IpcAllReduceFlow::Staged
    }
}

/// Whether IPC all-reduce `r` takes the LL flow (the same answer on every rank): the ranks
/// set it up, 1..=[`IPC_LL_BYTES`] bytes, not captured, sequence number not 0.
pub fn ipc_ll(r: &IpcAllReduce) -> bool {
    r.ll && !r.captured && (1..=IPC_LL_BYTES).contains(&r.bytes) && r.seq != 0
}

/// Why a communicator cannot use CUDA IPC before anything is tried, or `None`: `cuda_ipc`
/// (`OXCCL_CUDA_IPC` not `0`), every rank on one host, at most [`IPC_MAX_RANKS`] ranks. Past
/// this gate, IPC is taken when every rank compiled the kernels, exported its region and mapped
/// every peer's (an outcome of the set-up, which every rank learns alike); else the proxy.
pub fn ipc_refusal(cuda_ipc: bool, same_host: bool, nranks: usize) -> Option<String> {
    if !cuda_ipc {
        Some("OXCCL_CUDA_IPC=0".to_string())
    } else if !same_host {
        Some("ranks on several hosts".to_string())
    } else if nranks > IPC_MAX_RANKS {
        Some(format!("{nranks} ranks, more than the {IPC_MAX_RANKS} CUDA IPC serves"))
    } else {
        None
    }
}

/// Bytes of each peer's block of a send/receive exchange through an input area of `area`
/// bytes shared by `nranks` ranks: an equal share, in whole [`EXCHANGE_ALIGN`] granules.
pub fn exchange_block(nranks: usize, area: usize) -> usize {
    (area / nranks.max(1)) / EXCHANGE_ALIGN * EXCHANGE_ALIGN
}

/// Whether the one-shot flow implements `coll` (the all-reduce has its own flow).
pub fn oneshot_supported(coll: Collective) -> bool {
    matches!(
        coll,
        Collective::Broadcast { .. }
            | Collective::Reduce { .. }
            | Collective::AllGather
            | Collective::ReduceScatter
            | Collective::AllToAll
            | Collective::Gather { .. }
            | Collective::Scatter { .. }
    )
}

/// PreMulSum on the one-shot flow: a host factor on reduce and reduce-scatter (applied to the
/// staged bytes before the reduction, as the staged path applies it); a factor in device memory
/// (read in stream order) stays staged.
fn scalar_ok(c: &DeviceCall) -> bool {
    match c.scalar {
        ScalarKind::None => true,
        ScalarKind::Host => matches!(c.coll, Collective::Reduce { .. } | Collective::ReduceScatter),
        ScalarKind::Device => false,
    }
}

/// Blocks the one-shot flow stages per chunk: one per destination for the personalised
/// collectives.
pub fn oneshot_blocks(coll: Collective, nranks: usize) -> usize {
    match coll {
        Collective::AllToAll | Collective::Scatter { .. } | Collective::ReduceScatter => nranks,
        _ => 1,
    }
}
