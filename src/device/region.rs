//! What a rank of the CUDA IPC path publishes and exports: its [`Card`] (process, GPU, region
//! address and `cuIpcGetMemHandle`, flag page), and its [`Region`] (the exported device memory
//! with the flag page); how it maps the peers' ([`PeerRegion`]); and the process checks the
//! watchdog uses (`alive`, PID namespaces).
//! The collective flows that use the mapped regions are in `ipc.rs` (all-reduce) and
//! `oneshot.rs` (the other collectives).

use super::check;
use super::flags::FlagPage;
use super::layout::{page_len, BOARD, SMALL, WORDS};

use crate::error::Result;
use cudarc::driver::sys;
use std::sync::Arc;

/// A random number naming this process (PIDs repeat across PID namespaces).
fn process_token() -> u64 {
    static T: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        use std::hash::BuildHasher;
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        std::collections::hash_map::RandomState::new().hash_one((std::process::id(), t)) | 1
    })
}

/// Inode of this process's PID namespace (0 if unknown): PIDs of peers are only meaningful here
/// when theirs is the same.
pub(crate) fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// False once process `pid` has exited (gone, zombie or dead).
pub(crate) fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(s.rsplit_once(')').and_then(|(_, t)| t.trim_start().chars().next()), Some('Z' | 'X')),
        Err(_) => false,
    }
}

/// What a rank publishes at set-up (a fixed-size slot of the exchange).
#[derive(Clone, Copy)]
pub(crate) struct Card {
    /// 1 when the region was allocated and exported.
    pub ok: bool,
    /// The process id.
    pub pid: u32,
    /// The GPU.
    pub ordinal: i32,
    /// Region address in its owner's process.
    pub base: u64,
    /// `cuIpcGetMemHandle` of the region.
    pub handle: [u8; 64],
    /// Descriptor number of the flag page's memfd in the owner.
    pub flags_fd: i32,
    /// Host and device addresses of the flag page in the owner (for same-process peers).
    pub flags_host: u64,
    /// See `flags_host`.
    pub flags_dev: u64,
    /// The owner's process token (same-process detection).
    pub token: u64,
    /// The owner's PID namespace.
    pub pidns: u64,
    /// The random cookie of the flag page's memfd, checked by a peer before it maps the page.
    pub flags_cookie: [u8; 16],
    /// The GPU's PCI location (domain, bus, device: [`pci_location`]): the physical GPU, where
    /// ordinals differ between processes with different `CUDA_VISIBLE_DEVICES`.
    pub pci: u64,
    /// The rank's `OXCCL_SMALL_KERNEL` (1 or 2) when it asks for the LL flow and its region has
    /// the LL area (`small.rs`); 0 otherwise.
    pub small: u8,
}

/// Bytes of a serialised [`Card`].
pub(crate) const CARD_BYTES: usize = 144;

/// GPU `ordinal`'s PCI location as one number (domain << 32 | bus << 16 | device); 0 when the
/// driver does not say.
pub(crate) fn pci_location(ordinal: i32) -> u64 {
    use sys::CUdevice_attribute as DA;
    let Ok(dev) = cudarc::driver::result::device::get(ordinal) else { return 0 };
    let attr = |a: DA| {
        // SAFETY: a valid device handle; the attribute is an int.
        unsafe { cudarc::driver::result::device::get_attribute(dev, a) }.map_or(0, |v| v.max(0) as u64 & 0xFFFF)
    };
    (attr(DA::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID) << 32)
        | (attr(DA::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID) << 16)
        | attr(DA::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)
}

/// True when an NVIDIA MPS daemon is seen: its default control pipe exists, or a process of
/// this PID namespace is named `nvidia-cuda-mps-*`. (One in another namespace, or a pipe
/// directory moved by `CUDA_MPS_PIPE_DIRECTORY` with the daemon out of sight, is not seen.)
pub(crate) fn mps_seen() -> bool {
    if std::path::Path::new("/tmp/nvidia-mps/control").exists() {
        return true;
    }
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.flatten()
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .any(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with("nvidia-cuda-mps")))
}

impl Card {
    /// A card saying this rank cannot use CUDA IPC.
    pub(crate) fn unusable(ordinal: i32) -> Card {
        Card {
            ok: false,
            pid: std::process::id(),
            ordinal,
            base: 0,
            handle: [0; 64],
            flags_fd: -1,
            flags_host: 0,
            flags_dev: 0,
            token: process_token(),
            pidns: pid_namespace(),
            flags_cookie: [0; 16],
            pci: 0,
            small: 0,
        }
    }

