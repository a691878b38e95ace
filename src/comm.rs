//! The communicator: rank, size, links to peers, and the collective entry points.
//!
//! Links are built lazily: a collective first makes sure it has a link to every peer its plan
//! talks to (the lower rank connects, the higher accepts), so a ring needs 2 links per rank
//! and other algorithms add theirs when first used. After any failure the communicator shuts
//! its links (so its neighbours fail at once instead of waiting for a timeout) and refuses
//! further collectives until it is destroyed.

mod init;
mod lane;
mod links;
mod session;

pub(crate) use init::Under;
pub(crate) use session::{Executor, Session, SessionKind};

use crate::algo::tuning::{Overrides, TransportKind};
use crate::algo::{Collective, Plan};
use crate::bootstrap::{self, Bootstrap, UniqueId};
use crate::config::Config;
use crate::engine::{self, Ctx, Operands};
use crate::error::{Error, ErrorKind, Result};
use crate::mismatch;
use crate::transport::{mem, Link};
use crate::types::{DataType, ReduceOp};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A communicator: one rank's membership in a group of `size` ranks.
pub struct Communicator {
    rank: usize,
    size: usize,
    hosts: Vec<String>,
    /// Ring order: ranks grouped by host (see [`crate::algo::hier::ring_order`]).
    order: Vec<usize>,
    inner: Mutex<Inner>,
    aborted: Arc<AtomicBool>,
    failure: Arc<Mutex<Option<Error>>>,
    last_error: Mutex<String>,
    sockets: Arc<Mutex<Vec<TcpStream>>>,
    /// This communicator's control channels in the liveness thread ([`crate::control`]).
    control: Option<crate::control::Membership>,
    /// The no-progress bound in milliseconds (see [`Communicator::set_timeout`]).
    timeout_ms: AtomicU64,
    transport: TransportKind,
    tuning: Mutex<Overrides>,
    pub(crate) plans: crate::algo::cache::PlanCache,
    /// Shrinks started on this communicator so far (numbers each shrink's rendezvous).
    pub(crate) shrinks: std::sync::atomic::AtomicU64,
    /// The id made by `ncclCommGetUniqueId` for a later grow, if any.
    pub(crate) grow_id: Mutex<Option<UniqueId>>,
    /// What a call needs from the environment and the host table, read once at creation.
    pub(crate) fixed: Fixed,
    /// The last call shape planned and its plan (see [`crate::coll`]); emptied by
    /// [`Communicator::set_tuning`].
    pub(crate) last_plan: Mutex<Option<(PlanKey, Arc<Plan>)>>,
    /// Refuses calls after destroy and concurrent calls ([`crate::guard`]).
    guard: crate::guard::Guard,
    /// The settings read when this communicator was made (or given to it).
    pub(crate) config: Arc<Config>,
    /// The last operations, for hang diagnosis ([`crate::flight`]).
    flight: crate::flight::Recorder,
    /// The arena probe's back-off ([`crate::algo::select::Backoff`], kept by `comm::lane`).
    probe: lane::ProbeState,
    /// Set by the device layer once the communicator has device state: waits until device
    /// calls handed to its helper threads have run, so that a host call issued next cannot
    /// interleave with them on the links (see [`Communicator::check_usable`]).
    pub(crate) host_fence: std::sync::OnceLock<fn(&Communicator) -> Result<()>>,
}

/// What distinguishes one call's plan from another's on the same communicator and settings.
pub(crate) type PlanKey = (Collective, usize, DataType, ReduceOp, bool);

/// Per-communicator constants of the call path, so that a call reads no environment variable,
/// asks the OS nothing and scans no host table.
pub(crate) struct Fixed {
    /// How the engine waits when nothing moves ([`engine::spin_time`] for this host's ranks).
    pub(crate) spin: crate::wait::Spin,
    /// Each rank's host index when the hierarchical all-reduce applies (ranks on several hosts,
    /// some sharing one); `None` otherwise.
    pub(crate) hier_groups: Option<Vec<usize>>,
    /// Each rank's host index ([`crate::algo::hier::host_groups`]).
    pub(crate) groups: Vec<usize>,
    /// Number of hosts.
    pub(crate) hosts: usize,
    /// The wire encoding between hosts ([`Communicator::compression`]; a copy the call path
    /// reads without a lock).
    pub(crate) compress: std::sync::atomic::AtomicU8,
    /// Whether [`Communicator::set_tuning`] forces the algorithms (a copy of its setting that
    /// the call path reads without a lock).
    pub(crate) forced: AtomicBool,
    /// Whether reductions run fixed-order schedules ([`Communicator::deterministic`]; a copy
    /// the call path reads without a lock).
    pub(crate) det: AtomicBool,
    /// The (empty) plan of calls that take the small all-reduce path.
    pub(crate) no_plan: Arc<Plan>,
    /// Whether this host has more ranks than CPUs ([`crate::algo::select::Request::crowded`]).
    pub(crate) crowded: bool,
}

