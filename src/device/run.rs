//! The device executor: one call on device buffers, or one communicator's part of a group, as
//! an [`Executor`] run by [`Communicator::dispatch`] in a [`DeviceSession`] (usability, the
//! device guard, the flight record's device ring, failing the communicator on an enqueue
//! error). It sets up the communicator's device state (collective, on its first device call),
//! asks [`select::device`] once for the route with the mode known, and runs that route:
//!
//! - [`DeviceRoute::AllReduce`]: in CUDA IPC mode the IPC kernels straight on the user's stream,
//!   ordered after the communicator's previous call ([`Tail`]); in proxy mode the proxy's
//!   in-place all-reduce on the internal stream;
//! - [`DeviceRoute::Ipc`]: every call through its IPC flow on the internal stream, in issue
//!   order, then the sends and receives as one exchange;
//! - [`DeviceRoute::Staged`]: every call as host plans on pinned staging (`exec`), one job of
//!   the proxy (in IPC mode a proxy of its own, made on first use).
//!
//! Work on the internal stream first joins every user stream of the calls and is joined by
//! each of them afterwards (`state`'s module docs).

use super::exec::{DevOp, Scalar};
use super::ipc::Ipc;
use super::proxy::Proxy;
use super::session::DeviceSession;
use super::state::{self, DeviceComm, DeviceMode, Tail};
use super::{ops, DevCall, Gpu};
use crate::algo::select::{self, DeviceCall, DeviceFlow, DeviceRequest, DeviceRoute, IpcAllReduce, IpcAllReduceFlow};
use crate::algo::Collective;
use crate::comm::{Communicator, Executor};
use crate::error::{Error, Result};
use crate::mismatch::Desc;
use cudarc::driver::sys;
use std::borrow::Cow;
use std::ffi::c_void;
use std::sync::Arc;

/// One communicator's device calls (a call, or its part of a group) and what their route
/// depends on.
pub(super) struct DeviceRun<'a> {
    comm: &'a Arc<Communicator>,
    gpu: &'a Gpu,
    /// Every call with its user stream, in issue order (calls of count 0 included: under
    /// `deterministic` they count for the route).
    calls: &'a [(DevOp, *mut c_void)],
    /// The calls as the selector sees them.
    shapes: Vec<DeviceCall>,
    /// The distinct user streams of the calls (checked).
    streams: Vec<sys::CUstream>,
    /// The name in errors and the flight record: the collective's, or `group(...)`.
    what: Cow<'static, str>,
    /// Whether the calls' streams are capturing a CUDA graph (calls `entry.rs` let through;
    /// [`DeviceRun::captured`] runs them).
    captured: bool,
}

