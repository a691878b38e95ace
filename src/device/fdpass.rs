//! Passing file descriptors between the processes of one host, for [`super::vmm`] (the
//! physical allocations of `cuMemCreate` memory) and [`super::pool`] (stream-ordered pools and
//! their allocations).
//!
//! The process's exports are records with a token. A descriptor means nothing in another
//! process; it travels over a Unix socket with `SCM_RIGHTS`. Each exporting process listens on
//! one abstract socket named by its pid and a secret nonce (a listener thread started with the
//! first export); an importer connects, sends the token and the nonce, and receives the
//! record's pieces (offsets and sizes) with their descriptors in one message, or a pool
//! pointer's export data without descriptors. The listener serves only peers of the same uid
//! (`SO_PEERCRED`) that know the nonce. `pidfd_getfd(2)` would spare the socket but needs
//! ptrace rights over the exporter (Yama's `ptrace_scope=1`, the default of common
//! distributions, refuses them between sibling rank processes, and container seccomp profiles
//! often block the call), so NCCL's way, a socket, is used. Abstract sockets belong to a
//! network namespace: ranks in different namespaces are different hosts here anyway. At most
//! [`EXPORT_CAP`] records are kept; the least recently used is dropped (a pool's record never:
//! its pointers' records name it).
//!
//! Why a buffer cannot be shared is said here too ([`refuse`]), once per reason and process.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Export records kept per process: more than the two buffers of each round that the direct
/// flow's ring lets a rank run ahead of its peers' opener threads (`direct::RING`).
pub(crate) const EXPORT_CAP: usize = 192;
/// The first word of an answer that carries a pool pointer's export data (no descriptors).
const DATA_MARK: u64 = u64::MAX;
/// How long an importer waits for the exporter's answer.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// One physical allocation of an export record.
pub(super) struct Piece {
    /// Offset from the record's base.
    pub(super) off: u64,
    pub(super) size: u64,
    /// Retained with `cuMemRetainAllocationHandle` (released when the record goes).
    pub(super) handle: u64,
    pub(super) fd: OwnedFd,
}

/// What an export record shares.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    /// VMM memory: the pieces' retained handles and descriptors.
    Vmm,
    /// A stream-ordered pool (its `CUmemoryPool`): one piece, its descriptor (no handle).
    /// Never evicted: its pointers' records name it.
    Pool(u64),
    /// A pointer of a pool: its `cuMemPoolExportPointer` data and its allocation's size (no
    /// pieces).
    Ptr([u8; 64], u64),
}

/// An exported buffer span.
pub(super) struct Record {
    pub(super) base: u64,
    pub(super) pieces: Vec<Piece>,
    pub(super) last: u64,
    pub(super) body: Body,
}

impl Drop for Record {
    fn drop(&mut self) {
        if self.body != Body::Vmm {
            return;
        }
        for p in &self.pieces {
            // SAFETY: retained in `export`, released once here.
            unsafe { sys::cuMemRelease(p.handle) };
        }
    }
}

/// The process's exports.
pub(super) struct Exporter {
    pub(super) nonce: u64,
    pub(super) records: HashMap<u64, Record>,
    pub(super) next: u64,
    pub(super) clock: u64,
    pub(super) listening: bool,
}

pub(super) fn exporter() -> MutexGuard<'static, Exporter> {
    static E: OnceLock<Mutex<Exporter>> = OnceLock::new();
    crate::sync::lock(E.get_or_init(|| {
        let mut b = [0u8; 8];
        // A fixed nonce only weakens the secret; the uid check still holds.
        let _ = crate::net::random_bytes(&mut b);
        Mutex::new(Exporter {
            nonce: u64::from_le_bytes(b),
            records: HashMap::new(),
            next: 1,
            clock: 0,
            listening: false,
        })
    }))
}

/// The abstract socket name of process `pid` with `nonce`.
fn socket_name(pid: u32, nonce: u64) -> String {
    format!("oxccl-vmm.{pid}.{nonce:016x}")
}

/// The words of a card, the 64 bytes that name an export in the direct flow's exchange (the
/// slot an IPC handle takes there), one layout for [`super::vmm::Card`] and
/// [`super::pool::Card`]: a magic naming the kind (8 bytes), the exporter's pid and a u32 of
/// the kind's, the record's token, the exporter's nonce and a u64 of the kind's, all
/// little-endian, then zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CardWords {
    /// Exporter's process id.
    pub pid: u32,
    /// The kind's u32 (VMM: the pieces; pool: 0).
    pub word: u32,
    /// The export record.
    pub token: u64,
    /// The exporter's secret (names its socket).
    pub nonce: u64,
    /// The kind's u64 (VMM: the span; pool: the pool's record).
    pub wide: u64,
}