impl Fixed {
    /// `groups`: each rank's host index ([`crate::algo::hier::host_groups`] of `hosts`).
    fn new(rank: usize, hosts: &[String], groups: Vec<usize>, config: &Config) -> Fixed {
        let here = crate::wait::ranks_here(hosts, rank);
        Fixed {
            spin: engine::spin_time(here, config.spin_us),
            hier_groups: crate::algo::hier::applies(&groups).then(|| groups.clone()),
            hosts: groups.iter().max().map_or(1, |&m| m + 1),
            groups,
            compress: std::sync::atomic::AtomicU8::new(config.compress as u8),
            forced: AtomicBool::new(false),
            det: AtomicBool::new(config.deterministic),
            no_plan: Arc::new(Plan::default()),
            crowded: crate::wait::crowded(here),
        }
    }
}

struct Inner {
    links: Vec<Option<Box<dyn Link>>>,
    staging: Vec<Vec<u64>>,
    scratch: Vec<Vec<u64>>,
    boot: Option<Bootstrap>,
    /// Connections that arrived before they were waited for, by purpose and rank.
    pending: bootstrap::accept::Extra,
    /// Incoming handshakes not finished when the last wait for connections ended.
    handshakes: bootstrap::accept::InProgress,
    notifier: Option<Arc<mem::Notifier>>,
    /// Operations run so far with each peer (numbers the signatures of [`crate::mismatch`]).
    seq: Vec<u64>,
    /// The signature exchange, reused by every operation.
    sigs: Option<mismatch::Exchange>,
    /// The peers of the plan being run (memory reused from call to call).
    peers: Vec<usize>,
    /// The small all-reduce path's buffers ([`engine::lane`]), made on first use.
    lane: Option<engine::lane::Bufs>,
    /// The host arena of the arena all-reduce ([`engine::arena`]), made on first use.
    arena: Option<engine::arena::State>,
}

impl Inner {
    /// The per-call state of a new communicator over `links` (one slot per rank).
    fn new(links: Vec<Option<Box<dyn Link>>>, boot: Option<Bootstrap>, notifier: Option<Arc<mem::Notifier>>) -> Inner {
        let nranks = links.len();
        Inner {
            links,
            staging: Vec::new(),
            scratch: Vec::new(),
            boot,
            pending: Default::default(),
            handshakes: Default::default(),
            notifier,
            seq: vec![0; nranks],
            sigs: None,
            peers: Vec::new(),
            lane: None,
            arena: None,
        }
    }
}

/// A duration in whole milliseconds, at least 1 (a zero bound would fail every wait).
fn duration_ms(t: Duration) -> u64 {
    u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1)
}

use crate::sync::lock;

/// The engine as an [`Executor`]: one plan (a call's, or a group's merged plan) and its calls.
pub(crate) struct PlanRun<'a> {
    /// The operation's name (a collective's, or a group's description).
    pub(crate) what: &'a str,
    /// The operation's description (flight record, mismatch signature).
    pub(crate) desc: mismatch::Desc,
    /// The plan to run.
    pub(crate) plan: &'a Plan,
    /// The buffers, type and operator of each call of the plan.
    pub(crate) calls: &'a [Operands],
}

