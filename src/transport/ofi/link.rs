//! [`OfiLink`]: one ordered byte stream to a peer over a libfabric reliable-datagram endpoint.
//!
//! The stream is cut into messages of at most `chunk` bytes, each sent with `fi_tsend` from one
//! of `depth` registered staging slots and tagged with its sequence number. The receiver keeps
//! a receive posted for each of the next `depth` sequence numbers (one staging slot each), so
//! messages land in order whatever order the provider completes them in, and reads the stream
//! out of the slots in sequence (or reduces straight out of them, [`Link::recv_in_place`]).
//!
//! libfabric's providers progress data only when the completion queue is read (manual
//! progress), so a helper thread per link reads it whenever its wait descriptor signals (every
//! millisecond where the provider has none): a send the engine already counted as sent, or a
//! receive the peer's rendezvous needs, completes while the engine is busy elsewhere. When a
//! completion arrives while the engine sleeps on the link, the helper wakes it through an
//! eventfd in the link's poll set. The pair's authenticated TCP connection stays open beside
//! the endpoint, as for shared memory: a dead peer shows up as end-of-file on it (a failure's
//! reason travels on the control channel, [`crate::control`]).

pub use super::endpoint::Endpoint;
use super::sys;
use crate::error::{Error, Result};
use crate::transport::{Interest, Link};
use std::ffi::c_void;
use std::io::{ErrorKind, Read};
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Words of one operation context (libfabric's `struct fi_context2`).
const CTX_WORDS: usize = 8;
/// Sequence numbers travel in the low 32 bits of the tag.
const TAG_MASK: u64 = 0xffff_ffff;

/// The staging memory of a link: `2 * depth` slots of `chunk` bytes, page-aligned, registered
/// once where the provider asks for it (`FI_MR_LOCAL`; the registration closes with the
/// endpoint).
struct Staging {
    base: *mut u8,
    layout: std::alloc::Layout,
    desc: *mut c_void,
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `State::new`; the endpoint whose operations
        // pointed into it is closed before (`State`'s `Drop`).
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

/// Everything the engine and the helper thread share, behind the link's mutex.
struct State {
    /// Closed before the staging memory is freed (its posted receives and registration point
    /// into it), in `Drop`, unless `leak`.
    ep: ManuallyDrop<Endpoint>,
    /// Freed after the endpoint closed, unless `leak`.
    mem: ManuallyDrop<Staging>,
    /// Keep the endpoint and its staging memory until the process exits: set when a failed or
    /// aborted link drops, whose receives are still posted and whose peer may still be sending.
    /// Closing such an rxm endpoint (libfabric 1.17, `tcp;ofi_rxm`) crashed the process now and
    /// then with SIGSEGV inside `fi_close`; a failed link costs its staging memory instead.
    leak: bool,
    /// One operation context per slot: sends `0..depth`, receives `depth..2 * depth`.
    ctx: Box<[[usize; CTX_WORDS]]>,
    chunk: usize,
    depth: usize,
    tx_busy: Vec<bool>,
    in_flight: usize,
    send_seq: u64,
    /// Per receive slot: the length of the message it holds once complete.
    rx_len: Vec<Option<usize>>,
    /// Per receive slot: the sequence number it must be posted for, while not yet posted.
    rx_repost: Vec<Option<u64>>,
    recv_seq: u64,
    rx_off: usize,
    error: Option<String>,
    /// The engine sleeps on this link: the helper must write the eventfd on any completion.
    armed: bool,
}

// SAFETY: the raw pointers are the staging memory and its descriptor, owned by the state and
// used only under the link's mutex.
unsafe impl Send for State {}

impl State {
    fn new(ep: Endpoint, chunk: usize, depth: usize) -> Result<State> {
        let layout = std::alloc::Layout::from_size_align(2 * depth * chunk, 4096)
            .map_err(|e| Error::internal(format!("staging layout: {e}")))?;
        // SAFETY: the layout has a non-zero size (depth, chunk >= 1).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(Error::system(format!("out of memory for {} bytes of ofi staging", layout.size())));
        }
        let mut mem = Staging { base, layout, desc: std::ptr::null_mut() };
        // SAFETY: a valid endpoint.
        if unsafe { sys::oxccl_ofi_mr_local(ep.0) } != 0 {
            // SAFETY: the region is ours and valid for its length; the registration closes with
            // the endpoint, before the memory is freed (`State`'s `Drop`).
            let rc = unsafe { sys::oxccl_ofi_mr_reg(ep.0, base.cast(), layout.size(), &mut mem.desc) };
            if rc != 0 {
                return Err(Error::system(format!("libfabric fi_mr_reg of the staging memory: {}", sys::strerror(rc))));
            }
        }
        let mut s = State {
            ep: ManuallyDrop::new(ep),
            mem: ManuallyDrop::new(mem),
            ctx: vec![[0usize; CTX_WORDS]; 2 * depth].into_boxed_slice(),
            chunk,
            depth,
            tx_busy: vec![false; depth],
            in_flight: 0,
            send_seq: 0,
            rx_len: vec![None; depth],
            rx_repost: (0..depth as u64).map(Some).collect(),
            recv_seq: 0,
            rx_off: 0,
            error: None,
            armed: false,
            leak: false,
        };
        s.repost()?;
        Ok(s)
    }

    fn slot(&self, i: usize) -> *mut u8 {
        // SAFETY: `i < 2 * depth`, so the slot lies inside the staging allocation.
        unsafe { self.mem.base.add(i * self.chunk) }
    }

    fn ctx_ptr(&mut self, i: usize) -> *mut c_void {
        self.ctx[i].as_mut_ptr().cast()
    }

    /// Posts the receives that are due; a provider that is out of room gets them later.
    fn repost(&mut self) -> Result<()> {
        for j in 0..self.depth {
            let Some(seq) = self.rx_repost[j] else { continue };
            let (buf, ctx) = (self.slot(self.depth + j), self.ctx_ptr(self.depth + j));
            // SAFETY: the slot and its context stay valid until the completion is read or the
            // endpoint is closed (both owned by this state, the endpoint dropped first).
            let rc =
                unsafe { sys::oxccl_ofi_trecv(self.ep.0, buf.cast(), self.chunk, self.mem.desc, seq & TAG_MASK, ctx) };
            match rc {
                0 => self.rx_repost[j] = None,
                sys::EAGAIN => return Ok(()),
                rc => return Err(self.fail(format!("posting a receive failed: {}", sys::strerror(rc)))),
            }
        }
        Ok(())
    }

    fn fail(&mut self, why: String) -> Error {
        self.error.get_or_insert(why.clone());
        Error::remote(why)
    }

    /// Reads the completion queue (which also makes the provider progress); returns whether
    /// anything completed.
    fn progress(&mut self) -> Result<bool> {
        if let Some(e) = &self.error {
            return Err(Error::remote(e.clone()));
        }
        let mut any = false;
        loop {
            let mut ctx = [std::ptr::null_mut::<c_void>(); 16];
            let mut len = [0usize; 16];
            let mut recv = [0i32; 16];
            let mut err = [0u8; 512];
            // SAFETY: the arrays hold 16 entries each; `err` is writable for its length.
            let n = unsafe {
                sys::oxccl_ofi_poll(
                    self.ep.0,
                    ctx.as_mut_ptr(),
                    len.as_mut_ptr(),
                    recv.as_mut_ptr(),
                    16,
                    err.as_mut_ptr().cast(),
                    err.len(),
                )
            };
            if n < 0 {
                return Err(self.fail(sys::text(&err)));
            }
            let base = self.ctx.as_ptr() as usize;
            for k in 0..n as usize {
                let i = (ctx[k] as usize - base) / std::mem::size_of::<[usize; CTX_WORDS]>();
                if i < self.depth {
                    self.tx_busy[i] = false;
                    self.in_flight -= 1;
                } else if len[k] == 0 {
                    // Never sent (a send takes at least one byte); reading on would not advance.
                    return Err(self.fail("the peer sent an empty message (not an oxccl stream?)".into()));
                } else {
                    self.rx_len[i - self.depth] = Some(len[k]);
                }
            }
            any |= n > 0;
            if n < 16 {
                break;
            }
        }
        if self.rx_repost.iter().any(Option::is_some) {
            self.repost()?;
        }
        Ok(any)
    }

    /// The unread bytes of the message with sequence number `seq`, if it has arrived.
    fn ready(&self, seq: u64, from: usize) -> Option<&[u8]> {
        let j = (seq % self.depth as u64) as usize;
        let len = self.rx_len[j]?;
        // SAFETY: the slot holds `len <= chunk` bytes the provider completed; nothing writes
        // it until it is reposted, which happens only after its bytes are consumed.
        Some(unsafe { std::slice::from_raw_parts(self.slot(self.depth + j).add(from), len - from) })
    }

    /// Consumes `n` bytes of the stream (at most what [`State::ready`] offers in order).
    fn consume(&mut self, mut n: usize) {
        while n > 0 {
            let j = (self.recv_seq % self.depth as u64) as usize;
            let len = self.rx_len[j].expect("consumed bytes were ready");
            let k = n.min(len - self.rx_off);
            self.rx_off += k;
            n -= k;
            if self.rx_off == len {
                self.rx_len[j] = None;
                self.rx_repost[j] = Some(self.recv_seq + self.depth as u64);
                self.recv_seq += 1;
                self.rx_off = 0;
            }
        }
    }

    fn readable(&self) -> bool {
        self.ready(self.recv_seq, self.rx_off).is_some()
    }

    /// Copies up to one message's worth of `bufs` into a free send slot and posts it.
    fn send(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        if self.in_flight == self.depth {
            self.progress()?;
        }
        let Some(i) = self.tx_busy.iter().position(|b| !b) else { return Ok(0) };
        let dst = self.slot(i);
        let mut n = 0;
        for b in bufs {
            let k = b.len().min(self.chunk - n);
            // SAFETY: `dst` is send slot `i` (free: no send in flight from it), `chunk` bytes
            // long, and `n + k <= chunk`.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst.add(n), k) };
            n += k;
            if n == self.chunk {
                break;
            }
        }
        let ctx = self.ctx_ptr(i);
        // SAFETY: the slot holds `n` bytes and, with its context, stays untouched until the
        // send's completion is read (tx_busy) or the endpoint is closed.
        let rc =
            unsafe { sys::oxccl_ofi_tsend(self.ep.0, dst.cast(), n, self.mem.desc, self.send_seq & TAG_MASK, ctx) };
        match rc {
            0 => {
                self.tx_busy[i] = true;
                self.in_flight += 1;
                self.send_seq += 1;
                Ok(n)
            }
            sys::EAGAIN => {
                self.progress()?;
                Ok(0)
            }
            rc => Err(self.fail(format!("posting a send failed: {}", sys::strerror(rc)))),
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        if self.leak {
            return;
        }
        // SAFETY: each dropped once, here: the endpoint first, so nothing the provider holds
        // points into the staging memory when it is freed.
        unsafe {
            ManuallyDrop::drop(&mut self.ep);
            ManuallyDrop::drop(&mut self.mem);
        }
    }
}

/// What the link and its helper thread share.
struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
    /// Written by the helper to wake the engine (in the link's poll set).
    wake: RawFd,
    /// Written by the link to stop the helper.
    stop_fd: RawFd,
    /// The provider's wait descriptor for the completion queue, or -1.
    wait_fd: RawFd,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }
}