impl CardWords {
    /// The 64 bytes of the card of kind `magic`.
    pub(super) fn encode(&self, magic: &[u8; 8]) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(magic);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.word.to_le_bytes());
        b[16..24].copy_from_slice(&self.token.to_le_bytes());
        b[24..32].copy_from_slice(&self.nonce.to_le_bytes());
        b[32..40].copy_from_slice(&self.wide.to_le_bytes());
        b
    }

    /// The words of `b`, when it is a card of kind `magic` (not an IPC handle or another kind).
    pub(super) fn decode(magic: &[u8; 8], b: &[u8; 64]) -> Option<CardWords> {
        if b[..8] != *magic || b[40..].iter().any(|&x| x != 0) {
            return None;
        }
        let w32 = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let w64 = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(CardWords { pid: w32(8), word: w32(12), token: w64(16), nonce: w64(24), wide: w64(32) })
    }
}

/// Why a buffer could not be shared (each said once per process).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    NoEntryPoints,
    NotVmm,
    NotExportable,
    Scattered,
    Listener,
    /// Memory of a stream-ordered pool created without an exportable handle type.
    PoolNotExportable,
    /// A pool's export entry points are missing, or one buffer spans two pool allocations.
    PoolOther,
}

/// Says once per process and reason why VMM or pool memory takes the staged flow.
pub(super) fn refuse(why: Refusal, detail: &str) {
    static SAID: [AtomicBool; 7] = [const { AtomicBool::new(false) }; 7];
    let (i, text) = match why {
        Refusal::NoEntryPoints => (0, "the CUDA driver lacks the virtual memory entry points"),
        Refusal::NotVmm => (1, "its memory is neither a cuMemAlloc, a cuMemCreate nor a stream-ordered pool allocation (managed memory, or host memory)"),
        Refusal::NotExportable => (2, "its cuMemCreate allocation cannot be exported as a POSIX file descriptor (created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)"),
        Refusal::Scattered => (3, "it spans physical allocations that are not mapped side by side, or too many of them"),
        Refusal::Listener => (4, "the socket that passes file descriptors could not be opened"),
        Refusal::PoolNotExportable => (5, "its stream-ordered pool cannot be exported (cudaMallocAsync's default pool, or a pool created without an export handle type); allocate it from a pool created with handleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (cuMemPoolCreate / cudaMemPoolCreate, then cuMemAllocFromPoolAsync / cudaMallocFromPoolAsync) to share it"),
        Refusal::PoolOther => (6, "its stream-ordered pool memory cannot be shared"),
    };
    if !SAID[i].swap(true, Ordering::Relaxed) {
        crate::warn!("device all_reduce: a buffer cannot be shared with the peer processes: {text} ({detail}); such a buffer is copied through the IPC regions (the staged flow) instead of being read where it lies");
    }
}

impl Exporter {
    /// Adds `rec` (the listener started, the least recently used record dropped when
    /// [`EXPORT_CAP`] are kept; pools are never dropped): its token.
    pub(super) fn insert(&mut self, rec: Record) -> std::result::Result<u64, (Refusal, String)> {
        if !self.listening {
            start_listener(self.nonce).map_err(|e| (Refusal::Listener, e.message().to_string()))?;
            self.listening = true;
        }
        if self.records.len() >= EXPORT_CAP {
            let evictable = self.records.iter().filter(|(_, r)| !matches!(r.body, Body::Pool(_)));
            if let Some(old) = evictable.min_by_key(|(_, r)| r.last).map(|(&t, _)| t) {
                self.records.remove(&old);
            }
        }
        let token = self.next;
        self.next += 1;
        self.records.insert(token, rec);
        Ok(token)
    }
}

/// The token of pool `pool`'s record (its descriptor from `export_fd` the first time) and the
/// process's nonce.
pub(super) fn pool_record(
    pool: u64,
    export_fd: impl FnOnce() -> std::result::Result<OwnedFd, (Refusal, String)>,
) -> std::result::Result<(u64, u64), (Refusal, String)> {
    let mut ex = exporter();
    ex.clock += 1;
    let nonce = ex.nonce;
    if let Some((&token, _)) = ex.records.iter().find(|(_, r)| r.body == Body::Pool(pool)) {
        return Ok((token, nonce));
    }
    let fd = export_fd()?;
    let piece = Piece { off: 0, size: 0, handle: 0, fd };
    let rec = Record { base: 0, pieces: vec![piece], last: u64::MAX, body: Body::Pool(pool) };
    Ok((ex.insert(rec)?, nonce))
}

