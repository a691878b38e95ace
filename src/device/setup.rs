//! Setting up a communicator's device state: every rank publishes its CUDA IPC card, all pick
//! the same mode (CUDA IPC or the proxy), peers of this process on other GPUs get peer access,
//! and a WARN line says when ranks of other processes time-slice this GPU without MPS.

use super::ipc::Ipc;
use super::layout::MAX_RANKS;
use super::proxy::Proxy;
use super::region::{Card, Region, CARD_BYTES};
use super::{check, Gpu};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::ReduceOp;
use cudarc::driver::sys;
use std::sync::Arc;

/// A communicator's device mode (chosen here, at set-up; kept in its state, `state.rs`).
pub(super) enum DeviceMode {
    /// Pinned host staging into the host engine.
    Proxy(Proxy),
    /// CUDA IPC between the ranks of one host.
    Ipc(Ipc),
}

/// Default bytes of each IPC staging area (input and result), `OXCCL_CUDA_IPC_BUFFER`.
const IPC_HALF: usize = 32 << 20;

/// Exchanges IPC cards and picks the mode every rank will pick. Falling back to the proxy
/// for a reason other than `OXCCL_CUDA_IPC=0` or ranks on several hosts is a WARN line naming
/// the reason; with `OXCCL_CUDA_IPC=require` it is an error instead.
pub(super) fn choose_mode(comm: &Arc<Communicator>, gpu: &Gpu, stream: sys::CUstream) -> Result<DeviceMode> {
    let (rank, n) = (comm.rank(), comm.size());
    let required = comm.config().cuda_ipc_required;
    let same_host = comm.hosts().iter().all(|h| *h == comm.hosts()[0]);
    let no_ipc = crate::algo::select::ipc_refusal(comm.config().cuda_ipc, same_host, n);
    if let Some(why) = no_ipc {
        return fallback(comm, stream, &why, required, n > MAX_RANKS);
    }
    let half = comm.config().cuda_ipc_buffer.unwrap_or(IPC_HALF);
    // Kernels first: a rank that cannot compile them must not choose IPC.
    let small = comm.config().small_kernel;
    let ll = if super::small::wanted(small, n) { super::small::area_bytes(n) } else { 0 };
    let mine = gpu.kernels().and_then(|_| Region::new(half, ll, small, stream));
    if let Err(e) = &mine {
        crate::warn!("rank {rank}: CUDA IPC unavailable here: {}", e.message());
    }
    let card = mine.as_ref().map_or_else(|_| Card::unusable(gpu.ordinal), |r| r.card(gpu.ordinal));
    let cards = exchange(comm, &card)?;
    // Ranks of this process on other GPUs are addressed directly: this GPU's context needs
    // peer access to theirs (each rank enables its own direction).
    let mut others: Vec<i32> =
        cards.iter().filter(|c| c.ok && c.same_process() && c.ordinal != gpu.ordinal).map(|c| c.ordinal).collect();
    others.sort_unstable();
    others.dedup();
    let peers = others.iter().try_for_each(|&o| enable_peer_access(gpu, o));
    let opened = match (cards.iter().position(|c| !c.ok), peers, mine) {
        (None, Ok(()), Ok(region)) => Ipc::open(comm, region, &cards, stream),
        (Some(r), _, Ok(_)) => Err(Error::internal(format!("rank {r} cannot export a CUDA IPC region"))),
        (None, Err(e), Ok(_)) => Err(e),
        (_, _, Err(e)) => Err(e),
    };
    // Everyone must agree that every rank mapped every peer.
    let ok = u8::from(opened.is_ok());
    let mut all_ok = [0u8];
    comm.all_reduce_slices(&[ok], &mut all_ok, ReduceOp::Min)?;
    match opened {
        Ok(ipc) if all_ok[0] == 1 => {
            crate::info!("rank {rank}: device collectives through CUDA IPC ({n} ranks, {half} bytes per staging area)");
            warn_if_time_sliced(rank, &card, &cards);
            Ok(DeviceMode::Ipc(ipc))
        }
        Ok(_) => fallback(comm, stream, "another rank could not map every peer's region", required, true),
        Err(e) => fallback(comm, stream, e.message(), required, true),
    }
}