impl Executor for PlanRun<'_> {
    type Output = ();
    type Session<'c> = Session<'c>;

    fn what(&self) -> &str {
        self.what
    }

    fn desc(&self) -> mismatch::Desc {
        self.desc
    }

    fn peers(&self, _rank: usize, _nranks: usize, out: &mut Vec<usize>) {
        self.plan.peers_into(out);
    }

    unsafe fn run(&mut self, s: &mut Session<'_>) -> Result<()> {
        if let Err(e) = s.connect() {
            return Err(s.fail_early(e));
        }
        let comm = s.comm();
        let (rank, size) = (comm.rank, comm.size);
        // The exchange's memory is kept from one operation to the next.
        let mut sigs = comm.config.check_mismatch.then(|| {
            let mut x = s.inner().sigs.take().unwrap_or_else(|| mismatch::Exchange::new(rank, size));
            x.reset(rank, size);
            x
        });
        let (desc, plan) = (self.desc, self.plan);
        s.count_call(|p, seq| {
            if let Some(x) = sigs.as_mut() {
                let (send_bytes, recv_bytes) = mismatch::link_bytes(plan, p);
                x.add(p, mismatch::Signature { desc, seq, send_bytes, recv_bytes });
            }
        });
        let inner = s.inner();
        let ctx = Ctx {
            rank,
            nranks: size,
            links: &mut inner.links,
            notifier: inner.notifier.as_deref(),
            abort: &comm.aborted,
            timeout: comm.timeout(),
            what: self.what,
            staging: &mut inner.staging,
            scratch: &mut inner.scratch,
            spin: comm.fixed.spin,
            sigs: sigs.as_mut(),
        };
        // SAFETY: forwarded from this function's contract.
        let r = unsafe { engine::run(plan, self.calls, ctx) };
        inner.sigs = sigs;
        r
    }
}

impl Communicator {
    /// The settings this communicator runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Host identity of every rank (as exchanged at bootstrap).
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The ring order: every rank, grouped by host (rings, chains and trees run in this order).
    pub fn ring_order(&self) -> &[usize] {
        &self.order
    }

    /// The last error message recorded on this communicator (empty if none).
    pub fn last_error(&self) -> String {
        lock(&self.last_error).clone()
    }

    /// The failure that stopped this communicator, if any (`ncclCommGetAsyncError`): its own,
    /// or a peer's that its control channel brought between calls (e.g. a collective mismatch
    /// found after this rank's share of the operation had completed, [`crate::control`]).
    pub fn async_error(&self) -> Option<Error> {
        lock(&self.failure).clone()
    }

