//! Sharing device memory between processes: `cuIpcGetMemHandle` for `cuMemAlloc` memory, and
//! POSIX file descriptors for virtual-memory allocations (`cuMemCreate`, which torch's
//! `expandable_segments` and other VMM allocators use, and which `cuIpcGetMemHandle` refuses).
//!
//! **Export** ([`export`]). A buffer `[addr, addr + len)` in VMM memory may span several
//! physical allocations mapped side by side (torch maps one per segment page). The exporter
//! walks them with `cuMemGetAddressRange` (one mapping each), keeps each one alive with
//! `cuMemRetainAllocationHandle` and exports it with `cuMemExportToShareableHandle(
//! CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`. The pieces, their descriptors and retained handles
//! form a record with a token; the buffer's 64-byte card (the slot an IPC handle takes in the
//! direct flow's exchange) carries a magic, the exporter's pid, a secret nonce, the token and
//! the span. The same pieces (same bases, sizes and handles) give the same record, so a repeated
//! buffer has the same card and the peers' mapping caches hit. At most
//! [`fdpass::EXPORT_CAP`] records are kept; the least recently used is dropped (its descriptors
//! closed and handles released: peers that mapped it keep their own references). The
//! descriptors travel over the exporter's Unix socket ([`super::fdpass`]).
//!
//! **Import** ([`open`]): `cuMemAddressReserve` of the span, for each piece
//! `cuMemImportFromShareableHandle` + `cuMemMap` at its offset (then `cuMemRelease`: the
//! mapping holds the memory), one `cuMemSetAccess` (read-write for the current device).
//! [`close`] unmaps the span and frees the reservation.
//!
//! **Pool memory** (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`) is recognised first (its
//! `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`) and shared by [`super::pool`] through the same records
//! and socket.
//!
//! **What cannot be shared** (an allocation made without the POSIX descriptor handle type, in a
//! pool or by `cuMemCreate`; pieces that are not contiguous; memory that is none of these, such
//! as managed memory; a driver without these entry points) gives one WARN line per reason and
//! process naming why; the buffer is then staged through the IPC regions.

use super::fdpass::{self, exporter, refuse, Body, CardWords, Piece, Record, Refusal};
use super::{check, cu_err};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Physical allocations one buffer may span.
pub(crate) const MAX_PIECES: usize = 64;
/// The first bytes of a VMM card.
const MAGIC: [u8; 8] = *b"oxccl-vm";

/// A buffer's VMM card, as the direct flow's exchange carries it in place of an IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Card {
    /// Exporter's process id.
    pub pid: u32,
    /// Physical allocations in the span.
    pub pieces: u32,
    /// The export record.
    pub token: u64,
    /// The exporter's secret (names its socket).
    pub nonce: u64,
    /// Bytes from the first piece's base to the last piece's end.
    pub span: u64,
}

impl Card {
    /// The 64 bytes of the card ([`CardWords`]: the pieces in the u32, the span in the u64).
    pub(crate) fn bytes(&self) -> [u8; 64] {
        let (pid, token, nonce) = (self.pid, self.token, self.nonce);
        CardWords { pid, word: self.pieces, token, nonce, wide: self.span }.encode(&MAGIC)
    }

    /// The card in `b`, when `b` is one (not an IPC handle).
    pub(crate) fn parse(b: &[u8; 64]) -> Option<Card> {
        let w = CardWords::decode(&MAGIC, b)?;
        Some(Card { pid: w.pid, pieces: w.word, token: w.token, nonce: w.nonce, span: w.wide })
    }
}

/// The allocation mapped at `at` (base, size).
fn range(at: u64) -> Option<(u64, u64)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the driver only looks the address up.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, at) };
    (r == sys::CUresult::CUDA_SUCCESS && size > 0).then_some((base, size as u64))
}

/// Releases retained handles (a failed export).
fn release(handles: &[u64]) {
    for &h in handles {
        // SAFETY: each was retained by `retain_pieces` and is released once.
        unsafe { sys::cuMemRelease(h) };
    }
}

/// A buffer's physical allocations: (base of the first, [(offset, size, retained handle)]).
type Pieces = (u64, Vec<(u64, u64, u64)>);