    /// Serialises into `out` (`CARD_BYTES` long); byte 0 is never zero so a slot is known filled.
    pub(crate) fn write(&self, out: &mut [u8]) {
        out[0] = 0xC1;
        out[1] = u8::from(self.ok);
        out[2] = self.small;
        out[4..8].copy_from_slice(&self.pid.to_le_bytes());
        out[8..12].copy_from_slice(&self.ordinal.to_le_bytes());
        out[12..16].copy_from_slice(&self.flags_fd.to_le_bytes());
        out[16..24].copy_from_slice(&self.base.to_le_bytes());
        out[24..32].copy_from_slice(&self.flags_host.to_le_bytes());
        out[32..96].copy_from_slice(&self.handle);
        out[96..104].copy_from_slice(&self.flags_dev.to_le_bytes());
        out[104..112].copy_from_slice(&self.token.to_le_bytes());
        out[112..120].copy_from_slice(&self.pidns.to_le_bytes());
        out[120..136].copy_from_slice(&self.flags_cookie);
        out[136..144].copy_from_slice(&self.pci.to_le_bytes());
    }
    /// Parses a slot written by [`Card::write`] (`None` when empty or malformed).
    pub(crate) fn read(b: &[u8]) -> Option<Card> {
        if b.len() < CARD_BYTES || b[0] != 0xC1 {
            return None;
        }
        let u64_at = |i: usize| b[i..i + 8].try_into().ok().map(u64::from_le_bytes);
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[32..96]);
        let mut flags_cookie = [0u8; 16];
        flags_cookie.copy_from_slice(&b[120..136]);
        Some(Card {
            ok: b[1] == 1,
            pid: u32::from_le_bytes(b[4..8].try_into().ok()?),
            ordinal: i32::from_le_bytes(b[8..12].try_into().ok()?),
            flags_fd: i32::from_le_bytes(b[12..16].try_into().ok()?),
            base: u64_at(16)?,
            flags_host: u64_at(24)?,
            handle,
            flags_dev: u64_at(96)?,
            token: u64_at(104)?,
            pidns: u64_at(112)?,
            flags_cookie,
            pci: u64_at(136)?,
            small: b[2],
        })
    }

    /// True when the card's owner is this process.
    pub(crate) fn same_process(&self) -> bool {
        self.token == process_token()
    }

    /// Whether no two of `cards` come from one process (the same answer on every rank).
    pub(crate) fn all_separate(cards: &[Card]) -> bool {
        cards.iter().enumerate().all(|(q, c)| cards[..q].iter().all(|d| d.token != c.token))
    }

    /// Whether there are several `cards`, all from one process (the same answer on every rank).
    pub(crate) fn all_local(cards: &[Card]) -> bool {
        cards.len() > 1 && cards.iter().all(|c| c.token == cards[0].token)
    }
}

/// This rank's exported region and flag page (before the peers are mapped).
pub(crate) struct Region {
    /// Device address of the region.
    pub(crate) base: u64,
    /// Bytes of each of its two areas.
    pub(crate) half: usize,
    /// Bytes of its LL area (`small.rs`; 0: none), after the board.
    pub(crate) ll: usize,
    /// The `OXCCL_SMALL_KERNEL` level its card publishes (0 without an LL area).
    pub(crate) small: u8,
    handle: [u8; 64],
    /// This rank's flag page.
    pub(crate) flags: Arc<FlagPage>,
}

impl Region {
    /// Allocates and exports a region with `half` bytes each of input and result, then the two
    /// small-message slots and the captured calls' small slot ([`SMALL`] bytes each), then the
    /// board ([`BOARD`] bytes, zeroed), then `ll` bytes of LL slots (zeroed; `small.rs`), and
    /// creates the flag page (context current). The zeroing runs on `stream` (the
    /// communicator's internal stream, non-blocking), waited for: never on the legacy stream,
    /// which would join (and invalidate) a user's capture of a blocking stream when the
    /// communicator's first device call is captured.
    pub(crate) fn new(half: usize, ll: usize, small: u8, stream: sys::CUstream) -> Result<Region> {
        let flags = Arc::new(FlagPage::create(WORDS)?);
        let len = Self::bytes(half) + ll;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes the allocation's address.
        check(unsafe { sys::cuMemAlloc_v2(&mut base, len) }, &format!("cuMemAlloc({len} bytes) for CUDA IPC"))?;
        // From here on, dropping `r` frees the allocation exactly once.
        let mut r = Region { base, half, ll, small: if ll > 0 { small } else { 0 }, handle: [0; 64], flags };
        // SAFETY: the board and the LL slots, the allocation's last BOARD + ll bytes (no work
        // uses them yet), on the caller's stream of the current context. Waited for, or it
        // could land after a publication.
        let at = base + (len - ll - BOARD) as u64;
        check(unsafe { sys::cuMemsetD8Async(at, 0, BOARD + ll, stream) }, "cuMemsetD8Async(board)")?;
        // SAFETY: as above.
        check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize(board zeroed)")?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `base` is a cuMemAlloc allocation.
        check(unsafe { sys::cuIpcGetMemHandle(&mut h, base) }, "cuIpcGetMemHandle")?;
        for (d, s) in r.handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(r)
    }

