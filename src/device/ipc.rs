//! The CUDA IPC path: all-reduce between the ranks of one node (several may share one GPU),
//! entirely on the GPU and ordered on the user's stream.
//!
//! At set-up every rank allocates one device region, `[flags 4 KiB | input H | result H]`, and
//! exports it with `cuIpcGetMemHandle`; the handles travel through the communicator's host
//! all-reduce, and each rank maps every peer's region once (`cuIpcOpenMemHandle`; a peer in
//! the same process is addressed directly). A call then runs chunks of at most `H` bytes; for
//! chunk sequence number `s`, on the user's stream:
//!
//! 1. copy the chunk of `send` into my input area;
//! 2. barrier 0: write `s` into flag (0, me) of every peer; wait until my flags (0, q) ≥ s;
//! 3. reduce my segment (`partition(chunk, n)[me]`) over every rank's input area straight into
//!    `recv`, then push that segment into every peer's result area;
//! 4. barrier 1, as 2 with phase 1;
//! 5. copy the other ranks' segments from my result area into `recv`.
//!
//! The barriers are stream memory operations (`cuStreamWriteValue32` on the peer's mapped flag,
//! preceded by a memory fence; `cuStreamWaitValue32 GEQ` on mine), so nothing blocks the host.
//! Every access to a peer's memory (reading its input in 3, writing its result in 3, its flags)
//! happens before my barrier-1 write; so once barrier 1 has passed on a rank's stream, no peer
//! touches that rank's region again until the next chunk's barrier 0: the next chunk's copy-in
//! (1) and pushes (3) can never overwrite data a peer still reads.
//!
//! Limitation: if a peer process dies mid-call, this rank's stream waits on its flags forever
//! (as with NCCL without its watchdog); the host side never blocks.

use super::{check, ops, DevCall, Gpu};
use crate::algo::partition;
use crate::error::Result;
use crate::types::ReduceOp;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Bytes of the flag area at the start of a region.
const FLAG_BYTES: usize = 4096;
/// Ranks the flag area has room for (2 phases × 32-bit flag per rank).
pub(crate) const MAX_RANKS: usize = FLAG_BYTES / 8;

/// Byte offset of flag (`phase`, `from`) in a region.
fn flag_off(phase: usize, from: usize) -> u64 {
    ((phase * MAX_RANKS + from) * 4) as u64
}

/// What a rank publishes at set-up (a fixed-size slot of the exchange).
#[derive(Clone, Copy)]
pub(crate) struct Card {
    /// 1 when the region was allocated and exported.
    pub ok: bool,
    /// The process id (peers in the same process use `base` directly).
    pub pid: u32,
    /// The GPU.
    pub ordinal: i32,
    /// Region address in its owner's process.
    pub base: u64,
    /// `cuIpcGetMemHandle` of the region.
    pub handle: [u8; 64],
}

/// Bytes of a serialised [`Card`].
pub(crate) const CARD_BYTES: usize = 96;

impl Card {
    /// Serialises into `out` (`CARD_BYTES` long); byte 0 is never zero so a slot is known filled.
    pub(crate) fn write(&self, out: &mut [u8]) {
        out[0] = 0xC1;
        out[1] = u8::from(self.ok);
        out[4..8].copy_from_slice(&self.pid.to_le_bytes());
        out[8..12].copy_from_slice(&self.ordinal.to_le_bytes());
        out[16..24].copy_from_slice(&self.base.to_le_bytes());
        out[32..96].copy_from_slice(&self.handle);
    }
    /// Parses a slot written by [`Card::write`] (`None` when empty or malformed).
    pub(crate) fn read(b: &[u8]) -> Option<Card> {
        if b.len() < CARD_BYTES || b[0] != 0xC1 {
            return None;
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[32..96]);
        Some(Card {
            ok: b[1] == 1,
            pid: u32::from_le_bytes(b[4..8].try_into().ok()?),
            ordinal: i32::from_le_bytes(b[8..12].try_into().ok()?),
            base: u64::from_le_bytes(b[16..24].try_into().ok()?),
            handle,
        })
    }
}

/// This rank's exported region (before the peers are mapped).
pub(crate) struct Region {
    base: u64,
    half: usize,
    handle: [u8; 64],
}

