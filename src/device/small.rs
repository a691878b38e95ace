//! The LL flow: a small CUDA IPC all-reduce in one kernel launch (`OXCCL_SMALL_KERNEL=1`).
//!
//! Today's small flow (`ipc.rs`, `all_reduce_small`) is five stream operations per rank: copy
//! in, flag write, flag wait, fold kernel, the closing done/ticket write. With the LL flow, one
//! kernel (`oxccl_ll_<type>_<op>`, `cuda/reduce.cu`) does the copy, the barrier and the fold:
//! each rank writes its buffer, 8 bytes per 16-byte line with the call's flag beside each 4-byte
//! half (the "low latency" line format NCCL's LL protocol uses), straight into a receive slot
//! in every peer's region, and polls its own slots until every peer's lines carry the flag; then
//! it folds all ranks in rank order (the same order and rounding as the fold kernel) into
//! `recv`. The call is then two stream operations: the kernel and the done/ticket write.
//!
//! **When.** Off by default (`OXCCL_SMALL_KERNEL=1` turns it on) until a GPU run has measured it
//! against the 5-operation flow (`scripts/gpu-kit/run`, step `small-kernel`). With it on, an
//! all-reduce of 1 to [`SMALL_KERNEL_BYTES`] bytes, not captured into a CUDA graph, takes it
//! when every rank asked for it and no two ranks use one GPU (ranks of one process on several
//! GPUs, or processes with a GPU each). Never where ranks share a GPU: the kernel spins until
//! the peers' kernels have written, so two processes time-slicing one GPU would each spin
//! through their time slice while the other cannot run, and two ranks of one process on one GPU
//! depend on the GPU running both kernels at once, which one hardware queue
//! (`CUDA_DEVICE_MAX_CONNECTIONS=1`, or a group's calls on one stream) does not. At most
//! [`SMALL_KERNEL_MAX_RANKS`] ranks (the slots cost `2 × n × 16 KiB` per rank). Which of these
//! holds is decided at set-up from the ranks' cards, so every rank decides alike; a rank that
//! asked for it and cannot have it logs one WARN naming why.
//!
//! **Slots.** A rank's region gets, after the board, an LL area of two sets (parity 0 and 1) of
//! `n` slots, slot `q` receiving rank `q`'s lines ([`SLOT`] bytes: [`SMALL_KERNEL_BYTES`] / 8
//! lines of 16 bytes), zeroed at set-up. A call takes the next barrier sequence number `s` (so
//! the watchdog and the other flows count it like any call) and writes `s` as its flag into the
//! set `s mod 2`: no slot is ever reset (stale lines carry an older number; `s` is never 0,
//! the zeroed slots' value: a call whose number wrapped to 0 takes the 5-operation flow). A
//! sender reuses a set only once the reader's kernel that read it has ended: the next call with
//! the same parity comes two sequence numbers later, and the call in between (LL or any other
//! flow, each of which waits for every peer) cannot end on the sender before the reader wrote
//! its part of it, which the reader's stream does only after the kernel that read the set.
//!
//! **Failures.** A waiting thread looks at its rank's abort word (in the host-mapped flag
//! page) every few thousand polls and gives up when it is set: a failing peer's watchdog writes
//! it, and this rank's watchdog writes it on its own failure (a timeout, a dead peer), so the
//! kernel ends, the stream drains and the error is reported as for the other flows.

use super::layout::ABORT;
use super::region::{Card, Region};
use super::{check, DevCall, Gpu};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Largest all-reduce (bytes) that takes the LL flow when it is on
/// ([`crate::algo::select::ipc_ll`] decides which calls take it).
pub(crate) const SMALL_KERNEL_BYTES: usize = crate::algo::select::IPC_LL_BYTES;
/// Most ranks the LL flow serves (the slots grow with the number of ranks).
pub(crate) const SMALL_KERNEL_MAX_RANKS: usize = 16;
/// Bytes of a line: 8 bytes of data and two copies of the flag.
const LINE: usize = 16;
/// Bytes of one receive slot: the lines of [`SMALL_KERNEL_BYTES`].
pub(crate) const SLOT: usize = SMALL_KERNEL_BYTES / 8 * LINE;
/// Most threads of the kernel's one block (a thread handles every `THREADS`-th line).
const THREADS: u64 = 512;

