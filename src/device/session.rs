//! The device call's session ([`DeviceSession`]): what [`Communicator::dispatch`] opens around
//! a device executor (`run.rs`). It only enqueues work on streams: the device guard (a second
//! device call from another thread at once is refused, and fails the communicator, as a second
//! host call is), no host lock and no fence, because the call's host work, if any, runs later
//! on the device layer's proxy thread, which opens host sessions of its own; the flight
//! record's device ring (done once enqueued); an enqueue error fails the communicator, settled
//! with the peers through the control channel. It reaches the communicator through the narrow
//! calls `comm/session.rs` gives it.

use crate::comm::{Communicator, SessionKind};
use crate::error::{Error, Result};
use crate::guard::Busy;
use crate::mismatch;

/// One device call's hold on its communicator (a call, or one communicator's part of a
/// group): the device guard for the time the call is set up and enqueued, its peers, and its
/// entry in the flight record's device ring.
pub(crate) struct DeviceSession<'c> {
    comm: &'c Communicator,
    /// The device guard's proof that this is the communicator's only device call.
    _busy: Busy<'c>,
    /// The call's peers (for the flight record).
    peers: Vec<usize>,
    /// The flight record's entry, until the call's outcome is recorded.
    entry: Option<u64>,
}

impl<'c> SessionKind<'c> for DeviceSession<'c> {
    /// The host checks but the fence: a device call is refused on a destroyed, failed or
    /// aborted communicator, and never waits for the device work in flight.
    fn open(comm: &'c Communicator, what: &str) -> Result<DeviceSession<'c>> {
        let busy = comm.enter_device_call(what)?;
        Ok(DeviceSession { comm, _busy: busy, peers: Vec::new(), entry: None })
    }

    fn peers(&mut self) -> &mut Vec<usize> {
        &mut self.peers
    }

    fn start(&mut self, what: &str, desc: &mismatch::Desc) {
        self.entry = Some(self.comm.start_device_entry(what, desc, &self.peers));
    }

    /// An error (an enqueue that failed part way, so this rank would skip work its peers
    /// run) is settled with the peers through the control channel and fails the
    /// communicator, unless [`DeviceSession::refuse`] already recorded it.
    fn finish<T>(&mut self, r: Result<T>) -> Result<T> {
        let Some(entry) = self.entry.take() else { return r };
        let comm = self.comm;
        match r {
            Ok(v) => {
                comm.finish_device_entry(entry, &Ok(()));
                Ok(v)
            }
            Err(e) => {
                let e = comm.fail_device_call(e);
                comm.finish_device_entry(entry, &Err(e.clone()));
                Err(e)
            }
        }
    }
}

impl DeviceSession<'_> {
    /// Refuses the call with `e` before anything of it was enqueued (its device state could
    /// not be set up, its buffers are on another GPU than the communicator's): the entry is
    /// recorded failed, the communicator is not failed (what set-up ran on the host failed it
    /// already if it had to).
    pub(crate) fn refuse(&mut self, e: Error) -> Error {
        let e = self.comm.record(e);
        if let Some(entry) = self.entry.take() {
            self.comm.finish_device_entry(entry, &Err(e.clone()));
        }
        e
    }
}