fn eventfd() -> Result<RawFd> {
    // SAFETY: eventfd has no memory preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::from_io("eventfd", std::io::Error::last_os_error()));
    }
    Ok(fd)
}

fn signal(fd: RawFd) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn drain_fd(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a valid u64 from a nonblocking eventfd we own.
    let _ = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// The helper: reads completions whenever the provider signals (or every millisecond), and
/// wakes an engine that sleeps on the link. When the provider's descriptor stays ready but
/// nothing completes (its socket holds bytes for receives not yet posted, because the engine
/// has not read the earlier ones), it looks again after a millisecond instead of spinning.
fn helper(sh: Arc<Shared>) {
    let mut woken = false;
    while !sh.stop.load(Ordering::Acquire) {
        let (got, sleep) = {
            let mut st = sh.lock();
            let got = st.progress();
            let failed = got.is_err();
            if (failed || matches!(got, Ok(true))) && st.armed {
                st.armed = false;
                signal(sh.wake);
            }
            // SAFETY: a valid endpoint, used under the lock.
            (got, sh.wait_fd >= 0 && !failed && unsafe { sys::oxccl_ofi_trywait(st.ep.0) } == 0)
        };
        let fruitless = woken && matches!(got, Ok(false));
        if matches!(got, Ok(true)) && !sleep {
            woken = false;
            continue;
        }
        let mut fds = [
            libc::pollfd { fd: sh.stop_fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: sh.wait_fd, events: libc::POLLIN, revents: 0 },
        ];
        let (n, ms) = if sleep && !fruitless { (2, 100) } else { (1, 1) };
        // SAFETY: `fds` holds `n` valid pollfds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
        woken = n == 2 && rc > 0 && fds[1].revents != 0;
    }
}

/// A link to one peer through libfabric.
pub struct OfiLink {
    shared: Arc<Shared>,
    helper: Option<std::thread::JoinHandle<()>>,
    sock: TcpStream,
    peer_rank: usize,
    peer_addr: String,
    provider: String,
    down: AtomicBool,
    /// Longest a dropped link waits for its sends to complete.
    linger: Duration,
}

impl OfiLink {
    /// A link over `ep` (its destination inserted), messages of at most `chunk` bytes, `depth`
    /// in flight each way; `sock` is the pair's connection, kept for its end-of-file.
    pub fn new(
        ep: Endpoint,
        chunk: usize,
        depth: usize,
        sock: TcpStream,
        peer_rank: usize,
        linger: Duration,
    ) -> Result<OfiLink> {
        sock.set_nonblocking(true).map_err(|e| Error::from_io("set_nonblocking", e))?;
        let peer_addr = sock.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let provider = ep.provider();
        // SAFETY: a valid endpoint.
        let wait_fd = unsafe { sys::oxccl_ofi_wait_fd(ep.0) };
        let state = State::new(ep, chunk, depth)?;
        let (wake, stop_fd) = (eventfd()?, eventfd()?);
        let shared =
            Arc::new(Shared { state: Mutex::new(state), stop: AtomicBool::new(false), wake, stop_fd, wait_fd });
        let sh = shared.clone();
        let helper = std::thread::Builder::new()
            .name(format!("oxccl-ofi-{peer_rank}"))
            .spawn(move || helper(sh))
            .map_err(|e| Error::from_io("spawning the ofi progress thread", e))?;
        Ok(OfiLink {
            shared,
            helper: Some(helper),
            sock,
            peer_rank,
            peer_addr,
            provider,
            down: AtomicBool::new(false),
            linger,
        })
    }

    fn remote(&self, what: &str) -> Error {
        Error::remote(format!("peer rank {} ({}, OFI {}) {what}", self.peer_rank, self.peer_addr, self.provider))
    }

    fn wrap(&self, e: Error) -> Error {
        self.remote(e.message())
    }

    /// Reads and drops what arrived on the socket (nothing travels on it: it is kept for its
    /// end-of-file); `Ok(false)` once the peer closed it.
    fn drain(&mut self) -> Result<bool> {
        let mut buf = [0u8; 256];
        loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(false),
                Err(e) => return Err(self.remote(&format!("connection failed: {e}"))),
            }
        }
    }

    /// The provider's name.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// Whether the provider gave the completion queue a wait descriptor (else the helper
    /// polls it every millisecond).
    pub fn has_wait_fd(&self) -> bool {
        self.shared.wait_fd >= 0
    }
}