/// Bytes of the LL area of a region of a communicator of `n` ranks.
pub(crate) fn area_bytes(n: usize) -> usize {
    2 * n * SLOT
}

/// Whether this rank asks for the LL flow: `OXCCL_SMALL_KERNEL` 1 or 2 (`level`) and at most
/// [`SMALL_KERNEL_MAX_RANKS`] ranks (its region then gets the LL area).
pub(crate) fn wanted(level: u8, n: usize) -> bool {
    level > 0 && (2..=SMALL_KERNEL_MAX_RANKS).contains(&n)
}

/// Bytes of a communicator's LL table for `n` ranks (`LL_*` in `cuda/reduce.cu`).
pub(crate) fn table_bytes(n: usize) -> usize {
    (5 + 2 * n) * 8
}

/// The set-up's decision from every rank's card (the same on every rank).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Small all-reduces take the LL flow.
    Use,
    /// No rank asked for it.
    NotAsked,
    /// Some rank asked for it and it cannot be used, for this reason.
    Refused(String),
}

/// Decides from the cards (indexed by rank) whether the LL flow can be used: every rank asked
/// for it (and so has the slots), at most [`SMALL_KERNEL_MAX_RANKS`] ranks, and no two ranks on
/// one GPU (the same PCI location; a rank whose GPU's location is unknown shares with anyone)
/// unless both are of one process and asked with `OXCCL_SMALL_KERNEL=2`.
pub(crate) fn choose(cards: &[Card]) -> Choice {
    let asked: Vec<usize> = (0..cards.len()).filter(|&q| cards[q].small > 0).collect();
    if asked.is_empty() {
        return Choice::NotAsked;
    }
    if cards.len() > SMALL_KERNEL_MAX_RANKS {
        return Choice::Refused(format!("{} ranks, more than the {SMALL_KERNEL_MAX_RANKS} it serves", cards.len()));
    }
    if asked.len() < cards.len() {
        let not: Vec<usize> = (0..cards.len()).filter(|q| !asked.contains(q)).collect();
        return Choice::Refused(format!("ranks {not:?} did not set OXCCL_SMALL_KERNEL=1"));
    }
    for q in 0..cards.len() {
        for r in 0..q {
            let (a, b) = (&cards[q], &cards[r]);
            let same_gpu = if a.pci != 0 && b.pci != 0 {
                a.pci == b.pci
            } else {
                // The location is unknown: only ranks of one process on different ordinals are
                // known to be on different GPUs.
                !(a.token == b.token && a.ordinal != b.ordinal)
            };
            let one_process = a.token == b.token && a.small == 2 && b.small == 2;
            if same_gpu && !one_process {
                let hint = if a.token == b.token { "; OXCCL_SMALL_KERNEL=2 on both allows it" } else { "" };
                return Choice::Refused(format!(
                    "ranks {r} and {q} use one GPU (its kernel would spin while the other rank's cannot run{hint})"
                ));
            }
        }
    }
    Choice::Use
}