/// The pieces under `[addr, addr + len)`.
fn retain_pieces(addr: u64, len: u64) -> std::result::Result<Pieces, (Refusal, String)> {
    let Some((b0, _)) = range(addr) else {
        return Err((Refusal::NotVmm, format!("cuMemGetAddressRange({addr:#x}) failed")));
    };
    let end = addr + len.max(1);
    let (mut at, mut pieces) = (b0, Vec::new());
    while at < end {
        let found = range(at).filter(|&(b, _)| b == at);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `at` is a mapped address; writes the handle (retained: released by the caller).
        let r = found.map(|_| unsafe { sys::cuMemRetainAllocationHandle(&mut h, at as *mut std::ffi::c_void) });
        match (found, r) {
            (Some((_, size)), Some(sys::CUresult::CUDA_SUCCESS)) if pieces.len() < MAX_PIECES => {
                pieces.push((at - b0, size, h));
                at += size;
            }
            (Some(_), Some(sys::CUresult::CUDA_SUCCESS)) => {
                release(&[h]);
                release(&pieces.iter().map(|p| p.2).collect::<Vec<_>>());
                return Err((Refusal::Scattered, format!("more than {MAX_PIECES} allocations")));
            }
            (_, r) => {
                release(&pieces.iter().map(|p| p.2).collect::<Vec<_>>());
                let why = if pieces.is_empty() { Refusal::NotVmm } else { Refusal::Scattered };
                return Err((why, format!("cuMemRetainAllocationHandle({at:#x}): {r:?}")));
            }
        }
    }
    Ok((b0, pieces))
}

/// Exports the VMM memory under `[addr, addr + len)` (context current): the base of its first
/// allocation and the card, or `None` (one WARN line per reason) when it cannot be shared.
pub(crate) fn export(addr: u64, len: u64) -> Option<(u64, [u8; 64])> {
    if let Some(r) = super::pool::export(addr, len) {
        return r.map_err(|(why, detail)| refuse(why, &detail)).ok();
    }
    if !super::driver_has(c"cuMemExportToShareableHandle") || !super::driver_has(c"cuMemRetainAllocationHandle") {
        refuse(Refusal::NoEntryPoints, "cuMemExportToShareableHandle");
        return None;
    }
    match export_pieces(addr, len) {
        Ok(v) => Some(v),
        Err((why, detail)) => {
            refuse(why, &detail);
            None
        }
    }
}

fn export_pieces(addr: u64, len: u64) -> std::result::Result<(u64, [u8; 64]), (Refusal, String)> {
    let (base, pieces) = retain_pieces(addr, len)?;
    let span = pieces.last().map_or(0, |p| p.0 + p.1);
    let mut ex = exporter();
    ex.clock += 1;
    let (clock, nonce) = (ex.clock, ex.nonce);
    let same = |r: &Record| {
        r.body == Body::Vmm
            && r.base == base
            && r.pieces.len() == pieces.len()
            && r.pieces.iter().zip(&pieces).all(|(a, b)| (a.off, a.size, a.handle) == *b)
    };
    if let Some((&token, r)) = ex.records.iter_mut().find(|(_, r)| same(r)) {
        r.last = clock;
        drop(ex);
        release(&pieces.iter().map(|p| p.2).collect::<Vec<_>>());
        return Ok((base, card(token, nonce, pieces.len(), span)));
    }
    let mut rec = Record { base, pieces: Vec::with_capacity(pieces.len()), last: clock, body: Body::Vmm };
    for &(off, size, handle) in &pieces {
        let mut fd: std::ffi::c_int = -1;
        let t = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: `handle` is retained; writes an int (the descriptor) for this handle type.
        let r = unsafe { sys::cuMemExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), handle, t, 0) };
        if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            // The record releases what it holds; the rest is released here.
            release(&pieces[rec.pieces.len()..].iter().map(|p| p.2).collect::<Vec<_>>());
            return Err((Refusal::NotExportable, format!("cuMemExportToShareableHandle: {r:?}")));
        }
        // SAFETY: a descriptor the driver just opened for us, owned from here on.
        rec.pieces.push(Piece { off, size, handle, fd: unsafe { OwnedFd::from_raw_fd(fd) } });
    }
    let token = ex.insert(rec)?;
    Ok((base, card(token, nonce, pieces.len(), span)))
}

fn card(token: u64, nonce: u64, pieces: usize, span: u64) -> [u8; 64] {
    Card { pid: std::process::id(), pieces: pieces as u32, token, nonce, span }.bytes()
}

/// Spans this process mapped with [`open`]: base -> bytes.
fn mapped() -> MutexGuard<'static, HashMap<u64, u64>> {
    static M: OnceLock<Mutex<HashMap<u64, u64>>> = OnceLock::new();
    crate::sync::lock(M.get_or_init(Default::default))
}

