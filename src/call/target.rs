//! Where a call runs, decided once from the buffers this rank uses.

use crate::algo::Collective;
use crate::comm::Communicator;
use crate::error::Result;
use std::ffi::c_void;

/// Where a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Host memory: the blocking host path.
    Host,
    /// Device (or managed) memory of GPU `ordinal`: stream-ordered device work.
    Device {
        /// The GPU holding the buffers.
        ordinal: i32,
    },
}

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
        Ok(match crate::device::route(send, recv, stream)? {
            crate::device::Route::Host => {
                if crate::device::driver_loaded() {
                    crate::device::quiesce(self)?;
                }
                Target::Host
            }
            crate::device::Route::Device { ordinal } => Target::Device { ordinal },
        })
    }
}
