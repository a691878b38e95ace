//! Sharing memory of stream-ordered pools (`cuMemAllocAsync` / `cudaMallocAsync`,
//! `cuMemAllocFromPoolAsync`) between processes, beside [`super::vmm`]'s `cuMemCreate` memory.
//!
//! **Export** ([`export`]). A buffer whose `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` names a pool
//! lies in one pool allocation (`cuMemGetAddressRange`: its base and size). The pool is exported
//! once per process with `cuMemPoolExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_
//! DESCRIPTOR)` and kept as a record of the VMM exporter (never evicted); the allocation is
//! exported with `cuMemPoolExportPointer` (64 bytes of data, not a handle) as another record,
//! keyed by that data: the same allocation gives the same record, so a repeated buffer has the
//! same card and the peers' caches hit, while an allocation freed and made again has other
//! export data (on the driver, which says nothing of it, at worst the same record: the pool's
//! memory at that place). The card (magic, exporter pid, the pointer's token, the secret nonce,
//! the pool's token) travels in the IPC handle's slot of the direct flow's exchange; the
//! descriptor and the export data travel over the VMM exporter's socket (`SCM_RIGHTS`).
//!
//! **Import** ([`open`]): per process, each exporter's pool is imported once
//! (`cuMemPoolImportFromShareableHandle`, then `cuMemPoolSetAccess` read-write for the current
//! GPU unless `cuMemPoolGetAccess` says it has that already) and kept for the life of the process (an imported pool
//! holds nothing until pointers are imported from it); each allocation (its export data) is
//! imported once (`cuMemPoolImportPointer`) and counted, so every opener of the process (the
//! direct flow's, the window's, several communicators') shares one import. [`close`] drops a
//! count; the last frees the import with `cuMemFree` (the stream that used it has drained).
//! The driver asks importers to free an import before its exporter frees the allocation; a
//! collective library cannot order that against the application's frees, so an import lives
//! until its entry leaves the openers' caches (eviction, the communicator's end) or until this
//! process imports another allocation of the pool that overlaps it in the exporter (the old one
//! was freed there): the stale import is freed first (its holders' later closes only count).
//!
//! A pool record is keyed by the pool's handle: a pool destroyed and another created at the same
//! handle value while the process still exports would be taken for the old one (its peers'
//! pointer imports then fail with an error naming the import).
//!
//! **What cannot be shared**: a pool created without the POSIX descriptor handle type (the
//! device's default pool, which `cudaMallocAsync` and torch's `backend:cudaMallocAsync` use, is
//! one) and a buffer that spans two pool allocations: one WARN line per reason and process
//! naming why and the fix; the buffer is then staged through the IPC regions.

use super::fdpass::{self, CardWords, Refusal};
use super::{check, driver_has};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The first bytes of a pool card.
const MAGIC: [u8; 8] = *b"oxccl-mp";

/// A pool buffer's card, as the direct flow's exchange carries it in place of an IPC handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Card {
    /// Exporter's process id.
    pub pid: u32,
    /// The pointer's export record.
    pub token: u64,
    /// The exporter's secret (names its socket).
    pub nonce: u64,
    /// The pool's export record.
    pub pool: u64,
}

impl Card {
    /// The 64 bytes of the card ([`CardWords`]: 0 in the u32, the pool's record in the u64).
    pub(crate) fn bytes(&self) -> [u8; 64] {
        CardWords { pid: self.pid, word: 0, token: self.token, nonce: self.nonce, wide: self.pool }.encode(&MAGIC)
    }

    /// The card in `b`, when `b` is one.
    pub(crate) fn parse(b: &[u8; 64]) -> Option<Card> {
        let w = CardWords::decode(&MAGIC, b).filter(|w| w.word == 0)?;
        Some(Card { pid: w.pid, token: w.token, nonce: w.nonce, pool: w.wide })
    }
}

/// A shared buffer (its allocation's base and card), or why it cannot be shared.
pub(super) type Exported = std::result::Result<(u64, [u8; 64]), (Refusal, String)>;