    /// Aborts: interrupts a collective blocked on another thread, shuts every connection so
    /// peers fail promptly, and makes every later call fail.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.flight.dump("abort");
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some(Error::invalid_usage(format!("rank {}: communicator was aborted", self.rank)));
        }
        drop(f);
        self.guard.set_failed();
    }

    /// What survivors need to meet again without this communicator's connections: every
    /// rank's data-listener address and the communicator's secret (from the bootstrap), plus a
    /// duplicate of this rank's own data listener. `None` for in-memory communicators.
    pub(crate) fn rendezvous_table(
        &self,
    ) -> Result<Option<(Vec<std::net::SocketAddr>, bootstrap::auth::Secret, std::net::TcpListener)>> {
        let inner = lock(&self.inner);
        let Some(b) = inner.boot.as_ref() else { return Ok(None) };
        let listener = b.listener.try_clone().map_err(|e| Error::from_io("duplicate the data listener", e))?;
        Ok(Some((b.peers.iter().map(|p| p.addr).collect(), b.secret, listener)))
    }

    /// The transport the cost model assumes for this communicator's collectives.
    pub fn transport(&self) -> TransportKind {
        self.transport
    }

    /// The per-communicator tuning settings (algorithms, chunk size).
    pub fn tuning(&self) -> Overrides {
        *lock(&self.tuning)
    }

    /// Overrides the algorithm choice and chunk size for later calls on this communicator,
    /// above its [`Config`] (`OXCCL_ALGO` / `OXCCL_CHUNK_SIZE`). Every rank must set the same values, or their
    /// plans will not match.
    pub fn set_tuning(&self, t: Overrides) {
        self.fixed.forced.store(t.algos.is_some(), Ordering::Relaxed);
        self.fixed.det.store(t.deterministic.unwrap_or(self.config.deterministic), Ordering::Relaxed);
        self.fixed.compress.store(t.compress.unwrap_or(self.config.compress) as u8, Ordering::Relaxed);
        *lock(&self.tuning) = t;
        *lock(&self.last_plan) = None;
    }

    /// Whether this communicator's reductions are bitwise reproducible: all-reduce, reduce and
    /// reduce-scatter run the fixed-order schedules of [`crate::algo::det`], each element the
    /// left fold of the ranks' inputs in rank order (`OXCCL_DETERMINISTIC`, or
    /// [`Overrides::deterministic`] through [`Communicator::set_tuning`]).
    pub fn deterministic(&self) -> bool {
        self.fixed.det.load(Ordering::Relaxed)
    }

    /// The wire encoding of this communicator's inter-host stage: `f32` sum and average
    /// all-reduces over several hosts cross between hosts in it, quantised once each way, and
    /// every rank ends with the same bits (`OXCCL_COMPRESS`, or [`Overrides::compress`] through
    /// [`Communicator::set_tuning`], or [`Communicator::set_compression`]; docs/COMPRESSION.md).
    /// Links within a host stay exact; other types, operators and collectives are unchanged.
    pub fn compression(&self) -> crate::reduce::codec::Encoding {
        crate::reduce::codec::Encoding::ALL[usize::from(self.fixed.compress.load(Ordering::Relaxed)) & 3]
    }

    /// Sets [`Communicator::compression`] for later calls (keeps the other overrides). Every
    /// rank must set the same encoding, or their plans will not match.
    pub fn set_compression(&self, enc: crate::reduce::codec::Encoding) {
        let t = Overrides { compress: Some(enc), ..self.tuning() };
        self.set_tuning(t);
    }

    /// Sets the longest time a call may wait without progress before failing with
    /// `ncclTimeout` (default `OXCCL_TIMEOUT_MS`). Applies to operations started afterwards
    /// (`oxcclCommSetTimeout` in the C API).
    pub fn set_timeout(&self, t: Duration) {
        self.timeout_ms.store(duration_ms(t), Ordering::Relaxed);
    }

    /// The current no-progress bound of this communicator's operations.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Records `e` as this communicator's last error and returns it.
    pub(crate) fn record(&self, e: Error) -> Error {
        *lock(&self.last_error) = e.message().to_string();
        e
    }

    /// The flag [`Communicator::abort`] sets, for watchers that outlive the communicator
    /// (the device path's watchdog).
    pub(crate) fn abort_flag(&self) -> Arc<AtomicBool> {
        self.aborted.clone()
    }

    /// Has this communicator's control channels tell `child` (made from it; `members`: this
    /// communicator's ranks in child rank order) of a member's death ([`crate::control`]).
    pub(crate) fn adopt(&self, child: &Communicator, members: Vec<usize>) {
        if let (Some(p), Some(c)) = (&self.control, &child.control) {
            p.adopt(c, members);
        }
    }

    /// A child being made from this communicator by `members` (its ranks in child rank order),
    /// this rank being child rank `rank`: its waits end when this communicator's channels find
    /// a member dead, before or while it meets ([`crate::control::Meeting`]). `None` without
    /// control channels (a communicator of one rank).
    pub(crate) fn meet(&self, rank: usize, members: Vec<usize>) -> Option<crate::control::Meeting> {
        self.control.as_ref().map(|c| c.meet(rank, members))
    }

    /// The error that stopped this communicator (a failure, or `abort`), if any; unlike
    /// [`Communicator::async_error`], this never looks at the links.
    pub(crate) fn failure(&self) -> Option<Error> {
        lock(&self.failure).clone()
    }

    /// A call failed with `e`: settles it with the peers through the control channel (a
    /// peer's abort that explains it replaces it; otherwise the peers are told,
    /// [`crate::control::Membership::settle`]), then shuts the links and fails the communicator.
    fn fail_call(&self, inner: &mut Inner, e: Error) -> Error {
        let e = match &self.control {
            Some(c) => c.settle(e),
            None => e,
        };
        if let Some(n) = &inner.notifier {
            n.notify();
        }
        for l in inner.links.iter().flatten() {
            l.shutdown();
        }
        self.fail_as(e)
    }

    /// Marks the communicator failed and shuts its links so that peers notice at once. A
    /// peer's death or abort found by the control channel is the error reported, whatever
    /// the interrupted call saw.
    pub(crate) fn fail(&self, e: Error) -> Error {
        let e = self.control.as_ref().and_then(|c| c.down()).unwrap_or(e);
        self.fail_as(e)
    }

    /// [`Communicator::fail`] reporting `e` itself (already settled with the control channel).
    fn fail_as(&self, e: Error) -> Error {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some(e.clone());
        }
        drop(f);
        self.guard.set_failed();
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.record(e)
    }

    /// Marks the communicator destroyed (`ncclCommDestroy` / `ncclCommAbort` of its handle):
    /// calls still queued on it in a group fail with `ncclInvalidUsage` instead of running.
    pub(crate) fn close(&self) {
        self.guard.close();
    }

    /// Refuses a call on a destroyed, failed or aborted communicator. A host call on a thread
    /// other than a device worker first waits for the communicator's device work in flight
    /// (`host_fence`): host and device calls are ordered as issued.
    fn check_usable(&self, what: &str) -> Result<()> {
        if let Some(fence) = self.host_fence.get() {
            if !DEVICE_WORKER.with(|w| w.get()) {
                fence(self)?;
            }
        }
        self.check_open(what)
    }

    /// Refuses a call on a destroyed, failed or aborted communicator (the checks of
    /// [`Communicator::check_usable`] but the fence: a device call never waits for the device
    /// work in flight).
    #[inline(always)]
    fn check_open(&self, what: &str) -> Result<()> {
        let told = self.control.as_ref().is_some_and(|c| c.told());
        if !self.guard.troubled() && !self.aborted.load(Ordering::Relaxed) && !told {
            return Ok(());
        }
        if self.guard.is_closed() {
            return Err(self.record(Error::invalid_usage(format!(
                "rank {}: {what} on a destroyed communicator (ncclCommDestroy/ncclCommAbort ran before the group holding this call ended)",
                self.rank
            ))));
        }
        if let Some(e) = lock(&self.failure).clone() {
            if told {
                // A peer's abort frame recorded the failure: this rank's links go down now, so
                // that ranks waiting on it learn of it.
                self.guard.set_failed();
                for s in lock(&self.sockets).iter() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
            return Err(self.record(Error::new(
                e.kind(),
                format!("rank {}: communicator failed earlier and must be destroyed: {}", self.rank, e.message()),
            )));
        }
        if self.aborted.load(Ordering::SeqCst) {
            return Err(
                self.record(Error::invalid_usage(format!("rank {}: communicator was aborted; destroy it", self.rank)))
            );
        }
        Ok(())
    }

    /// Fails the communicator because a second thread called it while a call was running
    /// ([`crate::guard`]): the running call is interrupted, peers learn the reason.
    fn refuse_concurrent(&self, what: &str) -> Error {
        let e = Error::invalid_usage(format!(
            "rank {}: {what} was called while another thread's call on this communicator was running; a communicator serves one call at a time (use one communicator per thread); the communicator is failed",
            self.rank
        ));
        let e = self.fail(e);
        // The running call sees this within its poll interval (in-memory links included).
        self.aborted.store(true, Ordering::SeqCst);
        e
    }

    /// Runs one plan on this communicator's links (the engine, [`PlanRun`]).
    ///
    /// # Safety
    /// As [`engine::run`]: the buffers must be valid for the plan's regions.
    pub(crate) unsafe fn execute(
        &self,
        what: &str,
        desc: &mismatch::Desc,
        plan: &Plan,
        calls: &[Operands],
    ) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.dispatch(&mut PlanRun { what, desc: *desc, plan, calls }) }
    }
}

thread_local! {
    /// True on a thread that runs device calls' host plans (the CUDA proxy).
    static DEVICE_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as a device worker: its calls are the device work a host call
/// waits for, so they do not wait themselves.
pub(crate) fn mark_device_worker() {
    DEVICE_WORKER.with(|w| w.set(true));
}

/// Runs `f` as a device worker (see [`mark_device_worker`]): a device call's own host exchange,
/// made while it holds its communicator's device state, must not wait for that state.
pub(crate) fn as_device_worker<R>(f: impl FnOnce() -> R) -> R {
    let was = DEVICE_WORKER.with(|w| w.replace(true));
    let r = f();
    DEVICE_WORKER.with(|w| w.set(was));
    r
}

/// `count * dtype.size()`, or `ncclInvalidArgument` on overflow.
pub fn byte_len(count: usize, dtype: DataType) -> Result<usize> {
    count.checked_mul(dtype.size()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        Error::invalid_argument(format!("count {count} of {} overflows the address space", dtype.name()))
    })
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {})", self.rank, self.size)
    }
}

impl ErrorKind {
    /// The `ncclResult_t` value.
    pub fn code(self) -> i32 {
        self as i32
    }
}
