//! `--mem cuda`: the benchmark's buffers on a GPU, a stream to run on, and CUDA-event timing.
//!
//! Inputs are written into the host buffers as usual, then copied to the device; results are
//! copied back before the check. The GPU is `local_rank % GPUs`, so several ranks of one host
//! share a GPU when there are fewer GPUs than ranks.

use super::colls::{Call, Kind};
use cudarc::driver::{result, sys};
use oxccl::device::DevOp;
use oxccl::Collective;
use std::sync::Arc;

/// Device copies of the send and receive buffers, the rank's stream and two timing events.
pub struct DevBufs {
    /// GPU ordinal.
    pub ordinal: i32,
    /// Device address of the send buffer.
    pub send: u64,
    /// Device address of the receive buffer.
    pub recv: u64,
    send_len: usize,
    recv_len: usize,
    stream: sys::CUstream,
    start: sys::CUevent,
    end: sys::CUevent,
    _gpu: Arc<oxccl::device::Gpu>,
}

fn err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("{what}: {e:?}")
}

impl DevBufs {
    /// Allocates `send_len` and `recv_len` bytes on GPU `local_rank % GPUs`.
    pub fn new(local_rank: usize, send_len: usize, recv_len: usize) -> Result<DevBufs, String> {
        let n = oxccl::device::device_count();
        if n == 0 {
            return Err("no CUDA device: --mem cuda needs a GPU".into());
        }
        let ordinal = (local_rank % n) as i32;
        let gpu = oxccl::device::gpu(ordinal).map_err(|e| e.to_string())?;
        let _ctx = gpu.enter().map_err(|e| e.to_string())?;
        // SAFETY: plain allocations in the current (primary) context, freed in Drop.
        let (send, recv) = unsafe {
            (
                result::malloc_sync(send_len.max(16)).map_err(|e| err("cuMemAlloc", e))?,
                result::malloc_sync(recv_len.max(16)).map_err(|e| err("cuMemAlloc", e))?,
            )
        };
        let stream =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| err("cuStreamCreate", e))?;
        let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| err("cuEventCreate", e))?;
        let end = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| err("cuEventCreate", e))?;
        Ok(DevBufs { ordinal, send, recv, send_len, recv_len, stream, start, end, _gpu: gpu })
    }

    fn enter(&self) -> Result<oxccl::device::CtxGuard, String> {
        self._gpu.enter().map_err(|e| e.to_string())
    }

    /// Copies both host buffers to the device on the rank's stream and waits for the copies.
    ///
    /// Not `cuMemcpyHtoD`: from pageable memory that returns once the bytes are staged, its DMA
    /// runs on the legacy stream, and the rank's non-blocking stream does not wait for it, so a
    /// collective enqueued next could read the old contents.
    pub fn upload(&self, send: &[u8], recv: &[u8]) -> Result<(), String> {
        let _c = self.enter()?;
        // SAFETY: the device buffers hold send_len / recv_len bytes; the host slices outlive the
        // copies, which the stream synchronisation below completes.
        unsafe {
            result::memcpy_htod_async(self.send, &send[..self.send_len.min(send.len())], self.stream)
                .map_err(|e| err("cuMemcpyHtoDAsync", e))?;
            result::memcpy_htod_async(self.recv, &recv[..self.recv_len.min(recv.len())], self.stream)
                .map_err(|e| err("cuMemcpyHtoDAsync", e))?;
            result::stream::synchronize(self.stream).map_err(|e| err("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    /// Waits for the stream, then copies the device receive buffer into `recv`.
    pub fn download(&self, recv: &mut [u8]) -> Result<(), String> {
        let _c = self.enter()?;
        let n = self.recv_len.min(recv.len());
        // SAFETY: synchronises the stream, then a synchronous copy of `n` bytes.
        unsafe {
            result::stream::synchronize(self.stream).map_err(|e| err("cuStreamSynchronize", e))?;
            result::memcpy_dtoh_sync(&mut recv[..n], self.recv).map_err(|e| err("cuMemcpyDtoH", e))?;
        }
        Ok(())
    }

    /// Enqueues one call of `kind` on the rank's stream through the library's stream entry
    /// point ([`oxccl::Communicator::launch`]; sendrecv: a [`oxccl::launch::StreamGroup`]).
    ///
    /// # Safety
    /// `call`'s buffers must lie inside this rank's device buffers for its counts.
    pub unsafe fn run(&self, comm: &Arc<oxccl::Communicator>, kind: Kind, call: &Call) -> oxccl::Result<()> {
        let op = |coll: Collective, send: u64, recv: u64| DevOp {
            coll,
            send,
            recv,
            count: call.count,
            dtype: call.dtype,
            op: call.op,
            scale: None,
        };
        let (send, recv, stream) = (call.send as u64, call.recv as u64, self.stream.cast());
        match kind {
            // SAFETY: forwarded from this function's contract.
            Kind::Coll(make) => unsafe { comm.launch(op(make(call.root), send, recv), stream) },
            Kind::SendRecv => {
                let (rank, n) = (comm.rank(), comm.size());
                let mut g = oxccl::launch::StreamGroup::default();
                let s = op(Collective::Send { peer: (rank + 1) % n }, send, 0);
                let r = op(Collective::Recv { peer: (rank + n - 1) % n }, 0, recv);
                for o in [s, r] {
                    comm.check_device_call(&o)?;
                    // SAFETY: forwarded; the stream runs the group before the buffers change.
                    unsafe { g.push(comm.clone(), self.ordinal, o, stream) };
                }
                g.run()
            }
        }
    }

    /// Runs `body` between two events on the stream and returns the elapsed seconds.
    pub fn time(&self, body: impl FnOnce() -> Result<(), String>) -> Result<f64, String> {
        let _c = self.enter()?;
        // SAFETY: live events and stream of the current context.
        unsafe { result::event::record(self.start, self.stream).map_err(|e| err("cuEventRecord", e))? };
        body()?;
        // SAFETY: as above; elapsed reads two completed events.
        unsafe {
            result::event::record(self.end, self.stream).map_err(|e| err("cuEventRecord", e))?;
            result::event::synchronize(self.end).map_err(|e| err("cuEventSynchronize", e))?;
            Ok(f64::from(result::event::elapsed(self.start, self.end).map_err(|e| err("cuEventElapsedTime", e))?) / 1e3)
        }
    }
}

impl Drop for DevBufs {
    fn drop(&mut self) {
        if let Ok(_c) = self.enter() {
            // SAFETY: created in `new`; the stream is drained first so nothing uses them.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::event::destroy(self.start);
                let _ = result::event::destroy(self.end);
                let _ = result::stream::destroy(self.stream);
                let _ = result::free_sync(self.send);
                let _ = result::free_sync(self.recv);
            }
        }
    }
}