/// The pool `addr` was allocated from, if any.
fn pool_of(addr: u64) -> Option<u64> {
    static HAS: OnceLock<bool> = OnceLock::new();
    if !*HAS.get_or_init(|| driver_has(c"cuMemPoolExportPointer")) {
        return None;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
    // SAFETY: writes one pool handle for this attribute.
    let r = unsafe { sys::cuPointerGetAttribute((&mut pool as *mut sys::CUmemoryPool).cast(), attr, addr) };
    (r == sys::CUresult::CUDA_SUCCESS && !pool.is_null()).then_some(pool as u64)
}

/// Exports the pool memory under `[addr, addr + len)` (context current): `None` when it is no
/// pool memory, else the base of its allocation and the card, or why it cannot be shared.
pub(super) fn export(addr: u64, len: u64) -> Option<Exported> {
    let pool = pool_of(addr)?;
    Some(export_in(pool, addr, len))
}

fn export_in(pool: u64, addr: u64, len: u64) -> Exported {
    if !driver_has(c"cuMemPoolExportToShareableHandle") || !driver_has(c"cuMemPoolImportPointer") {
        return Err((Refusal::PoolOther, "the CUDA driver lacks cuMemPoolExportToShareableHandle".into()));
    }
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: the driver only looks the address up.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
    if r != sys::CUresult::CUDA_SUCCESS || addr + len > base + size as u64 {
        return Err((Refusal::PoolOther, format!("[{addr:#x}, +{len}) is not within one pool allocation ({r:?})")));
    }
    let (pool_token, nonce) = fdpass::pool_record(pool, || {
        let mut fd: std::ffi::c_int = -1;
        let t = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: `pool` is the live pool of `addr`; writes an int (the descriptor) for this type.
        let r = unsafe {
            sys::cuMemPoolExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                pool as sys::CUmemoryPool,
                t,
                0,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
            return Err((Refusal::PoolNotExportable, format!("cuMemPoolExportToShareableHandle: {r:?}")));
        }
        // SAFETY: a descriptor the driver just opened for us, owned from here on.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    })?;
    let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
    // SAFETY: `base` starts a live allocation of an exported pool; writes 64 bytes.
    let r = unsafe { sys::cuMemPoolExportPointer(&mut data, base) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err((Refusal::PoolNotExportable, format!("cuMemPoolExportPointer: {r:?}")));
    }
    let token = fdpass::pointer_record(base, size as u64, data.reserved)?;
    Ok((base, Card { pid: std::process::id(), token, nonce, pool: pool_token }.bytes()))
}

/// An exporter's pool record, as an importer names it: (pid, nonce, token).
type PoolKey = (u32, u64, u64);
/// An exported allocation, as an importer names it: (pid, nonce, export data).
type PtrKey = (u32, u64, [u8; 64]);

/// A live import of a pool allocation.
struct Imported {
    /// Its address here.
    addr: u64,
    pool: PoolKey,
    /// The allocation in its exporter: [base, base + size).
    base: u64,
    size: u64,
}

/// What this process imported.
#[derive(Default)]
struct Imports {
    /// Imported pools, kept for the process's life.
    pools: HashMap<PoolKey, u64>,
    /// Live imported allocations.
    ptrs: HashMap<PtrKey, Imported>,
    /// Address here -> (openers holding it, the live import there). An import freed because
    /// its exporter's allocation is gone keeps its holders here until they close it.
    at: HashMap<u64, (u32, Option<PtrKey>)>,
}

fn imports() -> MutexGuard<'static, Imports> {
    static I: OnceLock<Mutex<Imports>> = OnceLock::new();
    crate::sync::lock(I.get_or_init(Default::default))
}

/// Imports the allocation a pool card `handle` names (context current): `None` when `handle`
/// is no pool card, else its address here (of the exporter's allocation base).
pub(super) fn open(handle: &[u8; 64]) -> Option<Result<u64>> {
    let c = Card::parse(handle)?;
    Some(
        open_card(&c)
            .map_err(|e| Error::new(e.kind(), format!("importing process {}'s pool buffer: {}", c.pid, e.message()))),
    )
}

fn open_card(c: &Card) -> Result<u64> {
    let (base, size, data) = fdpass::fetch_pointer(c.pid, c.nonce, c.token)?;
    // Held across the exporter's answer (bounded by its wait): one import per allocation.
    let mut im = imports();
    let key = (c.pid, c.nonce, data);
    if let Some(i) = im.ptrs.get(&key) {
        let addr = i.addr;
        im.at.entry(addr).or_insert((0, None)).0 += 1;
        return Ok(addr);
    }
    let pool_key = (c.pid, c.nonce, c.pool);
    let pool = match im.pools.get(&pool_key) {
        Some(&p) => p,
        None => {
            let fd = fdpass::fetch_pool(c.pid, c.nonce, c.pool)?;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            let t = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            // SAFETY: the descriptor is open in this process (the driver takes its own
            // reference); writes the pool handle.
            let r = unsafe {
                sys::cuMemPoolImportFromShareableHandle(
                    &mut pool,
                    fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                    t,
                    0,
                )
            };
            check(r, "cuMemPoolImportFromShareableHandle")?;
            grant_access(pool)?;
            im.pools.insert(pool_key, pool as u64);
            pool as u64
        }
    };
    // Imports of allocations of this pool that overlapped this one in the exporter were freed
    // there (its memory is this allocation's now): the driver wants them freed here first. No
    // queued work reads them: the exporter's application freed them after its calls completed,
    // which the direct flow ends only once every peer has read its buffers.
    let stale: Vec<PtrKey> = im
        .ptrs
        .iter()
        .filter(|(_, i)| i.pool == pool_key && i.base < base + size.max(1) && base < i.base + i.size.max(1))
        .map(|(k, _)| *k)
        .collect();
    for k in stale {
        let Some(i) = im.ptrs.remove(&k) else { continue };
        free_import(i.addr);
        if let Some(h) = im.at.get_mut(&i.addr) {
            h.1 = None;
            if h.0 == 0 {
                im.at.remove(&i.addr);
            }
        }
    }
    let mut data = sys::CUmemPoolPtrExportData { reserved: data };
    let mut addr: sys::CUdeviceptr = 0;
    // SAFETY: `pool` is the imported pool the data comes from; writes the address.
    check(
        unsafe { sys::cuMemPoolImportPointer(&mut addr, pool as sys::CUmemoryPool, &mut data) },
        "cuMemPoolImportPointer",
    )?;
    im.ptrs.insert(key, Imported { addr, pool: pool_key, base, size });
    let h = im.at.entry(addr).or_insert((0, None));
    h.0 += 1;
    h.1 = Some(key);
    Ok(addr)
}

/// Lets the current context's device read and write the imported `pool` (the pool's own
/// device has access; a peer process on another GPU needs it granted).
fn grant_access(pool: sys::CUmemoryPool) -> Result<()> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes the current context's device.
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    let mut location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
    let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: reads the location, writes the flags.
    let r = unsafe { sys::cuMemPoolGetAccess(&mut flags, pool, &mut location) };
    if r == sys::CUresult::CUDA_SUCCESS && flags == rw {
        return Ok(());
    }
    let desc = sys::CUmemAccessDesc { location, flags: rw };
    // SAFETY: reads one descriptor.
    check(unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }, "cuMemPoolSetAccess")
}