impl<'a> DeviceRun<'a> {
    /// The run of `calls` on `comm`, whose buffers are on `gpu` (its context current) and
    /// whose user streams `streams` were checked.
    pub(super) fn new(
        comm: &'a Arc<Communicator>,
        gpu: &'a Gpu,
        calls: &'a [(DevOp, *mut c_void)],
        streams: Vec<sys::CUstream>,
        captured: bool,
    ) -> DeviceRun<'a> {
        let what = Collective::group_name(calls.iter().map(|(o, _)| o.coll));
        let shapes = calls.iter().map(|(o, _)| o.shape()).collect();
        DeviceRun { comm, gpu, calls, shapes, streams, what, captured }
    }

    /// The route of the calls ([`select::device`]); `ipc_area` as in [`DeviceRequest`].
    fn route(&self, ipc_area: Option<usize>) -> DeviceRoute {
        let comm = self.comm;
        select::device(&DeviceRequest {
            calls: &self.shapes,
            nranks: comm.size(),
            deterministic: comm.deterministic(),
            ipc_area,
        })
    }

    /// Logs, once per communicator, the path each kind of call takes.
    fn log(&self, st: &mut DeviceComm, route: &DeviceRoute) {
        let rank = self.comm.rank();
        if let DeviceRoute::AllReduce = route {
            let how = match st.mode {
                DeviceMode::Proxy(_) => "proxy",
                DeviceMode::Ipc(_) => "ipc",
            };
            if st.logged.insert(("all_reduce", how)) {
                let small = if how == "ipc" {
                    format!(
                        "; up to {} bytes one-shot (copy-in, one barrier of stream memory operations, reduce), \
                         straight on the caller's stream",
                        super::layout::SMALL
                    )
                } else {
                    String::new()
                };
                crate::info!("rank {rank}: device all_reduce path: {how}{small}");
            }
            return;
        }
        let on_ipc = matches!(route, DeviceRoute::Ipc(_));
        let how = if on_ipc { "ipc" } else { "staged" };
        for (o, _) in self.calls.iter().filter(|(o, _)| o.count > 0) {
            let name = log_name(o);
            if st.logged.insert((name, how)) {
                let what = if on_ipc { "through the peers' mapped memory" } else { "host plan on pinned staging" };
                crate::info!("rank {rank}: device {name} path: {how} ({what})");
            }
        }
        if self.calls.len() > 1 {
            let p2p = self
                .calls
                .iter()
                .filter(|(o, _)| o.count > 0)
                .all(|(o, _)| matches!(o.coll, Collective::Send { .. } | Collective::Recv { .. }));
            let name = if p2p { "p2p group" } else { "group" };
            if st.logged.insert((name, how)) {
                crate::info!(
                    "rank {rank}: device {name} path: {how} ({} calls, {} streams)",
                    self.calls.len(),
                    self.streams.len()
                );
            }
        }
    }

    /// The calls that move something, as the flows and the staged executor take them.
    fn moving(&self) -> Vec<DevOp> {
        self.calls.iter().map(|(o, _)| *o).filter(|o| o.count > 0).collect()
    }

    /// Runs [`DeviceRoute::AllReduce`] for the single call.
    ///
    /// # Safety
    /// As [`Executor::run`].
    unsafe fn all_reduce(&self, st: &mut DeviceComm) -> Result<()> {
        let (o, stream) = (self.calls[0].0, self.calls[0].1 as sys::CUstream);
        let call = |stream| DevCall { send: o.send, recv: o.recv, count: o.count, dtype: o.dtype, op: o.op, stream };
        quiet_staged(st, &[o])?;
        if let DeviceMode::Ipc(i) = &mut st.mode {
            // Straight on the user's stream: ordered after this communicator's previous call
            // (nothing to do when that ran on this very stream), and the user's later work on
            // the stream follows it by stream order.
            let id = state::stream_id(stream);
            match st.tail {
                Tail::Idle => {}
                Tail::User(Some(prev)) if Some(prev) == id => {}
                Tail::User(_) => i.order_after_calls(stream)?,
                Tail::Internal => st.chain.after_internal(stream)?,
            }
            let flow = ipc_flow(self.comm, i, &o, false);
            // SAFETY: forwarded from this function's contract.
            let res = unsafe { i.all_reduce(self.gpu, call(stream), flow) };
            st.tail = Tail::User(id);
            return res;
        }
        on_internal(st, &[stream], |st, internal| match &st.mode {
            // SAFETY: forwarded from this function's contract.
            DeviceMode::Proxy(p) => unsafe { p.all_reduce(self.comm, call(internal)) },
            DeviceMode::Ipc(_) => Err(Error::internal("an IPC all-reduce on the proxy's branch")),
        })
    }

    /// Runs calls captured into a CUDA graph, in issue order, on the first call's stream:
    /// all-reduces through [`Ipc::all_reduce_captured`], the other collectives through their
    /// one-shot flow ([`Ipc::collective_captured`]); a call with another flow (staged, or
    /// PreMulSum with a factor in device memory) refuses the whole before anything is
    /// enqueued. That stream first waits for every other stream of the calls, and each of them
    /// then waits for it (the order an uncaptured group gets from the internal stream, as edges
    /// of the graph). No ordering after the communicator's earlier calls: a graph runs when it
    /// is launched, and ordering it is the launcher's business (as with NCCL). On one rank,
    /// each call (an all-reduce: `entry.rs`) is a copy on its own stream.
    ///
    /// # Safety
    /// As [`Executor::run`].
    unsafe fn captured(&self, s: &mut DeviceSession<'_>) -> Result<()> {
        let comm = self.comm;
        let calls: Vec<(DevOp, sys::CUstream)> =
            self.calls.iter().filter(|(o, _)| o.count > 0).map(|&(o, st)| (o, st as sys::CUstream)).collect();
        if comm.size() == 1 {
            for (o, stream) in calls {
                // SAFETY: both buffers hold `count` elements (the contract).
                unsafe { ops::copy(o.recv, o.send, o.count * o.dtype.size(), stream)? };
            }
            return Ok(());
        }
        let state = self.state(s)?;
        let mut guard = state::lock(&state);
        let st = &mut *guard;
        let area = match &st.mode {
            DeviceMode::Ipc(i) => i.half(),
            DeviceMode::Proxy(_) => {
                return Err(s.refuse(Error::invalid_usage(format!(
                    "rank {}: {}; this communicator takes the proxy path (pinned host staging: CUDA IPC is not \
                     available to it)",
                    comm.rank(),
                    super::capture::CAPTURABLE
                ))))
            }
        };
        let ops: Vec<DevOp> = calls.iter().map(|c| c.0).collect();
        let flows: Vec<DeviceFlow> =
            ops.iter().map(|o| select::device_flow(&o.shape(), comm.size(), Some(area))).collect();
        if let Some(k) = flows.iter().position(|f| !matches!(f, DeviceFlow::AllReduce | DeviceFlow::OneShot)) {
            let o = &ops[k];
            return Err(s.refuse(Error::invalid_usage(format!(
                "rank {}: {}; this {} of {} elements takes the staged path",
                comm.rank(),
                super::capture::CAPTURABLE,
                o.coll.name(),
                o.count
            ))));
        }
        let route = if ops.len() == 1 && flows[0] == DeviceFlow::AllReduce {
            DeviceRoute::AllReduce
        } else {
            DeviceRoute::Ipc(flows.clone())
        };
        self.log(st, &route);
        quiet_staged(st, &ops)?;
        let spine = calls[0].1;
        let others: Vec<sys::CUstream> = self.streams.iter().copied().filter(|&u| u != spine).collect();
        let DeviceComm { mode, chain, .. } = st;
        let DeviceMode::Ipc(i) = mode else { return Err(Error::internal("a captured call on the proxy")) };
        for &u in &others {
            chain.capture_edge(u, spine)?;
        }
        for (o, f) in ops.iter().zip(flows) {
            // SAFETY (both arms): forwarded from this function's contract.
            if f == DeviceFlow::OneShot {
                unsafe { i.collective_captured(self.gpu, o, spine)? };
                continue;
            }
            let call = DevCall { send: o.send, recv: o.recv, count: o.count, dtype: o.dtype, op: o.op, stream: spine };
            let flow = ipc_flow(comm, i, o, true);
            unsafe { i.all_reduce_captured(self.gpu, call, flow)? };
        }
        others.iter().try_for_each(|&u| chain.capture_edge(spine, u))
    }

    /// The communicator's device state, set up collectively on its first device call; a
    /// set-up failure, or this call's buffers on another GPU than the communicator's, is
    /// refused before anything is enqueued.
    fn state(&self, s: &mut DeviceSession<'_>) -> Result<Arc<std::sync::Mutex<DeviceComm>>> {
        let comm = self.comm;
        let state = state::state_for(comm, self.gpu).map_err(|e| s.refuse(e))?;
        let ordinal = state::lock(&state).ordinal;
        if ordinal != self.gpu.ordinal {
            return Err(s.refuse(Error::invalid_argument(format!(
                "rank {}: communicator's device buffers are on GPU {ordinal}, this call's on GPU {}",
                comm.rank(),
                self.gpu.ordinal
            ))));
        }
        Ok(state)
    }

    /// Runs [`DeviceRoute::Ipc`] (`flows`: one per call, empty calls included).
    ///
    /// # Safety
    /// As [`Executor::run`].
    unsafe fn ipc(&self, st: &mut DeviceComm, flows: Vec<DeviceFlow>) -> Result<()> {
        let ops = self.moving();
        quiet_staged(st, &ops)?;
        // The flows of the calls that move something, as `ops` holds them.
        let flows: Vec<DeviceFlow> =
            flows.into_iter().zip(self.calls).filter(|(_, (o, _))| o.count > 0).map(|(f, _)| f).collect();
        on_internal(st, &self.streams, |st, internal| match &mut st.mode {
            // SAFETY: forwarded from this function's contract.
            DeviceMode::Ipc(i) => unsafe { run_ipc(i, self.comm, self.gpu, &ops, &flows, internal) },
            DeviceMode::Proxy(_) => Err(Error::internal("CUDA IPC flows on a proxy communicator")),
        })
    }

    /// Runs [`DeviceRoute::Staged`]: the calls as one job of host plans on pinned staging.
    ///
    /// # Safety
    /// As [`Executor::run`].
    unsafe fn staged(&self, st: &mut DeviceComm) -> Result<()> {
        let ops = self.moving();
        let comm = self.comm;
        on_internal(st, &self.streams, |st, internal| {
            let proxy = match &st.mode {
                DeviceMode::Proxy(p) => p,
                DeviceMode::Ipc(_) => match &mut st.staged {
                    Some(p) => &*p,
                    slot @ None => &*slot.insert(Proxy::new(comm.rank(), comm.config().timeout, internal)?),
                },
            };
            // SAFETY: forwarded from this function's contract.
            unsafe { proxy.staged(comm, ops, internal) }
        })
    }
}