/// The LL flow of a communicator whose regions are mapped here at `bases` (indexed by rank):
/// `None` when no rank asked for it, or (one WARN) when it cannot be used ([`choose`]); an INFO
/// line says when it is on. The table is written on `stream` (the internal stream).
pub(crate) fn open(
    rank: usize,
    region: &Region,
    bases: &[u64],
    cards: &[Card],
    stream: sys::CUstream,
) -> Result<Option<Ll>> {
    match choose(cards) {
        Choice::Use => {
            let at = Region::bytes(region.half) as u64;
            let areas: Vec<u64> = bases.iter().map(|b| b + at).collect();
            let ll = Ll::new(rank, &areas, region.flags.dev(ABORT), stream)?;
            crate::info!(
                "rank {rank}: device all-reduces of 1..{SMALL_KERNEL_BYTES} bytes in one LL kernel launch (OXCCL_SMALL_KERNEL={})",
                region.small
            );
            Ok(Some(ll))
        }
        Choice::NotAsked => Ok(None),
        Choice::Refused(why) => {
            if region.ll > 0 {
                crate::warn!(
                    "rank {rank}: OXCCL_SMALL_KERNEL={} ignored, small all-reduces take five stream operations: {why}",
                    region.small
                );
            }
            Ok(None)
        }
    }
}

/// The LL flow's state of a communicator: its table in device memory, the kernel's `ctl`.
pub(crate) struct Ll {
    /// Device address of the table (`LL_*` in `cuda/reduce.cu`): the number of ranks, this
    /// rank, [`SLOT`], the device address of this rank's abort word, of its LL area, then for
    /// set `p` and rank `q` the address of this rank's slot in rank `q`'s set `p` (unused for
    /// `q` = this rank).
    table: u64,
}

impl Ll {
    /// Builds the table (context current): `areas[q]` is the device address, here, of rank
    /// `q`'s LL area; `stop` that of this rank's abort word. The copy runs on `stream` (the
    /// internal stream, non-blocking), waited for: never on the legacy stream, which would join
    /// (and invalidate) a user's capture of a blocking stream when the communicator's first
    /// device call is captured.
    pub(crate) fn new(me: usize, areas: &[u64], stop: u64, stream: sys::CUstream) -> Result<Ll> {
        let n = areas.len();
        let mut addrs = vec![n as u64, me as u64, SLOT as u64, stop, areas[me]];
        for p in 0..2 {
            for &a in areas {
                addrs.push(a + ((p * n + me) * SLOT) as u64);
            }
        }
        let bytes = addrs.len() * 8;
        debug_assert_eq!(bytes, table_bytes(n));
        let mut table: sys::CUdeviceptr = 0;
        // SAFETY: writes the allocation's address.
        check(unsafe { sys::cuMemAlloc_v2(&mut table, bytes) }, "cuMemAlloc(LL table)")?;
        let ll = Ll { table };
        // SAFETY: `table` holds `bytes` bytes; `addrs` is live until the stream is synchronised
        // below (a copy from pageable memory is staged before the call returns anyway).
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(table, addrs.as_ptr().cast(), bytes, stream) };
        check(r, "cuMemcpyHtoDAsync(LL table)")?;
        // SAFETY: the caller's live stream of the current context.
        check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize(LL table)")?;
        Ok(ll)
    }

    /// Frees the table (context current; no work uses it any more).
    pub(crate) fn free(self) {
        // SAFETY: allocated in `new`, freed once.
        unsafe { sys::cuMemFree_v2(self.table) };
    }
}

/// Threads of the kernel's one block for `lines` lines: one per line up to [`THREADS`], in
/// whole warps. The same on every rank for a call (every rank's thread `t` handles the same
/// lines).
fn threads_for(lines: u64) -> u32 {
    lines.next_multiple_of(32).clamp(32, THREADS) as u32
}

