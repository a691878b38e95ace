//! The one-shot CUDA IPC flows of every collective but all-reduce (which has its own plans in
//! `ipc.rs`): broadcast, reduce, all-gather, reduce-scatter, all-to-all, gather and scatter
//! between the ranks of one host, entirely on the GPU and ordered on the internal stream.
//!
//! The schedule is the window plan `algo::window::collective` (validated and simulated there):
//! per chunk, every rank stages what the peers need into its input area (for all-to-all,
//! scatter and reduce-scatter one block per destination rank; PreMulSum with a host factor on
//! reduce and reduce-scatter scales the staged bytes), barrier 0, every rank pulls what it
//! receives straight from the peers' mapped input areas into its receive buffer (or folds them,
//! for reduce and reduce-scatter), barrier 1. This file runs it through the window executor
//! (`window.rs`).
//!
//! Which path a call takes is [`crate::algo::select::device_flow`]'s decision (send/receive:
//! the exchange of `p2p.rs`; PreMulSum with a factor in device memory stays on the staged
//! path). A group runs its calls one after another on the internal stream, each through its
//! own flow, when every one of them has an IPC flow.

use super::exec::{DevOp, Scalar};
use super::ipc::Ipc;
use super::window::Frame;
use super::Gpu;
use crate::algo::window;
#[cfg(test)]
use crate::algo::Collective;
use crate::error::{Error, Result};
use cudarc::driver::sys;

#[cfg(test)]
use crate::algo::select::DeviceFlow;

/// [`crate::algo::select::device_flow`] for `op`, with `ipc` as `Some((ranks, area))` in IPC
/// mode.
#[cfg(test)]
fn choose(op: &DevOp, ipc: Option<(usize, usize)>) -> DeviceFlow {
    let (n, area) = ipc.map_or((0, None), |(n, a)| (n, Some(a)));
    crate::algo::select::device_flow(&op.shape(), n, area)
}

impl Ipc {
    /// Enqueues a call [`choose`] sent here on the internal stream (context current, n ≥ 2).
    /// A failure to enqueue fails the communicator, as for the all-reduce.
    ///
    /// # Safety
    /// `op.send` / `op.recv` must be device addresses on this GPU holding what the collective
    /// uses on this rank ([`Collective::buffer_counts`]), valid until the stream has run the
    /// call; in NCCL's in-place layout or not overlapping.
    pub(crate) unsafe fn collective(&mut self, gpu: &Gpu, op: &DevOp) -> Result<()> {
        let stream = self.stream();
        // SAFETY: forwarded from this function's contract.
        self.guarded(|ipc| unsafe { ipc.enqueue_oneshot(gpu, op, stream, false) })
    }

    /// [`Ipc::collective`] on `stream`, which is capturing a CUDA graph: the barriers use the
    /// capture flags and nothing is counted for the watchdog, as `Ipc::all_reduce_captured`
    /// (every plan here has two barriers per chunk, so replays keep the phases alternating).
    ///
    /// # Safety
    /// As [`Ipc::collective`], until the last launch of the graph has run.
    pub(crate) unsafe fn collective_captured(&mut self, gpu: &Gpu, op: &DevOp, stream: sys::CUstream) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        self.guarded(|ipc| unsafe { ipc.enqueue_oneshot(gpu, op, stream, true) })
    }

    /// # Safety
    /// As [`Ipc::collective`].
    unsafe fn enqueue_oneshot(&mut self, gpu: &Gpu, op: &DevOp, stream: sys::CUstream, captured: bool) -> Result<()> {
        let (me, n, es) = (self.rank(), self.size(), op.dtype.size());
        let factor = match op.scale {
            Some(Scalar::Host(f)) => Some(f),
            _ => None,
        };
        let plan = window::collective(op.coll, me, n, op.count, es, self.half(), factor.is_some());
        debug_assert!(!captured || plan.barriers() % 2 == 0, "a captured plan with an odd number of barriers");
        if cfg!(debug_assertions) {
            let (sc, rc) = op.coll.buffer_counts(me, n, op.count);
            let b = window::Bounds { input: sc * es, output: rc * es, areas: self.areas(), nranks: n };
            window::validate(&plan, &b).map_err(|e| Error::internal(format!("{:?} window plan: {e}", op.coll)))?;
        }
        let f = Frame {
            send: op.send,
            recv: op.recv,
            inputs: Vec::new(),
            outputs: Vec::new(),
            count: op.count as u64,
            dtype: op.dtype,
            op: op.op,
            scale: factor,
            stream,
            captured,
            board: false,
        };
        // SAFETY: the plan's ranges lie in the call's buffers (the contract) and the regions.
        unsafe { self.window().run_window(gpu, &plan, &f) }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::exec::Scalar;
    use crate::types::ReduceOp;

    #[test]
    fn chunks_fit_the_area_and_the_choice_follows_the_mode() {
        let plan = window::collective(Collective::AllToAll, 1, 4, 100, 4, 256, false);
        // 256 bytes / (4 blocks × 4 bytes) = 16 elements per chunk: 7 chunks, 2 barriers each.
        assert_eq!(plan.barriers(), 14);
        let b = window::Bounds { input: 1600, output: 1600, areas: vec![256], nranks: 4 };
        window::validate(&plan, &b).unwrap();
        assert!(window::collective(Collective::AllGather, 0, 2, 0, 4, 256, false).ops.is_empty());
        let op = |coll, scale| DevOp {
            coll,
            send: 0,
            recv: 0,
            count: 1,
            dtype: crate::types::DataType::Float32,
            op: ReduceOp::Sum,
            scale,
        };
        let ipc = Some((4, 256));
        assert_eq!(choose(&op(Collective::AllGather, None), ipc), DeviceFlow::OneShot);
        assert_eq!(choose(&op(Collective::AllGather, None), None), DeviceFlow::Staged);
        assert_eq!(choose(&op(Collective::AllGather, None), Some((1, 256))), DeviceFlow::Staged);
        // 4 blocks of one 4-byte element fit 16 bytes, not 15.
        assert_eq!(choose(&op(Collective::AllToAll, None), Some((4, 16))), DeviceFlow::OneShot);
        assert_eq!(choose(&op(Collective::AllToAll, None), Some((4, 15))), DeviceFlow::Staged);
        assert!(window::collective(Collective::AllToAll, 0, 4, 10, 4, 15, false).ops.is_empty());
        // PreMulSum: a host factor on reduce and reduce-scatter only.
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scalar::Host(2.0))), ipc), DeviceFlow::OneShot);
        assert_eq!(choose(&op(Collective::Reduce { root: 1 }, Some(Scalar::Host(2.0))), ipc), DeviceFlow::OneShot);
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scalar::Device(64))), ipc), DeviceFlow::Staged);
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scalar::Host(2.0))), None), DeviceFlow::Staged);
        // Sends and receives: the exchange in IPC mode, when a block of the area (one per rank,
        // 64-byte aligned) holds an element.
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), ipc), DeviceFlow::Exchange);
        assert_eq!(choose(&op(Collective::Recv { peer: 3 }, None), ipc), DeviceFlow::Exchange);
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), None), DeviceFlow::Staged);
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), Some((4, 255))), DeviceFlow::Staged);
        assert_eq!(choose(&op(Collective::AllReduce, None), None), DeviceFlow::AllReduce);
        assert_eq!(choose(&op(Collective::AllReduce, Some(Scalar::Host(2.0))), ipc), DeviceFlow::Staged);
    }
}