impl Executor for DeviceRun<'_> {
    type Output = ();
    type Session<'c> = DeviceSession<'c>;

    fn what(&self) -> &str {
        &self.what
    }

    fn desc(&self) -> Desc {
        match self.calls {
            [(o, _)] => Desc::single(o.coll, o.count, o.dtype, o.op),
            _ => Desc::group(self.calls.len()),
        }
    }

    /// A send's or receive's peer; every other rank for a collective (the IPC barriers and the
    /// staged plans may involve any of them).
    fn peers(&self, rank: usize, nranks: usize, out: &mut Vec<usize>) {
        peers_of(self.calls.iter().map(|(o, _)| o.coll), rank, nranks, out);
    }

    /// Sets up the device state (first call), checks the GPU, takes the route with the mode
    /// known and runs it (captured calls: [`DeviceRun::captured`]). A set-up failure or a call on another GPU is refused before anything
    /// is enqueued; an error while enqueueing fails the communicator (the session).
    unsafe fn run(&mut self, s: &mut DeviceSession<'_>) -> Result<()> {
        let comm = self.comm;
        if self.captured {
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.captured(s) };
        }
        if comm.size() == 1 && self.route(None) == DeviceRoute::AllReduce {
            let (o, stream) = self.calls[0];
            // SAFETY: both buffers hold `count` elements (the contract).
            return unsafe { ops::copy(o.recv, o.send, o.count * o.dtype.size(), stream as sys::CUstream) };
        }
        let state = self.state(s)?;
        let mut guard = state::lock(&state);
        let st = &mut *guard;
        let ipc_area = match &st.mode {
            DeviceMode::Ipc(i) => Some(i.half()),
            DeviceMode::Proxy(_) => None,
        };
        let route = self.route(ipc_area);
        self.log(st, &route);
        // SAFETY (every arm): forwarded from this function's contract.
        match route {
            DeviceRoute::AllReduce => unsafe { self.all_reduce(st) },
            DeviceRoute::Ipc(flows) => unsafe { self.ipc(st, flows) },
            DeviceRoute::Staged => unsafe { self.staged(st) },
        }
    }
}

