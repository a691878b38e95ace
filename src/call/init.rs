//! Nonblocking communicator creation (NCCL's `config.blocking = 0`): a [`Pending`] builds the
//! communicator on a worker thread; its owner polls [`Pending::progress`] (as
//! `ncclCommGetAsyncError` reports `ncclInProgress`), then takes the result ([`Pending::take`])
//! or waits for it ([`Pending::wait`]). Dropping or cancelling a pending creation aborts what
//! the worker builds.

use crate::bootstrap::UniqueId;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

enum Slot {
    Building,
    Built(Box<Communicator>),
    Taken,
    Failed(Error),
    Cancelled,
}

/// Where a nonblocking creation stands.
#[derive(Clone, Debug)]
pub enum Progress {
    /// Still being built (`ncclInProgress`).
    InProgress,
    /// Built: [`Pending::take`] gives the communicator (once).
    Ready,
    /// Failed (or cancelled) with this error.
    Failed(Error),
}

/// A communicator being built on a worker thread.
pub struct Pending {
    slot: Arc<Mutex<Slot>>,
}

use crate::sync::lock;

impl Pending {
    /// Starts building a communicator with `make` on a worker thread (a panic in `make` is
    /// reported as an internal error).
    pub fn start(make: impl FnOnce() -> Result<Communicator> + Send + 'static) -> Result<Pending> {
        let slot = Arc::new(Mutex::new(Slot::Building));
        let worker = slot.clone();
        std::thread::Builder::new()
            .name("oxccl-init".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(make))
                    .unwrap_or_else(|_| Err(Error::internal("communicator initialisation panicked")));
                let mut s = lock(&worker);
                match (r, &*s) {
                    // Cancelled meanwhile: drop (abort) what was built.
                    (Ok(c), Slot::Cancelled) => c.abort(),
                    (Ok(c), _) => *s = Slot::Built(Box::new(c)),
                    (Err(_), Slot::Cancelled) => {}
                    (Err(e), _) => *s = Slot::Failed(e),
                }
            })
            .map_err(|e| Error::system(format!("spawn the init thread: {e}")))?;
        Ok(Pending { slot })
    }

    /// [`Communicator::init_rank`], nonblocking.
    pub fn init_rank(nranks: usize, id: &UniqueId, rank: usize) -> Result<Pending> {
        let id = *id;
        Pending::start(move || Communicator::init_rank(nranks, &id, rank))
    }

    /// Where the creation stands (after [`Pending::take`] took it: `Ready` still).
    pub fn progress(&self) -> Progress {
        match &*lock(&self.slot) {
            Slot::Building => Progress::InProgress,
            Slot::Built(_) | Slot::Taken => Progress::Ready,
            Slot::Failed(e) => Progress::Failed(e.clone()),
            Slot::Cancelled => Progress::Failed(Error::invalid_usage("the communicator's creation was cancelled")),
        }
    }

    /// The communicator once built (once: later calls give `None`, as while it is being
    /// built), or the error it failed with (every time).
    pub fn take(&self) -> Option<Result<Communicator>> {
        let mut s = lock(&self.slot);
        match std::mem::replace(&mut *s, Slot::Taken) {
            Slot::Built(c) => Some(Ok(*c)),
            other => {
                let r = match &other {
                    Slot::Failed(e) => Some(Err(e.clone())),
                    _ => None,
                };
                *s = other;
                r
            }
        }
    }

    /// Waits for the communicator, for at most `timeout`.
    pub fn wait(self, timeout: Duration) -> Result<Communicator> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.take() {
                return r;
            }
            if matches!(self.progress(), Progress::Ready) {
                return Err(Error::invalid_usage("the communicator was taken already"));
            }
            if Instant::now() > deadline {
                return Err(Error::timeout("the communicator was not created before the deadline"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Cancels the creation: a communicator built (now or later) and not taken is aborted.
    pub fn cancel(&self) {
        let mut s = lock(&self.slot);
        if let Slot::Built(c) = std::mem::replace(&mut *s, Slot::Cancelled) {
            drop(s);
            c.abort();
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if matches!(&*lock(&self.slot), Slot::Building | Slot::Built(_)) {
            self.cancel();
        }
    }
}