/// A WARN line when a rank of another process uses this rank's GPU and no MPS daemon is seen:
/// the two processes' contexts then take turns on the GPU, so their kernels and copies wait for
/// context switches (docs/GPU.md, "Results on a GPU": an 8 B all-reduce costs about four times
/// what it costs with both ranks in one process).
fn warn_if_time_sliced(rank: usize, mine: &Card, cards: &[Card]) {
    let sharers: Vec<usize> =
        (0..cards.len()).filter(|&q| q != rank && !cards[q].same_process() && cards[q].pci == mine.pci).collect();
    if sharers.is_empty() || super::region::mps_seen() {
        return;
    }
    crate::warn!(
        "rank {rank}: ranks {sharers:?} are other processes on this GPU and no MPS daemon is seen: their CUDA \
         contexts take turns on the GPU, so every device collective waits for context switches (several \
         times the cost of the same call between ranks of one process); run one process per GPU, drive \
         ranks sharing a GPU from threads of one process, or start MPS (nvidia-cuda-mps-control -d)"
    );
}

/// Lets kernels and copies of `gpu`'s context (the current one) address GPU `other`'s memory
/// (`cuCtxEnablePeerAccess`), for ranks of one process on different GPUs.
fn enable_peer_access(gpu: &Gpu, other: i32) -> Result<()> {
    let peer = super::gpu(other)?;
    let dev = |o: i32| cudarc::driver::result::device::get(o).map_err(|e| super::cu_err(e.0, "cuDeviceGet"));
    let mut can = 0;
    // SAFETY: valid device handles; writes one int.
    check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev(gpu.ordinal)?, dev(other)?) }, "cuDeviceCanAccessPeer")?;
    if can == 0 {
        return Err(Error::internal(format!(
            "GPU {} cannot access GPU {other}'s memory (no peer access between them) for a rank of this process there",
            gpu.ordinal
        )));
    }
    // SAFETY: `gpu`'s context is current (the caller entered it); the peer's primary context is
    // retained for the process.
    match unsafe { sys::cuCtxEnablePeerAccess(peer.context(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        r => check(r, &format!("cuCtxEnablePeerAccess(GPU {} -> GPU {other})", gpu.ordinal)),
    }
}

/// The proxy mode, chosen because of `why`: an INFO line (a WARN line when `downgrade`: CUDA
/// IPC was expected), or an error under `OXCCL_CUDA_IPC=require`.
fn fallback(
    comm: &Communicator,
    stream: sys::CUstream,
    why: &str,
    required: bool,
    downgrade: bool,
) -> Result<DeviceMode> {
    let rank = comm.rank();
    if required {
        return Err(Error::invalid_usage(format!(
            "rank {rank}: OXCCL_CUDA_IPC=require, but CUDA IPC cannot be used: {why}"
        )));
    }
    if downgrade {
        crate::warn!(
            "rank {rank}: device collectives through pinned host staging (proxy), much slower than CUDA IPC: {why}"
        );
    } else {
        crate::info!("rank {rank}: device collectives through pinned host staging (proxy): {why}");
    }
    Ok(DeviceMode::Proxy(Proxy::new(rank, comm.config().timeout, stream)?))
}

/// Every rank's card, through a sum all-reduce of disjoint host slots.
fn exchange(comm: &Communicator, card: &Card) -> Result<Vec<Card>> {
    let n = comm.size();
    let mut mine = vec![0u8; n * CARD_BYTES];
    card.write(&mut mine[comm.rank() * CARD_BYTES..(comm.rank() + 1) * CARD_BYTES]);
    let mut all = vec![0u8; n * CARD_BYTES];
    comm.all_reduce_slices(&mine, &mut all, ReduceOp::Sum)?;
    all.chunks(CARD_BYTES)
        .enumerate()
        .map(|(r, b)| Card::read(b).ok_or_else(|| Error::internal(format!("rank {r} published no CUDA IPC card"))))
        .collect()
}