impl Link for OfiLink {
    fn try_send(&mut self, buf: &[u8]) -> Result<usize> {
        self.try_send_vectored(&[buf])
    }

    fn try_send_vectored(&mut self, bufs: &[&[u8]]) -> Result<usize> {
        let r = self.shared.lock().send(bufs);
        r.map_err(|e| self.wrap(e))
    }

    fn try_recv(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.try_recv_vectored(buf, &mut [])
    }

    fn try_recv_vectored(&mut self, a: &mut [u8], b: &mut [u8]) -> Result<usize> {
        let sh = self.shared.clone();
        let mut st = sh.lock();
        if !st.readable() {
            if let Err(e) = st.progress() {
                drop(st);
                return Err(self.wrap(e));
            }
        }
        let mut done = 0;
        for dst in [a, b] {
            let mut off = 0;
            while off < dst.len() {
                let (seq, from) = (st.recv_seq, st.rx_off);
                let Some(src) = st.ready(seq, from) else { break };
                let k = src.len().min(dst.len() - off);
                dst[off..off + k].copy_from_slice(&src[..k]);
                st.consume(k);
                off += k;
            }
            done += off;
            if off < dst.len() {
                break;
            }
        }
        // Give the consumed slots back to the provider now, so the peer's next messages can
        // land while the engine works.
        if let Err(e) = st.repost() {
            drop(st);
            return Err(self.wrap(e));
        }
        Ok(done)
    }