/// Launches the LL kernel of `call` on its stream: one block of [`threads_for`] threads, flag
/// `seq` (the call's barrier sequence number, never 0), `ctl` the communicator's table.
///
/// # Safety
/// `call`'s buffers must be device addresses of `count` elements on `gpu`, valid until the
/// stream has run the kernel (equal for in place, otherwise not overlapping); `ctl` a live
/// table of [`Ll`] whose LL areas are mapped here.
pub(crate) unsafe fn launch(gpu: &Gpu, ctl: &Ll, call: &DevCall, seq: u32) -> Result<()> {
    let name = super::kernels::ll_name(call.dtype, call.op);
    let (f, _) = gpu.kernels()?.entry(&name)?;
    let lines = (call.count * call.dtype.size()).div_ceil(8) as u64;
    let (mut dst, mut src, mut count, mut table, mut flag) = (call.recv, call.send, call.count as u64, ctl.table, seq);
    let mut args: [*mut c_void; 5] = [
        (&mut dst as *mut u64).cast(),
        (&mut src as *mut u64).cast(),
        (&mut count as *mut u64).cast(),
        (&mut table as *mut u64).cast(),
        (&mut flag as *mut u32).cast(),
    ];
    let threads = threads_for(lines);
    // SAFETY: the argument list matches `oxccl_ll_*(T*, const T*, u64, const u64*, u32)`; the
    // buffers per this function's contract; the table, the LL areas it names (this rank's and
    // the peers' mapped ones) and the abort word live with the communicator.
    check(
        unsafe {
            sys::cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, 0, call.stream, args.as_mut_ptr(), std::ptr::null_mut())
        },
        &format!("cuLaunchKernel({name})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(token: u64, ordinal: i32, pci: u64, small: u8) -> Card {
        Card { token, ordinal, pci, small, ..Card::unusable(ordinal) }
    }

    #[test]
    fn the_choice_needs_every_rank_asking_and_a_gpu_each() {
        let c = |v: &[(u64, i32, u64, u8)]| choose(&v.iter().map(|&(t, o, p, s)| card(t, o, p, s)).collect::<Vec<_>>());
        assert_eq!(c(&[(1, 0, 10, 0), (2, 0, 11, 0)]), Choice::NotAsked);
        assert_eq!(c(&[(1, 0, 10, 1), (2, 0, 11, 1)]), Choice::Use, "processes with a GPU each");
        assert_eq!(c(&[(1, 0, 10, 1), (1, 1, 11, 2)]), Choice::Use, "one process, two GPUs");
        assert_eq!(c(&[(1, 0, 0, 1), (1, 1, 0, 1)]), Choice::Use, "one process, two ordinals, no PCI");
        assert_eq!(c(&[(1, 0, 10, 2), (1, 0, 10, 2)]), Choice::Use, "one process, one GPU, level 2");
        let refused = |v: &[(u64, i32, u64, u8)], why: &str| match c(v) {
            Choice::Refused(m) => assert!(m.contains(why), "{m}"),
            other => panic!("{other:?}, want a refusal naming {why}"),
        };
        refused(&[(1, 0, 10, 1), (2, 0, 10, 1)], "ranks 0 and 1 use one GPU");
        refused(&[(1, 0, 10, 2), (2, 0, 10, 2)], "cannot run)");
        refused(&[(1, 0, 10, 1), (1, 0, 10, 2)], "OXCCL_SMALL_KERNEL=2 on both allows it");
        refused(&[(1, 0, 0, 1), (2, 1, 0, 1)], "use one GPU");
        refused(&[(1, 0, 10, 1), (2, 0, 11, 0)], "ranks [1] did not set");
        let many: Vec<_> = (0..17).map(|q| (q as u64, 0, 10 + q as u64, 1)).collect();
        refused(&many, "17 ranks");
        assert!(wanted(1, 2) && wanted(2, 16) && !wanted(1, 17) && !wanted(0, 2) && !wanted(1, 1));
    }

    #[test]
    fn slots_hold_the_largest_call_and_threads_split_lines_alike() {
        assert_eq!(SLOT, SMALL_KERNEL_BYTES * 2);
        assert_eq!(area_bytes(8), 2 * 8 * 16 * 1024);
        assert_eq!(threads_for(1), 32);
        assert_eq!(threads_for(33), 64);
        assert_eq!(threads_for((SMALL_KERNEL_BYTES / 8) as u64), 512);
    }
}