/// The peers of device calls `colls` of `rank` among `nranks`, sorted, into `out` (cleared
/// first): each send's and receive's peer; every other rank as soon as one is a collective.
fn peers_of(colls: impl Iterator<Item = Collective>, rank: usize, nranks: usize, out: &mut Vec<usize>) {
    out.clear();
    for c in colls {
        match c {
            Collective::Send { peer } | Collective::Recv { peer } => out.push(peer),
            _ => {
                out.clear();
                out.extend((0..nranks).filter(|&p| p != rank));
                return;
            }
        }
    }
    out.sort_unstable();
    out.dedup();
}

/// Runs `work` on the internal stream: first joined with every user stream in `streams` (and,
/// after an IPC all-reduce straight on a user's stream, ordered after it), then joining each
/// of them. The user's streams are joined even after a failed enqueue: their later work stays
/// ordered after whatever part of the call was enqueued.
fn on_internal(
    st: &mut DeviceComm,
    streams: &[sys::CUstream],
    work: impl FnOnce(&mut DeviceComm, sys::CUstream) -> Result<()>,
) -> Result<()> {
    for &s in streams {
        st.chain.join_from(s)?;
    }
    // After an all-reduce that ran straight on a user's stream (not necessarily one of these).
    if let (Tail::User(_), DeviceMode::Ipc(i)) = (st.tail, &st.mode) {
        i.order_after_calls(st.chain.stream)?;
    }
    st.tail = Tail::Internal;
    let internal = st.chain.stream;
    let res = work(st, internal);
    let mut joined = Ok(());
    for &s in streams {
        joined = joined.and(st.chain.join_to(s));
    }
    res.and(joined)
}

