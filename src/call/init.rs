//! Communicator creation, blocking or not (NCCL's `ncclConfig_t.blocking`), and the policy of
//! where it runs ([`create`]): at once (blocking, no group open), on a worker thread that the
//! group's outermost end awaits (blocking, inside a group: NCCL defers constructors called in a
//! group), or on a worker thread that the caller polls (nonblocking).
//!
//! A [`CommInit`] is a communicator being built on a worker thread. Its owner asks
//! [`CommInit::state`] (what `ncclCommGetAsyncError` reports: `ncclInProgress`, then
//! `ncclSuccess` or the error), takes the communicator with [`CommInit::poll`] or waits for it
//! with [`CommInit::wait`] (woken by the worker, no polling). Dropping or cancelling a creation
//! aborts what the worker builds.

use crate::bootstrap::UniqueId;
use crate::comm::Communicator;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::sync::lock;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

enum Slot {
    Building,
    Built(Box<Communicator>),
    Taken,
    Failed(Error),
    Cancelled,
}

/// The slot a worker fills and its owner (and a group's end) wait on.
struct Shared {
    slot: Mutex<Slot>,
    settled: Condvar,
}

impl Shared {
    fn state(&self) -> InitState {
        state_of(&lock(&self.slot))
    }

    /// Waits until the worker has finished (or the creation was cancelled), for at most
    /// `timeout`: `Ok` once built, else the failure, the cancellation or a timeout.
    fn settle(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut slot = lock(&self.slot);
        while matches!(*slot, Slot::Building) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::timeout(format!(
                    "the communicator was not created within {} ms",
                    timeout.as_millis()
                )));
            }
            slot = self.settled.wait_timeout(slot, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        match state_of(&slot) {
            InitState::Failed(e) => Err(e),
            _ => Ok(()),
        }
    }
}

fn state_of(slot: &Slot) -> InitState {
    match slot {
        Slot::Building => InitState::InProgress,
        Slot::Built(_) | Slot::Taken => InitState::Ready,
        Slot::Failed(e) => InitState::Failed(e.clone()),
        Slot::Cancelled => InitState::Failed(Error::invalid_usage("the communicator's creation was cancelled")),
    }
}

/// Where a communicator's creation stands (`ncclCommGetAsyncError` on its handle).
#[derive(Clone, Debug)]
pub enum InitState {
    /// Still being built (`ncclInProgress`).
    InProgress,
    /// Built (`ncclSuccess`): [`CommInit::poll`] gives the communicator (once).
    Ready,
    /// Failed (or cancelled) with this error.
    Failed(Error),
}

/// A communicator being built on a worker thread (a nonblocking creation).
pub struct CommInit {
    shared: Arc<Shared>,
}

impl CommInit {
    /// Starts building a communicator with `make` on a worker thread (a panic in `make` is
    /// reported as an internal error).
    pub fn start(make: impl FnOnce() -> Result<Communicator> + Send + 'static) -> Result<CommInit> {
        let shared = Arc::new(Shared { slot: Mutex::new(Slot::Building), settled: Condvar::new() });
        let worker = shared.clone();
        std::thread::Builder::new()
            .name("oxccl-init".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(make))
                    .unwrap_or_else(|_| Err(Error::internal("communicator initialisation panicked")));
                let mut s = lock(&worker.slot);
                match (r, &*s) {
                    // Cancelled meanwhile: drop (abort) what was built.
                    (Ok(c), Slot::Cancelled) => c.abort(),
                    (Ok(c), _) => *s = Slot::Built(Box::new(c)),
                    (Err(_), Slot::Cancelled) => {}
                    (Err(e), _) => *s = Slot::Failed(e),
                }
                worker.settled.notify_all();
            })
            .map_err(|e| Error::system(format!("spawn the init thread: {e}")))?;
        Ok(CommInit { shared })
    }

    /// [`Communicator::init_rank`], nonblocking.
    pub fn init_rank(nranks: usize, id: &UniqueId, rank: usize) -> Result<CommInit> {
        let id = *id;
        CommInit::start(move || Communicator::init_rank(nranks, &id, rank))
    }

    /// Where the creation stands (after [`CommInit::poll`] took the communicator: `Ready` still).
    pub fn state(&self) -> InitState {
        self.shared.state()
    }

    /// The communicator once built (once: later calls give `None`, as while it is being
    /// built), or the error it failed with (every time). Never blocks on the worker.
    pub fn poll(&self) -> Option<Result<Communicator>> {
        let mut s = lock(&self.shared.slot);
        match std::mem::replace(&mut *s, Slot::Taken) {
            Slot::Built(c) => Some(Ok(*c)),
            other => {
                let r = match state_of(&other) {
                    InitState::Failed(e) if !matches!(other, Slot::Cancelled) => Some(Err(e)),
                    _ => None,
                };
                *s = other;
                r
            }
        }
    }

    /// Waits for the communicator, for at most `timeout` (a timeout leaves the creation
    /// running: wait again, or cancel it).
    pub fn wait(&self, timeout: Duration) -> Result<Communicator> {
        self.shared.settle(timeout)?;
        self.poll().unwrap_or_else(|| Err(Error::invalid_usage("the communicator was taken already")))
    }

    /// Cancels the creation: a communicator built (now or later) and not taken is aborted.
    pub fn cancel(&self) {
        let mut s = lock(&self.shared.slot);
        let was = std::mem::replace(&mut *s, Slot::Cancelled);
        self.shared.settled.notify_all();
        match was {
            Slot::Built(c) => {
                drop(s);
                c.abort();
            }
            // Taken or finished: nothing to cancel.
            Slot::Taken | Slot::Failed(_) => *s = was,
            Slot::Building | Slot::Cancelled => {}
        }
    }
}