/// The token of the record of the pool allocation `[base, base + size)` with export data
/// `data`: the same data gives the same record; a record of another allocation at the same base
/// (freed since) is dropped.
pub(super) fn pointer_record(base: u64, size: u64, data: [u8; 64]) -> std::result::Result<u64, (Refusal, String)> {
    let mut ex = exporter();
    ex.clock += 1;
    let clock = ex.clock;
    if let Some((&token, r)) = ex.records.iter_mut().find(|(_, r)| r.base == base && r.body == Body::Ptr(data, size)) {
        r.last = clock;
        return Ok(token);
    }
    ex.records.retain(|_, r| !(r.base == base && matches!(r.body, Body::Ptr(..))));
    ex.insert(Record { base, pieces: Vec::new(), last: clock, body: Body::Ptr(data, size) })
}

/// Starts the thread that answers importers on this process's socket.
fn start_listener(nonce: u64) -> Result<()> {
    let name = socket_name(std::process::id(), nonce);
    let addr =
        SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| Error::from_io("abstract socket name", e))?;
    let l = UnixListener::bind_addr(&addr).map_err(|e| Error::from_io("bind the VMM descriptor socket", e))?;
    std::thread::Builder::new()
        .name("oxccl-vmm".into())
        .spawn(move || {
            for s in l.incoming().flatten() {
                if let Err(e) = answer(s, nonce) {
                    crate::warn!("VMM descriptor socket: {}", e.message());
                }
            }
        })
        .map_err(|e| Error::from_io("spawn the VMM descriptor thread", e))?;
    Ok(())
}

/// The uid of the process at the other end of `s`.
fn peer_uid(s: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: writes at most `len` bytes into `cred`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

/// Answers one importer: the pieces of the record it names, with their descriptors.
fn answer(mut s: UnixStream, nonce: u64) -> Result<()> {
    let io = |e| Error::from_io("VMM descriptor socket", e);
    s.set_read_timeout(Some(ANSWER_WAIT)).map_err(io)?;
    s.set_write_timeout(Some(ANSWER_WAIT)).map_err(io)?;
    let mut req = [0u8; 16];
    s.read_exact(&mut req).map_err(io)?;
    let token = u64::from_le_bytes(req[..8].try_into().expect("8 bytes"));
    // SAFETY: getuid cannot fail.
    let me = unsafe { libc::getuid() };
    if u64::from_le_bytes(req[8..].try_into().expect("8 bytes")) != nonce || peer_uid(&s) != Some(me) {
        return Err(Error::invalid_usage("a request with a wrong secret or from another user, refused"));
    }
    let ex = exporter();
    let Some(rec) = ex.records.get(&token) else {
        drop(ex);
        return s.write_all(&[0u8; 8]).map_err(io);
    };
    if let Body::Ptr(data, size) = rec.body {
        let mut msg = [0u8; 88];
        msg[..8].copy_from_slice(&DATA_MARK.to_le_bytes());
        msg[8..16].copy_from_slice(&rec.base.to_le_bytes());
        msg[16..24].copy_from_slice(&size.to_le_bytes());
        msg[24..].copy_from_slice(&data);
        drop(ex);
        return s.write_all(&msg).map_err(io);
    }
    let mut msg = Vec::with_capacity(8 + 16 * rec.pieces.len());
    msg.extend_from_slice(&(rec.pieces.len() as u64).to_le_bytes());
    for p in &rec.pieces {
        msg.extend_from_slice(&p.off.to_le_bytes());
        msg.extend_from_slice(&p.size.to_le_bytes());
    }
    let fds: Vec<RawFd> = rec.pieces.iter().map(|p| p.fd.as_raw_fd()).collect();
    // Sent under the lock: no eviction closes a descriptor while it is being sent.
    send_with_fds(&s, &msg, &fds)
}

/// Sends `data` with `fds` attached (`SCM_RIGHTS`), all of `data` before returning.
fn send_with_fds(s: &UnixStream, data: &[u8], fds: &[RawFd]) -> Result<()> {
    let bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let mut ctl = vec![0u8; unsafe { libc::CMSG_SPACE(bytes) } as usize];
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut _, iov_len: data.len() };
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the sendmsg call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.as_mut_ptr().cast();
    m.msg_controllen = ctl.len() as _;
    // SAFETY: `ctl` holds CMSG_SPACE(bytes): room for one header and the descriptors.
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&m);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(bytes) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(c), bytes as usize);
        libc::sendmsg(s.as_raw_fd(), &m, libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(Error::from_io("sendmsg(SCM_RIGHTS)", std::io::Error::last_os_error()));
    }
    (&*s).write_all(&data[n as usize..]).map_err(|e| Error::from_io("VMM descriptor socket", e))
}