/// The name of a device call in the path log: the collective's, with the kind of PreMulSum
/// factor of a reduce or reduce-scatter.
fn log_name(o: &DevOp) -> &'static str {
    match (o.coll, o.scale) {
        (Collective::Reduce { .. }, Some(Scalar::Host(_))) => "reduce premulsum(host)",
        (Collective::Reduce { .. }, Some(Scalar::Device(_))) => "reduce premulsum(device)",
        (Collective::ReduceScatter, Some(Scalar::Host(_))) => "reduce_scatter premulsum(host)",
        (Collective::ReduceScatter, Some(Scalar::Device(_))) => "reduce_scatter premulsum(device)",
        (c, _) => c.name(),
    }
}

/// Waits until the IPC mode's staged proxy has run every job handed to it when one of `ops` is
/// an all-reduce that may take the direct flow: its host exchange must not meet a staged job's
/// host plans on the communicator's links.
fn quiet_staged(st: &DeviceComm, ops: &[DevOp]) -> Result<()> {
    let direct = ops.iter().any(|o| {
        matches!(o.coll, Collective::AllReduce) && crate::algo::select::ipc_direct(o.count * o.dtype.size(), true)
    });
    match (&st.staged, direct) {
        (Some(p), true) => p.drain(),
        _ => Ok(()),
    }
}

/// The flow of IPC all-reduce `o` ([`select::ipc_all_reduce`]: its size, where the ranks live,
/// whether it is captured, this rank's `OXCCL_CUDA_DIRECT`, whether the ranks set up the LL
/// flow, and the sequence number its first barrier takes).
fn ipc_flow(comm: &Communicator, i: &Ipc, o: &DevOp, captured: bool) -> IpcAllReduceFlow {
    let bytes = o.count * o.dtype.size();
    let (placement, cuda_direct) = (i.placement(), comm.config().cuda_direct);
    let r = IpcAllReduce { bytes, captured, placement, cuda_direct, ll: i.ll_ready(), seq: i.peek_seq() };
    select::ipc_all_reduce(&r)
}

/// Runs a call or a group's calls through their IPC flows on the internal stream `internal`:
/// the collectives in issue order (every rank issues them alike), then the sends and receives
/// as one exchange (pairs of ranks only wait for each other there).
///
/// # Safety
/// As [`Executor::run`]; every path is an IPC one.
unsafe fn run_ipc(
    i: &mut Ipc,
    comm: &Communicator,
    gpu: &Gpu,
    ops: &[DevOp],
    paths: &[DeviceFlow],
    internal: sys::CUstream,
) -> Result<()> {
    let mut p2p = Vec::new();
    for (o, &p) in ops.iter().zip(paths) {
        // SAFETY (every arm): forwarded from this function's contract.
        match p {
            DeviceFlow::AllReduce => {
                let (send, recv, count, dtype, op) = (o.send, o.recv, o.count, o.dtype, o.op);
                let flow = ipc_flow(comm, i, o, false);
                unsafe { i.all_reduce(gpu, DevCall { send, recv, count, dtype, op, stream: internal }, flow)? }
            }
            DeviceFlow::OneShot => unsafe { i.collective(gpu, o)? },
            DeviceFlow::Exchange => p2p.push(*o),
            DeviceFlow::Staged => return Err(Error::internal("a staged call among a group's CUDA IPC calls")),
        }
    }
    if p2p.is_empty() {
        return Ok(());
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { i.exchange(&p2p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_the_p2p_partners_or_every_other_rank() {
        let mut out = vec![9];
        let p2p = [Collective::Send { peer: 3 }, Collective::Recv { peer: 1 }, Collective::Send { peer: 1 }];
        peers_of(p2p.into_iter(), 2, 5, &mut out);
        assert_eq!(out, [1, 3], "sorted, once each, the old contents gone");
        let mixed = [Collective::Send { peer: 3 }, Collective::Broadcast { root: 0 }];
        peers_of(mixed.into_iter(), 2, 5, &mut out);
        assert_eq!(out, [0, 1, 3, 4], "a collective talks to every other rank");
        peers_of([Collective::AllReduce].into_iter(), 0, 1, &mut out);
        assert!(out.is_empty(), "one rank has no peer");
    }

    #[test]
    fn a_group_is_named_by_its_calls() {
        assert_eq!(Collective::group_name([Collective::AllGather].into_iter()), "all_gather");
        let two = [Collective::Send { peer: 1 }, Collective::Recv { peer: 1 }];
        assert_eq!(Collective::group_name(two.into_iter()), "group(send, recv)");
        let ten = [Collective::AllReduce; 10];
        assert_eq!(
            Collective::group_name(ten.into_iter()),
            format!("group({}, ... (10 calls))", ["all_reduce"; 8].join(", "))
        );
    }
}