/// Frees the import at `addr`.
fn free_import(addr: u64) {
    // SAFETY: imported by `open_card` and freed once (its entry removed by the caller); no
    // queued work uses it.
    let r = unsafe { sys::cuMemFree_v2(addr) };
    if r != sys::CUresult::CUDA_SUCCESS {
        crate::warn!("freeing an imported pool buffer at {addr:#x}: cuMemFree failed: {r:?}");
    }
}

/// Drops one opener's hold of an import at `base` (no queued work of it uses it; context
/// current), freeing it with the last; false when `base` is no pool import.
pub(super) fn close(base: u64) -> bool {
    let mut im = imports();
    let Some(h) = im.at.get_mut(&base) else { return false };
    h.0 = h.0.saturating_sub(1);
    if h.0 > 0 {
        return true;
    }
    let live = h.1;
    im.at.remove(&base);
    if let Some(k) = live {
        im.ptrs.remove(&k);
        free_import(base);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_cards_round_trip_and_are_neither_vmm_cards_nor_ipc_handles() {
        let c = Card { pid: 4242, token: 9, nonce: 0x0123_4567_89ab_cdef, pool: 3 };
        assert_eq!(Card::parse(&c.bytes()), Some(c));
        // The bytes on the wire, laid out by hand (bytes 12..16 stay 0: a pool card's mark).
        let mut want = [0u8; 64];
        want[..8].copy_from_slice(b"oxccl-mp");
        want[8..12].copy_from_slice(&4242u32.to_le_bytes());
        want[16..24].copy_from_slice(&9u64.to_le_bytes());
        want[24..32].copy_from_slice(&0x0123_4567_89ab_cdefu64.to_le_bytes());
        want[32..40].copy_from_slice(&3u64.to_le_bytes());
        assert_eq!(c.bytes(), want);
        let mut word = want;
        word[12] = 1;
        assert_eq!(Card::parse(&word), None);
        let vmm = super::super::vmm::Card { pid: 4242, pieces: 1, token: 9, nonce: 1, span: 2 << 20 }.bytes();
        assert_eq!(Card::parse(&vmm), None);
        assert_eq!(super::super::vmm::Card::parse(&c.bytes()), None);
        let mut tail = c.bytes();
        tail[40] = 1;
        assert_eq!(Card::parse(&tail), None);
    }
}
