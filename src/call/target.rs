//! Where a call runs, decided once from the buffers this rank uses.

use crate::algo::Collective;
use crate::comm::Communicator;
use crate::device::Target;
use crate::error::Result;
use std::ffi::c_void;

impl Communicator {
    /// Decides where a call runs from the buffers this rank uses ([`Collective::buffer_counts`]:
    /// the send buffer of a non-root broadcast or scatter rank and the receive buffer of a
    /// non-root reduce or gather rank are never looked at), and for host buffers synchronises a
    /// non-null `stream` (when CUDA is loaded) so the host sees earlier GPU work, and waits for
    /// this communicator's device calls still run by its proxy thread (so the host call cannot
    /// interleave with them on the links).
    ///
    /// Buffers of different kinds (host and device, or two GPUs) are `ncclInvalidArgument`.
    pub fn target(
        &self,
        coll: Collective,
        send: *const c_void,
        recv: *const c_void,
        count: usize,
        stream: *mut c_void,
    ) -> Result<Target> {
        let (sc, rc) = coll.buffer_counts(self.rank(), self.size(), count);
        let send = if sc > 0 { send } else { std::ptr::null() };
        let recv = if rc > 0 { recv } else { std::ptr::null() };
        let target = crate::device::route(send, recv, stream)?;
        if target == Target::Host && crate::device::driver_loaded() {
            crate::device::quiesce(self)?;
        }
        Ok(target)
    }
}