impl Region {
    /// Allocates and exports a region with `half` bytes each of input and result (context current).
    pub(crate) fn new(half: usize) -> Result<Region> {
        let len = FLAG_BYTES + 2 * half;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes the allocation's address.
        check(unsafe { sys::cuMemAlloc_v2(&mut base, len) }, &format!("cuMemAlloc({len} bytes) for CUDA IPC"))?;
        let r = Region { base, half, handle: [0; 64] };
        // Zero the flags on a private non-blocking stream (no implicit sync with user streams).
        let zero = || -> Result<()> {
            use cudarc::driver::result::stream;
            let s =
                stream::create(stream::StreamKind::NonBlocking).map_err(|e| super::cu_err(e.0, "cuStreamCreate"))?;
            // SAFETY: the flag area is inside the allocation; `s` is destroyed after its work.
            let r = unsafe {
                check(sys::cuMemsetD8Async(base, 0, FLAG_BYTES, s), "cuMemsetD8Async(flags)")
                    .and_then(|()| check(sys::cuStreamSynchronize(s), "cuStreamSynchronize"))
            };
            // SAFETY: created above.
            unsafe { sys::cuStreamDestroy_v2(s) };
            r
        };
        zero()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is a cuMemAlloc allocation.
        check(unsafe { sys::cuIpcGetMemHandle(&mut h, base) }, "cuIpcGetMemHandle")?;
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(Region { handle, ..r })
    }

    /// The card to publish.
    pub(crate) fn card(&self, ordinal: i32) -> Card {
        Card { ok: true, pid: std::process::id(), ordinal, base: self.base, handle: self.handle }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.base != 0 {
            // SAFETY: allocated in `new`; owners make sure no work uses it any more.
            unsafe { sys::cuMemFree_v2(self.base) };
        }
    }
}

/// A peer's region as mapped here.
struct Peer {
    base: u64,
    /// Opened with cuIpcOpenMemHandle (closed on drop); false for self and same-process peers.
    opened: bool,
}

/// One communicator's IPC state.
pub(crate) struct Ipc {
    rank: usize,
    peers: Vec<Peer>,
    region: Region,
    seq: u32,
    /// The last event recorded on each stream used, so teardown can wait for the GPU.
    events: HashMap<usize, sys::CUevent>,
}

// SAFETY: device addresses and event handles, usable from any thread with the context current;
// the state is used under the communicator's device lock.
unsafe impl Send for Ipc {}