/// Maps the memory a card `handle` names (context current): `None` when `handle` is no VMM
/// card (an IPC handle), else the base of the mapped span (at the exporter's first piece base).
pub(crate) fn open(handle: &[u8; 64]) -> Option<Result<u64>> {
    let Some(c) = Card::parse(handle) else { return super::pool::open(handle) };
    Some(
        open_card(&c)
            .map_err(|e| Error::new(e.kind(), format!("mapping process {}'s VMM buffer: {}", c.pid, e.message()))),
    )
}

fn open_card(c: &Card) -> Result<u64> {
    let pieces = fdpass::fetch(c.pid, c.nonce, c.token, c.pieces as usize)?;
    let span = c.span as usize;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes the current context's device.
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: reserves address space; writes its base.
    check(unsafe { sys::cuMemAddressReserve(&mut va, span, 0, 0, 0) }, "cuMemAddressReserve")?;
    let mut done = 0usize;
    let r = map_pieces(va, &pieces, &mut done).and_then(|()| {
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: [va, va + span) is mapped; reads one descriptor.
        check(unsafe { sys::cuMemSetAccess(va, span, &desc, 1) }, "cuMemSetAccess")
    });
    if let Err(e) = r {
        for &(off, size, _) in &pieces[..done] {
            // SAFETY: mapped by `map_pieces`; nothing uses it yet.
            unsafe { sys::cuMemUnmap(va + off, size as usize) };
        }
        // SAFETY: reserved above, unmapped now.
        unsafe { sys::cuMemAddressFree(va, span) };
        return Err(e);
    }
    mapped().insert(va, c.span);
    Ok(va)
}

/// Imports and maps each piece at `va` + its offset; `done` counts those mapped.
fn map_pieces(va: u64, pieces: &[(u64, u64, OwnedFd)], done: &mut usize) -> Result<()> {
    let t = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    for (off, size, fd) in pieces {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the descriptor is open in this process (the driver takes its own reference);
        // writes the handle.
        let r =
            unsafe { sys::cuMemImportFromShareableHandle(&mut h, fd.as_raw_fd() as isize as *mut std::ffi::c_void, t) };
        check(r, "cuMemImportFromShareableHandle")?;
        // SAFETY: [va + off, + size) lies in the reservation; `h` is a live handle.
        let r = unsafe { sys::cuMemMap(va + off, *size as usize, 0, h, 0) };
        // SAFETY: the mapping (if made) holds the memory; the handle is released once.
        unsafe { sys::cuMemRelease(h) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(cu_err(r, "cuMemMap"));
        }
        *done += 1;
    }
    Ok(())
}

/// Unmaps a span [`open`] mapped at `base` (no queued work uses it); false when `base` is no
/// such span (an IPC mapping).
pub(crate) fn close(base: u64) -> bool {
    let Some(span) = mapped().remove(&base) else { return super::pool::close(base) };
    // SAFETY: mapped by `open_card`; the caller's stream no longer uses it.
    unsafe {
        sys::cuMemUnmap(base, span as usize);
        sys::cuMemAddressFree(base, span as usize);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_round_trip_and_ipc_handles_are_not_cards() {
        let c = Card { pid: 4242, pieces: 3, token: 7, nonce: 0xdead_beef_0123_4567, span: 6 << 21 };
        assert_eq!(Card::parse(&c.bytes()), Some(c));
        // The bytes on the wire, laid out by hand.
        let mut want = [0u8; 64];
        want[..8].copy_from_slice(b"oxccl-vm");
        want[8..12].copy_from_slice(&4242u32.to_le_bytes());
        want[12..16].copy_from_slice(&3u32.to_le_bytes());
        want[16..24].copy_from_slice(&7u64.to_le_bytes());
        want[24..32].copy_from_slice(&0xdead_beef_0123_4567u64.to_le_bytes());
        want[32..40].copy_from_slice(&(6u64 << 21).to_le_bytes());
        assert_eq!(c.bytes(), want);
        let mut ipc = [0u8; 64];
        ipc[..4].copy_from_slice(&0x4950_4331u32.to_le_bytes());
        assert_eq!(Card::parse(&ipc), None);
        let mut tail = c.bytes();
        tail[63] = 1;
        assert_eq!(Card::parse(&tail), None);
    }
}