impl Drop for CommInit {
    fn drop(&mut self) {
        if matches!(&*lock(&self.shared.slot), Slot::Building | Slot::Built(_)) {
            self.cancel();
        }
    }
}

impl std::fmt::Debug for CommInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommInit").field("state", &self.state()).finish()
    }
}

/// What [`create`] gave.
#[derive(Debug)]
pub enum Created {
    /// Built at once (blocking, no group open).
    Ready(Box<Communicator>),
    /// Being built on a worker thread. `in_progress`: a nonblocking creation, whose caller
    /// polls it (`ncclInProgress`); false for a blocking one inside a group, which the
    /// group's outermost end ([`super::end_group`]) waits for before it runs the group's calls.
    Building {
        /// The creation.
        init: CommInit,
        /// Whether the caller was told "in progress" rather than "done".
        in_progress: bool,
    },
}

/// Creates a communicator with `make` as `ncclCommInitRankConfig` and the other constructors
/// do: `blocking` and no group open on this thread: at once; otherwise on a worker thread
/// ([`Created::Building`]), which a group open on this thread awaits at its end when
/// `blocking` (for at most `OXCCL_TIMEOUT_MS` plus a margin: the build itself is bounded by it).
pub fn create(blocking: bool, make: impl FnOnce() -> Result<Communicator> + Send + 'static) -> Result<Created> {
    if blocking && super::group_depth() == 0 {
        return make().map(|c| Created::Ready(Box::new(c)));
    }
    let init = CommInit::start(make)?;
    if blocking {
        let shared = init.shared.clone();
        let bound = crate::config::timeout() + Duration::from_secs(5);
        // In a group (checked above), so the group keeps it.
        let _ = super::defer(Box::new(move || shared.settle(bound)));
    }
    Ok(Created::Building { init, in_progress: !blocking })
}

/// Runs `work` now, or, inside a group open on this thread, on a worker thread whose outcome
/// the group's outermost end waits for (a collective step of a constructor that makes no
/// communicator, such as a split's rank without a color: it still meets its peers).
pub fn now_or_at_group_end(work: impl FnOnce() -> Result<()> + Send + 'static) -> Result<()> {
    if super::group_depth() == 0 {
        return work();
    }
    let h = std::thread::Builder::new()
        .name("oxccl-group-task".into())
        .spawn(move || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                .unwrap_or_else(|_| Err(Error::internal("a deferred group task panicked")))
        })
        .map_err(|e| Error::system(format!("spawn a group task thread: {e}")))?;
    let _ = super::defer(Box::new(move || {
        h.join().unwrap_or_else(|_| Err(Error::internal("a deferred group task panicked")))
    }));
    Ok(())
}

impl Communicator {
    /// [`Communicator::init_rank`] without blocking (`ncclConfig_t.blocking = 0`): returns at
    /// once; the communicator is built on a worker thread as the other ranks join.
    pub fn init_rank_nonblocking(nranks: usize, id: &UniqueId, rank: usize) -> Result<CommInit> {
        CommInit::init_rank(nranks, id, rank)
    }

    /// [`Communicator::init_rank_with_config`] without blocking.
    pub fn init_rank_with_config_nonblocking(
        nranks: usize,
        id: &UniqueId,
        rank: usize,
        config: Config,
    ) -> Result<CommInit> {
        let id = *id;
        CommInit::start(move || Communicator::init_rank_with_config(nranks, &id, rank, config))
    }
}