impl Ipc {
    /// Maps every peer's region (`cards` indexed by rank). Fails if any handle cannot be opened.
    pub(crate) fn open(rank: usize, region: Region, cards: &[Card]) -> Result<Ipc> {
        let me = std::process::id();
        let mut ipc = Ipc { rank, peers: Vec::with_capacity(cards.len()), region, seq: 0, events: HashMap::new() };
        for (q, c) in cards.iter().enumerate() {
            if q == rank || c.pid == me {
                ipc.peers.push(Peer { base: c.base, opened: false });
                continue;
            }
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, s) in h.reserved.iter_mut().zip(c.handle) {
                *d = s as std::ffi::c_char;
            }
            let mut base: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: the handle came from the peer's cuIpcGetMemHandle; writes the mapping.
            check(
                unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, flags) },
                &format!("cuIpcOpenMemHandle(rank {q})"),
            )?;
            ipc.peers.push(Peer { base, opened: true });
        }
        Ok(ipc)
    }

    fn input(&self, q: usize) -> u64 {
        self.peers[q].base + FLAG_BYTES as u64
    }

    fn result(&self, q: usize) -> u64 {
        self.input(q) + self.region.half as u64
    }

    /// Barrier `phase` for chunk `s`, on `stream`.
    fn barrier(&self, phase: usize, s: u32, stream: sys::CUstream) -> Result<()> {
        let n = self.peers.len();
        let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        for q in (0..n).filter(|&q| q != self.rank) {
            let at = self.peers[q].base + flag_off(phase, self.rank);
            // SAFETY: `at` is a flag word inside peer q's mapped region.
            check(unsafe { sys::cuStreamWriteValue32_v2(stream, at, s, write) }, "cuStreamWriteValue32(peer flag)")?;
        }
        for q in (0..n).filter(|&q| q != self.rank) {
            let at = self.region.base + flag_off(phase, q);
            // SAFETY: `at` is a flag word inside this rank's region.
            check(unsafe { sys::cuStreamWaitValue32_v2(stream, at, s, geq) }, "cuStreamWaitValue32(own flag)")?;
        }
        Ok(())
    }

    /// Enqueues an all-reduce on its stream (context current, n ≥ 2).
    ///
    /// # Safety
    /// The call's buffers must be device addresses of `count` elements on this GPU, valid until
    /// the stream has run the call; equal for in place, otherwise not overlapping.
    pub(crate) unsafe fn all_reduce(&mut self, gpu: &Gpu, call: DevCall) -> Result<()> {
        let DevCall { send, recv, count, dtype, op, stream } = call;
        let n = self.peers.len();
        let es = dtype.size();
        let chunk = (self.region.half / es).max(1);
        let mut first = 0;
        while first < count {
            let c = chunk.min(count - first);
            self.seq = self.seq.wrapping_add(1);
            let (at, bytes) = ((first * es) as u64, c * es);
            // SAFETY (this block): every address is inside `send`/`recv` (per the contract) or
            // inside a mapped region of `half` bytes per area (c * es <= half).
            unsafe {
                ops::copy(self.input(self.rank), send + at, bytes, stream)?;
                self.barrier(0, self.seq, stream)?;
                let (s0, len) = partition(c, n)[self.rank];
                if len > 0 {
                    let off = (s0 * es) as u64;
                    let dst = recv + at + off;
                    let last_div = |q: usize| if op == ReduceOp::Avg && q == n - 1 { n as u32 } else { 1 };
                    ops::reduce(
                        gpu,
                        dst,
                        self.input(0) + off,
                        self.input(1) + off,
                        len as u64,
                        dtype,
                        op,
                        last_div(1),
                        stream,
                    )?;
                    for q in 2..n {
                        ops::reduce(gpu, dst, dst, self.input(q) + off, len as u64, dtype, op, last_div(q), stream)?;
                    }
                    for q in (0..n).filter(|&q| q != self.rank) {
                        ops::copy(self.result(q) + off, dst, len * es, stream)?;
                    }
                }
                self.barrier(1, self.seq, stream)?;
                // Everyone's segments but mine: before and after it.
                let mine = (s0 * es, len * es);
                ops::copy(recv + at, self.result(self.rank), mine.0, stream)?;
                let after = mine.0 + mine.1;
                ops::copy(recv + at + after as u64, self.result(self.rank) + after as u64, bytes - after, stream)?;
            }
            first += c;
        }
        self.track(stream)
    }

    /// Records an event after this call's work on `stream`, for [`Drop`] to wait on.
    fn track(&mut self, stream: sys::CUstream) -> Result<()> {
        let ev = match self.events.get(&(stream as usize)) {
            Some(&e) => e,
            None => {
                let e = cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| super::cu_err(e.0, "cuEventCreate"))?;
                self.events.insert(stream as usize, e);
                e
            }
        };
        // SAFETY: a live event of the current context; `stream` per the caller's contract.
        check(unsafe { sys::cuEventRecord(ev, stream) }, "cuEventRecord")
    }

    /// Waits (bounded) until the GPU has run every call enqueued so far.
    fn drain(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        for &e in self.events.values() {
            // SAFETY: live events created in `track`.
            while unsafe { sys::cuEventQuery(e) } == sys::CUresult::CUDA_ERROR_NOT_READY {
                if start.elapsed() > timeout {
                    return false;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        true
    }
}

impl Drop for Ipc {
    fn drop(&mut self) {
        if !self.drain(crate::config::timeout()) {
            crate::warn!("CUDA IPC: rank {}: GPU work still pending at teardown; leaking the IPC region", self.rank);
            self.region.base = 0; // Region's drop skips a zero base
            return;
        }
        for p in &self.peers {
            if p.opened {
                // SAFETY: mapped by cuIpcOpenMemHandle in `open`; no work uses it (drained).
                unsafe { sys::cuIpcCloseMemHandle(p.base) };
            }
        }
        for &e in self.events.values() {
            // SAFETY: created in `track`, destroyed once.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_round_trip_and_flags_do_not_overlap() {
        let c = Card { ok: true, pid: 1234, ordinal: 3, base: 0xdead_beef_0000, handle: [7; 64] };
        let mut b = [0u8; CARD_BYTES];
        c.write(&mut b);
        let d = Card::read(&b).unwrap();
        assert!(d.ok && d.pid == 1234 && d.ordinal == 3 && d.base == c.base && d.handle == c.handle);
        assert!(Card::read(&[0u8; CARD_BYTES]).is_none());
        assert_eq!(flag_off(1, MAX_RANKS - 1) + 4, FLAG_BYTES as u64);
        assert_eq!(flag_off(1, 0), flag_off(0, MAX_RANKS - 1) + 4);
    }
}