    /// Bytes of a region with areas of `half` bytes, up to the end of its board (where the LL
    /// area starts).
    pub(crate) fn bytes(half: usize) -> usize {
        2 * half + 3 * SMALL + BOARD
    }

    /// The card to publish.
    pub(crate) fn card(&self, ordinal: i32) -> Card {
        Card {
            ok: true,
            base: self.base,
            handle: self.handle,
            flags_fd: self.flags.fd(),
            flags_host: self.flags.host_addr(),
            flags_dev: self.flags.dev_addr(),
            flags_cookie: self.flags.cookie(),
            pci: pci_location(ordinal),
            small: self.small,
            ..Card::unusable(ordinal)
        }
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

/// A peer's region and flags as mapped here.
pub(super) struct PeerRegion {
    pub(super) base: u64,
    /// Opened with cuIpcOpenMemHandle (closed at teardown); false for self and same-process peers.
    opened: bool,
    pub(super) flags: Arc<FlagPage>,
    /// The peer's PID when its liveness can be checked here (another process, same namespace).
    pub(super) pid: Option<u32>,
}

impl PeerRegion {
    /// Maps every rank's region and flags (`cards` indexed by rank; rank `me`'s is `mine`).
    /// On failure, closes what it opened.
    pub(super) fn map_all(me: usize, mine: &Region, cards: &[Card]) -> Result<Vec<PeerRegion>> {
        let my_ns = pid_namespace();
        let mut peers = Vec::with_capacity(cards.len());
        for (q, c) in cards.iter().enumerate() {
            let p = if q == me {
                Ok(PeerRegion { base: mine.base, opened: false, flags: mine.flags.clone(), pid: None })
            } else {
                PeerRegion::map(q, c, my_ns)
            };
            match p {
                Ok(p) => peers.push(p),
                Err(e) => {
                    PeerRegion::close_all(&mut peers);
                    return Err(e);
                }
            }
        }
        Ok(peers)
    }

    /// Maps rank `q`'s region and flags from its card (`my_ns`: this process's PID namespace).
    fn map(q: usize, c: &Card, my_ns: u64) -> Result<PeerRegion> {
        if c.same_process() {
            let flags = FlagPage::borrowed(c.flags_host, page_len())?;
            return Ok(PeerRegion { base: c.base, opened: false, flags: Arc::new(flags), pid: None });
        }
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(c.handle) {
            *d = s as std::ffi::c_char;
        }
        let flags = Arc::new(FlagPage::open(c.pid, c.flags_fd, page_len(), &c.flags_cookie)?);
        let mut base: sys::CUdeviceptr = 0;
        let lazy = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: the handle came from the peer's cuIpcGetMemHandle; writes the mapping.
        check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, h, lazy) }, &format!("cuIpcOpenMemHandle(rank {q})"))?;
        let pid = (my_ns != 0 && c.pidns == my_ns).then_some(c.pid);
        Ok(PeerRegion { base, opened: true, flags, pid })
    }

    /// Closes the IPC mappings of `peers` (context current, no work using them).
    pub(super) fn close_all(peers: &mut [PeerRegion]) {
        for p in peers.iter_mut().filter(|p| p.opened) {
            // SAFETY: mapped by cuIpcOpenMemHandle in `map`; no work uses it any more.
            unsafe { sys::cuIpcCloseMemHandle(p.base) };
            p.opened = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_round_trip() {
        let c = Card {
            ok: true,
            pid: 1234,
            ordinal: 3,
            base: 0xdead_beef_0000,
            handle: [7; 64],
            flags_fd: 17,
            flags_host: 0x7f00_0000_1000,
            flags_dev: 0x7f00_0000_2000,
            token: 0x1234_5678_9abc_def1,
            pidns: 4026531836,
            flags_cookie: [5; 16],
            pci: 0x0001_0041_0007,
            small: 2,
        };
        let mut b = [0u8; CARD_BYTES];
        c.write(&mut b);
        let d = Card::read(&b).unwrap();
        assert!(d.ok && d.pid == 1234 && d.ordinal == 3 && d.base == c.base && d.handle == c.handle);
        assert!(d.flags_fd == 17 && d.flags_host == c.flags_host && d.flags_dev == c.flags_dev);
        assert!(d.token == c.token && d.pidns == c.pidns && !d.same_process());
        assert_eq!((d.flags_cookie, d.pci, d.small), (c.flags_cookie, c.pci, 2));
        assert!(Card::read(&[0u8; CARD_BYTES]).is_none());
        assert!(alive(std::process::id()) && !alive(u32::MAX - 1));
    }
}
