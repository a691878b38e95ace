//! A user buffer shared between the ranks of one host for the direct all-reduce: how its
//! owner describes it ([`BufCard`]: the allocation's IPC handle, or a VMM card of `vmm.rs` for
//! `cuMemCreate` memory) and how a peer maps it ([`open_handle`]). The window executor's host
//! exchange (`window.rs`) and the direct flow's opener (`direct.rs`) both use them.

use super::check;
use crate::error::Result;
use cudarc::driver::sys;

/// Peer allocations kept mapped per communicator before unused ones are closed.
pub(crate) const IMPORT_CAP: usize = 64;

/// One buffer as a rank describes it to its peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BufCard {
    /// The buffer's address in its owner's process.
    pub(super) addr: u64,
    /// The base of its allocation.
    pub(super) base: u64,
    /// The allocation's IPC handle.
    pub(super) handle: [u8; 64],
}

impl BufCard {
    /// Describes the `len` bytes at `addr` (context current): by IPC handle, or by a VMM card
    /// ([`super::vmm`]) for `cuMemCreate` memory; `None` when neither can share it (a WARN line).
    pub(super) fn of(addr: u64, len: u64) -> Option<BufCard> {
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: the driver only looks the address up.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        let found = r == sys::CUresult::CUDA_SUCCESS && size > 0;
        // SAFETY: `base` is the base of a device allocation; writes the handle.
        if !found || unsafe { sys::cuIpcGetMemHandle(&mut h, base) } != sys::CUresult::CUDA_SUCCESS {
            return super::vmm::export(addr, len).map(|(base, handle)| BufCard { addr, base, handle });
        }
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Some(BufCard { addr, base, handle })
    }

    /// Writes the card into the first 80 bytes of `out` (address, base, handle).
    pub(super) fn write(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.base.to_le_bytes());
        out[16..80].copy_from_slice(&self.handle);
    }

    /// Reads a card [`BufCard::write`] wrote.
    pub(super) fn read(b: &[u8]) -> BufCard {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[16..80]);
        BufCard { addr: word(0), base: word(8), handle }
    }
}

/// Opens a peer's allocation from its IPC handle (the GPU's context current): its base here.
pub(super) fn open_handle(handle: &[u8; 64]) -> Result<u64> {
    if let Some(r) = super::vmm::open(handle) {
        return r;
    }
    let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
    let mut base: sys::CUdeviceptr = 0;
    let lazy = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: the handle came from a peer's cuIpcGetMemHandle; writes the mapping.
    check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, lazy) }, "cuIpcOpenMemHandle")?;
    Ok(base)
}