/// Receives up to `buf.len()` bytes and the descriptors attached to them.
fn recv_with_fds(s: &UnixStream, buf: &mut [u8], max_fds: usize) -> Result<(usize, Vec<OwnedFd>)> {
    let bytes = (max_fds * std::mem::size_of::<RawFd>()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let mut ctl = vec![0u8; unsafe { libc::CMSG_SPACE(bytes) } as usize];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: a zeroed msghdr is valid; the pointers set below outlive the recvmsg call.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = &mut iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.as_mut_ptr().cast();
    m.msg_controllen = ctl.len() as _;
    // SAFETY: writes into `buf` and `ctl` within their lengths.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut m, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::from_io("recvmsg(SCM_RIGHTS)", std::io::Error::last_os_error()));
    }
    let mut fds = Vec::new();
    // SAFETY: walks the control messages the kernel wrote into `ctl`; each SCM_RIGHTS payload
    // is an array of descriptors now open in this process (owned from here on).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let k = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..k {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&m, c);
        }
    }
    if m.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::internal("recvmsg: descriptors truncated"));
    }
    Ok((n as usize, fds))
}

/// Connects to process `pid`'s socket and asks for record `token`.
fn ask(pid: u32, nonce: u64, token: u64) -> Result<UnixStream> {
    let io = |e| Error::from_io("VMM descriptor socket", e);
    let name = socket_name(pid, nonce);
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io)?;
    let mut s = UnixStream::connect_addr(&addr).map_err(io)?;
    s.set_read_timeout(Some(ANSWER_WAIT)).map_err(io)?;
    let mut req = [0u8; 16];
    req[..8].copy_from_slice(&token.to_le_bytes());
    req[8..].copy_from_slice(&nonce.to_le_bytes());
    s.write_all(&req).map_err(io)?;
    Ok(s)
}

/// The descriptor of process `pid`'s pool record `token`.
pub(super) fn fetch_pool(pid: u32, nonce: u64, token: u64) -> Result<OwnedFd> {
    let mut v = fetch(pid, nonce, token, 1)?;
    Ok(v.pop().expect("one piece").2)
}

/// Process `pid`'s pool pointer record `token`: the allocation's base and size there, and its
/// export data.
pub(super) fn fetch_pointer(pid: u32, nonce: u64, token: u64) -> Result<(u64, u64, [u8; 64])> {
    let mut s = ask(pid, nonce, token)?;
    let mut head = [0u8; 8];
    s.read_exact(&mut head).map_err(|e| Error::from_io("VMM descriptor socket", e))?;
    match u64::from_le_bytes(head) {
        DATA_MARK => {}
        0 => {
            return Err(Error::internal(format!(
                "process {pid} no longer exports that buffer (more than {EXPORT_CAP} buffers exported since)"
            )))
        }
        _ => return Err(Error::internal("the exporter answered with pieces, not a pool pointer")),
    }
    let mut msg = [0u8; 80];
    s.read_exact(&mut msg).map_err(|e| Error::from_io("VMM descriptor socket", e))?;
    let word = |i: usize| u64::from_le_bytes(msg[i..i + 8].try_into().expect("8 bytes"));
    let mut data = [0u8; 64];
    data.copy_from_slice(&msg[16..]);
    Ok((word(0), word(8), data))
}

/// Asks process `pid` for the `want` pieces of its record `token`: [(offset, size,
/// descriptor)].
pub(super) fn fetch(pid: u32, nonce: u64, token: u64, want: usize) -> Result<Vec<(u64, u64, OwnedFd)>> {
    let io = |e| Error::from_io("VMM descriptor socket", e);
    let mut s = ask(pid, nonce, token)?;
    let mut msg = vec![0u8; 8 + 16 * want];
    let (mut got, fds) = recv_with_fds(&s, &mut msg, want)?;
    if got >= 8 && msg[..8] == [0u8; 8] {
        return Err(Error::internal(format!(
            "process {} no longer exports that buffer (more than {EXPORT_CAP} buffers exported since)",
            pid
        )));
    }
    while got < msg.len() {
        let k = s.read(&mut msg[got..]).map_err(io)?;
        if k == 0 {
            return Err(Error::internal("the VMM descriptor socket closed mid-answer"));
        }
        got += k;
    }
    if u64::from_le_bytes(msg[..8].try_into().expect("8 bytes")) != want as u64 || fds.len() != want {
        return Err(Error::internal(format!("the exporter sent {} descriptors, the card names {want}", fds.len())));
    }
    let word = |i: usize| u64::from_le_bytes(msg[i..i + 8].try_into().expect("8 bytes"));
    Ok(fds.into_iter().enumerate().map(|(i, fd)| (word(8 + 16 * i), word(16 + 16 * i), fd)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_cross_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let len = f.metadata().unwrap().len();
        send_with_fds(&a, b"hello", &[f.as_raw_fd()]).unwrap();
        let mut buf = [0u8; 5];
        let (n, fds) = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert_eq!((n, &buf), (5, b"hello"));
        assert_eq!(fds.len(), 1);
        assert_ne!(fds[0].as_raw_fd(), f.as_raw_fd());
        assert_eq!(std::fs::File::from(fds.into_iter().next().unwrap()).metadata().unwrap().len(), len);
    }
}