    fn supports_in_place(&self) -> bool {
        true
    }

    fn recv_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8], &[u8]) -> usize) -> Result<Option<usize>> {
        let sh = self.shared.clone();
        let mut st = sh.lock();
        if !st.readable() {
            if let Err(e) = st.progress() {
                drop(st);
                return Err(self.wrap(e));
            }
        }
        let (seq, from) = (st.recv_seq, st.rx_off);
        let Some(a) = st.ready(seq, from) else { return Ok(Some(0)) };
        let a = &a[..a.len().min(max)];
        let b = if a.len() < max { st.ready(seq + 1, 0).map(|b| &b[..b.len().min(max - a.len())]) } else { None };
        let used = f(a, b.unwrap_or(&[]));
        st.consume(used);
        if let Err(e) = st.repost() {
            drop(st);
            return Err(self.wrap(e));
        }
        Ok(Some(used))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.sock.as_raw_fd())
    }

    fn poll_set(&self, interest: Interest, out: &mut Vec<libc::pollfd>) -> bool {
        // End-of-file on the socket, the helper's wake-ups, and, to read, the
        // provider's own descriptor (so arriving data wakes without the helper's hop; a send
        // waits for the helper, since the descriptor may stay ready for unread data).
        out.push(libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        out.push(libc::pollfd { fd: self.shared.wake, events: libc::POLLIN, revents: 0 });
        if interest.read && self.shared.wait_fd >= 0 {
            out.push(libc::pollfd { fd: self.shared.wait_fd, events: libc::POLLIN, revents: 0 });
        }
        true
    }

    fn arm(&mut self, interest: Interest) -> Result<bool> {
        drain_fd(self.shared.wake);
        let alive = self.drain()?;
        let sh = self.shared.clone();
        let mut st = sh.lock();
        if let Err(e) = st.progress() {
            drop(st);
            return Err(self.wrap(e));
        }
        if (interest.read && st.readable()) || (interest.write && st.in_flight < st.depth) {
            return Ok(false);
        }
        if !alive {
            drop(st);
            return Err(self.remote("closed the connection (process exited or failed)"));
        }
        // SAFETY: a valid endpoint, used under the lock.
        if sh.wait_fd >= 0 && unsafe { sys::oxccl_ofi_trywait(st.ep.0) } != 0 {
            return Ok(false);
        }
        st.armed = true;
        Ok(true)
    }

    fn describe(&self) -> String {
        format!("rank {} ({}, OFI {})", self.peer_rank, self.peer_addr, self.provider)
    }

    fn shutdown(&self) {
        self.down.store(true, Ordering::Relaxed);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for OfiLink {
    fn drop(&mut self) {
        // Sends the engine counted as sent may still be in the provider's hands: let them
        // complete (bounded) before the endpoint closes, as a socket's buffer would.
        if !self.down.load(Ordering::Relaxed) {
            let end = Instant::now() + self.linger;
            loop {
                let mut st = self.shared.lock();
                if st.in_flight == 0 || st.progress().is_err() || Instant::now() >= end {
                    break;
                }
                drop(st);
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        self.shared.stop.store(true, Ordering::Release);
        signal(self.shared.stop_fd);
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
        let mut st = self.shared.lock();
        if self.down.load(Ordering::Relaxed) || st.error.is_some() {
            st.leak = true;
            crate::info!(
                "{}: the failed OFI link keeps its endpoint and {} KiB of staging until the process exits",
                self.describe(),
                st.mem.layout.size() >> 10
            );
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: both eventfds are ours and closed once, after the helper stopped.
        unsafe {
            libc::close(self.wake);
            libc::close(self.stop_fd);
        }
    }
}

#[cfg(test)]
#[path = "link_tests.rs"]
mod tests;
