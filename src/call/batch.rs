//! A group's calls, collected and run together: host calls as merged plans
//! ([`crate::group::run`]), device calls as one stream job per communicator.

use super::{check, Call, Checked};
use crate::coll::Op;
use crate::comm::Communicator;
use crate::device::DevOp;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// A communicator a batch's host call runs on: borrowed for the batch (the Rust API's scoped
/// groups) or shared (calls through handles, which may be destroyed meanwhile).
enum Held<'a> {
    Borrowed(&'a Communicator),
    Shared(Arc<Communicator>),
}

impl std::ops::Deref for Held<'_> {
    type Target = Communicator;
    fn deref(&self) -> &Communicator {
        match self {
            Held::Borrowed(c) => c,
            Held::Shared(c) => c,
        }
    }
}

/// A device call queued in a batch: its communicator, GPU, call and stream.
type DevCall = (Arc<Communicator>, i32, DevOp, *mut c_void);

/// Calls collected for a group: each is checked when added (an error is returned then and the
/// call left out); [`Batch::run`] runs them all. `'a` is how long their buffers are borrowed.
#[derive(Default)]
pub struct Batch<'a> {
    host: Vec<(Held<'a>, Op<'a>)>,
    dev: Vec<DevCall>,
}

impl<'a> Batch<'a> {
    /// Checks `call` (once: see [`super`]) and adds it.
    ///
    /// # Safety
    /// As [`super::run`], for `'a` (device buffers: until the stream has run the group).
    pub unsafe fn add(&mut self, comm: &Arc<Communicator>, call: &Call) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        match unsafe { check(comm, call)? } {
            Checked::Host(op) => self.host.push((Held::Shared(comm.clone()), op)),
            Checked::Device { ordinal, op, stream } => self.dev.push((comm.clone(), ordinal, op, stream)),
        }
        Ok(())
    }

    /// Adds a checked host operation of `comm` (the typed API's calls).
    pub fn push(&mut self, comm: &'a Communicator, op: Op<'a>) {
        self.host.push((Held::Borrowed(comm), op));
    }

    /// True when nothing was added.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty() && self.dev.is_empty()
    }

    /// Runs everything added: the host calls first, as one group, then the device calls are
    /// enqueued (every rank does the same). Returns the first error.
    pub fn run(self) -> Result<()> {
        let mut r = Ok(());
        if !self.host.is_empty() {
            let (comms, ops): (Vec<Held<'a>>, Vec<Op<'a>>) = self.host.into_iter().unzip();
            r = crate::group::run(comms.iter().map(|c| &**c).zip(ops).collect());
        }
        if !self.dev.is_empty() {
            r = r.and(run_device(self.dev));
        }
        r
    }
}

/// Enqueues a group's device calls: per communicator, one job that runs the calls' plans merged
/// (as a host group), on the internal stream joined with every stream of those calls, in issue
/// order, after setting up the device state of every communicator that has none yet, together.
/// Returns the first error (the other communicators' parts are still enqueued: their peers
/// expect them).
fn run_device(calls: Vec<DevCall>) -> Result<()> {
    let mut parts: Vec<crate::device::GroupPart> = Vec::new();
    for (c, ordinal, op, s) in calls {
        match parts.iter_mut().find(|(k, _, _)| Arc::ptr_eq(k, &c)) {
            Some((_, o, v)) if *o == ordinal => v.push((op, s)),
            Some(_) => {
                return Err(Error::invalid_argument(format!(
                    "rank {}: a group's device calls on one communicator must use one GPU",
                    c.rank()
                )))
            }
            None => parts.push((c, ordinal, vec![(op, s)])),
        }
    }
    // Device state first, for every communicator of the group at once (its creation is
    // collective: one thread driving several ranks would otherwise wait on itself).
    let keys: Vec<(Arc<Communicator>, i32)> = parts.iter().map(|(c, o, _)| (c.clone(), *o)).collect();
    let ready = crate::device::set_up_together(&keys);
    // SAFETY: every call was added by `Batch::add`, whose contract keeps the buffers valid
    // until the stream has run the group.
    unsafe { crate::device::enqueue_group(&parts, ready) }
}
