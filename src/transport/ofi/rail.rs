//! [`Rail`]: one libfabric endpoint of a NIC (fabric, domain, completion queue, address
//! vector, endpoint), shared by every ofi link of the process that goes through that NIC
//! (reliable datagrams are connectionless: a peer is an address-vector entry). A link holds a
//! list of rails (one today); the rail holds each link's receive state (`peer::Peer`) under one
//! mutex and runs the one progress thread of the endpoint.
//!
//! Strangers. Any process that can reach the endpoint's address can send it tagged messages
//! (the provider's listener is not authenticated). So each link's tags carry a random prefix
//! its receiver chose and sent over the authenticated handshake ([`tag`]), receives name the
//! peer's address where the provider grants `FI_DIRECTED_RECV`, and 16 "drain" receives that
//! match any tag from anyone sit behind every link's receives: a message that matches no
//! link's receive lands in a 16 KiB scratch buffer and is discarded (counted), so the
//! provider's unexpected-message queue, which would hold it in memory for good, stays empty.
//! Matching goes by posting order, so after a link posts a receive the drains are withdrawn
//! (`fi_cancel`) and posted again behind it; and a sender sends only within the window of
//! receives its peer has posted (credits over the pair's TCP connection, [`super::link()`]), so
//! no message of a link can reach a drain. A drained message that carries a link's prefix
//! (outside its window) fails that link as unexpected traffic.

use super::endpoint::Endpoint;
use super::peer::LinkRx;
use super::sys;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Sequence numbers travel in the low 32 bits of a tag; the receiver's prefix above them.
pub const SEQ_MASK: u64 = 0xffff_ffff;
/// Prefixes are 31 bits (rxm over tcp leaves the top tag bit to itself).
pub const PREFIX_MASK: u64 = 0x7fff_ffff;

/// The tag of message `seq` of a link whose receiver chose `prefix`.
pub fn tag(prefix: u64, seq: u64) -> u64 {
    ((prefix & PREFIX_MASK) << 32) | (seq & SEQ_MASK)
}

/// A fresh random prefix (never 0, the prefix a stranger would try first).
pub fn new_prefix() -> Result<u64> {
    let mut b = [0u8; 8];
    crate::net::random_bytes(&mut b)?;
    Ok((u64::from_le_bytes(b) & PREFIX_MASK).max(1))
}

/// One operation's context: libfabric's `fi_context2` first, then whose operation it is.
#[repr(C)]
pub struct Ctx {
    fi: [usize; 8],
    /// The link's id in its rail (0: a drain receive).
    pub link: u64,
    /// The slot of the operation in its owner.
    pub slot: usize,
}

impl Ctx {
    /// Contexts for `n` slots of `link`.
    pub fn slots(link: u64, n: usize) -> Box<[Ctx]> {
        (0..n).map(|slot| Ctx { fi: [0; 8], link, slot }).collect()
    }
}

const DRAIN_SLOTS: usize = 48;
const DRAIN_POSTED: usize = 16;
const DRAIN_BYTES: usize = 16 << 10;

#[derive(Clone, Copy, PartialEq)]
enum Slot {
    Free,
    Posted,
    /// Withdrawn; its completion (cancelled, or a message it matched first) is still due.
    Cancelled,
}

/// The drain receives: scratch memory that unexpected messages are read into and dropped.
struct Drain {
    mem: Vec<u8>,
    ctx: Box<[Ctx]>,
    slots: [Slot; DRAIN_SLOTS],
    discarded: u64,
}

/// What the rail's mutex guards.
pub struct State {
    ep: std::mem::ManuallyDrop<Endpoint>,
    /// Every link's receive state, by id (ids from 1); links that closed while operations
    /// were still in the provider's hands stay until those complete.
    pub peers: HashMap<u64, LinkRx>,
    next_id: u64,
    drain: Drain,
    addrs: HashMap<Vec<u8>, u64>,
}

// SAFETY: the endpoint and the links' staging are used only under the rail's mutex.
unsafe impl Send for State {}

impl State {
    /// The raw endpoint, for posting (under this state's lock).
    pub fn ep(&self) -> *mut sys::Ep {
        self.ep.0
    }

    /// Moves the drain receives behind every receive posted so far (matching goes by posting
    /// order): withdraws the posted ones and posts fresh ones.
    pub fn requeue_drains(&mut self) -> Result<()> {
        for i in 0..DRAIN_SLOTS {
            if self.drain.slots[i] == Slot::Posted {
                let ctx: *mut Ctx = &mut self.drain.ctx[i];
                // SAFETY: a valid endpoint; the context is the posted receive's.
                unsafe { sys::oxccl_ofi_cancel(self.ep.0, ctx.cast()) };
                self.drain.slots[i] = Slot::Cancelled;
            }
        }
        self.post_drains()
    }

    fn post_drains(&mut self) -> Result<()> {
        let mut posted = self.drain.slots.iter().filter(|s| **s == Slot::Posted).count();
        for i in 0..DRAIN_SLOTS {
            if posted >= DRAIN_POSTED {
                break;
            }
            if self.drain.slots[i] != Slot::Free {
                continue;
            }
            let buf = self.drain.mem[i * DRAIN_BYTES..].as_mut_ptr();
            let ctx: *mut Ctx = &mut self.drain.ctx[i];
            // SAFETY: the scratch slot and its context live as long as the endpoint (the
            // drain is dropped after it); any tag (ignore mask all ones), from anyone.
            let rc = unsafe {
                sys::oxccl_ofi_trecv(
                    self.ep.0,
                    buf.cast(),
                    DRAIN_BYTES,
                    std::ptr::null_mut(),
                    sys::ADDR_UNSPEC,
                    0,
                    u64::MAX,
                    ctx.cast(),
                )
            };
            match rc {
                0 => {
                    self.drain.slots[i] = Slot::Posted;
                    posted += 1;
                }
                sys::EAGAIN => break,
                rc => return Err(Error::system(format!("posting a drain receive failed: {}", sys::strerror(rc)))),
            }
        }
        Ok(())
    }

    /// A drain receive completed (`err`: with that error): the message is dropped, or fails
    /// the link whose prefix it carries.
    fn drained(&mut self, slot: usize, tag: Option<u64>, err: i32) {
        self.drain.slots[slot] = Slot::Free;
        if err == sys::ECANCELED {
            return;
        }
        self.drain.discarded += 1;
        let Some(tag) = tag else { return };
        let prefix = (tag >> 32) & PREFIX_MASK;
        if let Some(l) = self.peers.values_mut().find(|l| l.recv_prefix == prefix && !l.closing) {
            l.unexpected(format!("a message outside the receive window (tag {tag:#x})"));
        }
    }

    /// Reads the completion queue (which also makes the provider progress) and hands each
    /// completion to its link; returns the ids of the links that got any.
    pub fn progress(&mut self, woken: &mut Vec<u64>) {
        loop {
            let c = match self.ep.poll() {
                Ok(c) => c,
                Err(e) => {
                    self.failed(e.ctx, e.rc, e.why, woken);
                    continue;
                }
            };
            for k in 0..c.n {
                // SAFETY: every context posted is a `Ctx` of a live owner (a link's state stays
                // until all its operations completed; the drain lives as long as the endpoint).
                let (link, slot) = unsafe { ((*c.ctx[k].cast::<Ctx>()).link, (*c.ctx[k].cast::<Ctx>()).slot) };
                if link == 0 {
                    self.drained(slot, Some(c.tag[k]), 0);
                } else if let Some(l) = self.peers.get_mut(&link) {
                    l.completed(slot, c.len[k], 0, "");
                    woken.push(link);
                }
            }
            // Drains go back at once: a flood must find them posted, not grow the provider's
            // unexpected queue.
            let _ = self.post_drains();
            if c.n < super::endpoint::POLL_MAX {
                break;
            }
        }
    }

    fn failed(&mut self, errctx: *mut c_void, rc: i32, why: String, woken: &mut Vec<u64>) {
        if errctx.is_null() {
            // libfabric 1.17's rxm writes such entries while flushing a broken connection.
            crate::warn!("libfabric: an error completion without a context: {why}");
            return;
        }
        // SAFETY: as in `progress`: a context of a live owner.
        let (link, slot) = unsafe { ((*errctx.cast::<Ctx>()).link, (*errctx.cast::<Ctx>()).slot) };
        if link == 0 {
            self.drained(slot, None, rc);
        } else if let Some(l) = self.peers.get_mut(&link) {
            l.completed(slot, 0, rc, &why);
            woken.push(link);
        }
    }

    /// Frees the links that closed and have nothing left in the provider's hands.
    pub fn reap(&mut self) {
        self.peers.retain(|_, l| !(l.closing && l.idle()));
    }

    /// Staging bytes of links that closed with operations still outstanding.
    pub fn kept_bytes(&self) -> usize {
        self.peers.values().filter(|l| l.closing).map(|l| l.staging_bytes()).sum()
    }

    /// Messages dropped by the drain receives so far.
    pub fn discarded(&self) -> u64 {
        self.drain.discarded
    }

    /// A peer's handle in the address vector, inserting its address the first time (one
    /// entry per address: messages from it carry that handle as their source).
    pub fn insert(&mut self, addr: &[u8]) -> Result<u64> {
        if let Some(&a) = self.addrs.get(addr) {
            return Ok(a);
        }
        let a = self.ep.insert(addr)?;
        self.addrs.insert(addr.to_vec(), a);
        Ok(a)
    }

    /// A new link id.
    pub fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// The part of a rail its progress thread shares.
pub struct Core {
    state: Mutex<State>,
    stop: AtomicBool,
    stop_fd: RawFd,
    /// The provider's wait descriptor for the completion queue, or -1.
    pub wait_fd: RawFd,
}

impl Core {
    /// The rail's state, locked.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }
}

/// One endpoint of a NIC shared by the process's links; closed with the last (or kept for
/// reuse where closing may crash: [`Endpoint::close_unsafe`]).
pub struct Rail {
    /// What its progress thread shares.
    pub core: Arc<Core>,
    helper: Option<std::thread::JoinHandle<()>>,
    /// The provider's name.
    pub provider: String,
    /// This endpoint's address, sent to peers.
    pub addr: Vec<u8>,
    /// Largest message the provider takes.
    pub max_msg: usize,
    /// Whether receives name their source.
    pub directed: bool,
    /// Whether staging must be registered (`FI_MR_LOCAL`).
    pub mr_local: bool,
    key: Key,
}

type Key = (Option<String>, Option<String>);

static RAILS: Mutex<Vec<(Key, Weak<Rail>)>> = Mutex::new(Vec::new());
/// Rails that must never be closed (libfabric 1.17 `tcp;ofi_rxm`), kept for reuse.
static KEPT: Mutex<Vec<Arc<Rail>>> = Mutex::new(Vec::new());

impl Rail {
    /// The process's rail for `provider` bound to `node` (an IP address; `None`: unbound),
    /// opened on first use.
    pub fn get(provider: Option<&str>, node: Option<&str>) -> Result<Arc<Rail>> {
        let key: Key = (provider.map(String::from), node.map(String::from));
        let mut rails = crate::sync::lock(&RAILS);
        rails.retain(|(_, w)| w.strong_count() > 0);
        if let Some(r) = rails.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
            return Ok(r);
        }
        let r = Arc::new(Rail::open(provider, node, key.clone())?);
        rails.push((key, Arc::downgrade(&r)));
        if r.core.lock().ep.close_unsafe() {
            crate::info!(
                "libfabric: the {} endpoint at {} is kept until the process exits and reused (closing one crashes libfabric before 1.18 now and then)",
                r.provider,
                hex(&r.addr)
            );
            crate::sync::lock(&KEPT).push(r.clone());
        }
        Ok(r)
    }

    /// Every rail of the process that is open.
    pub fn all() -> Vec<Arc<Rail>> {
        let rails = crate::sync::lock(&RAILS);
        rails.iter().filter_map(|(_, w)| w.upgrade()).collect()
    }

    fn open(provider: Option<&str>, node: Option<&str>, key: Key) -> Result<Rail> {
        let mut ep = Endpoint::open(provider, node)?;
        let addr = ep.name()?;
        let (prov, max_msg, directed) = (ep.provider(), ep.max_msg(), ep.directed());
        // SAFETY: a valid endpoint.
        let (wait_fd, mr_local) = unsafe { (sys::oxccl_ofi_wait_fd(ep.0), sys::oxccl_ofi_mr_local(ep.0) != 0) };
        let drain = Drain {
            mem: vec![0u8; DRAIN_SLOTS * DRAIN_BYTES],
            ctx: Ctx::slots(0, DRAIN_SLOTS),
            slots: [Slot::Free; DRAIN_SLOTS],
            discarded: 0,
        };
        let mut state = State {
            ep: std::mem::ManuallyDrop::new(ep),
            peers: HashMap::new(),
            next_id: 0,
            drain,
            addrs: HashMap::new(),
        };
        state.post_drains()?;
        let stop_fd = super::link::eventfd()?;
        let core = Arc::new(Core { state: Mutex::new(state), stop: AtomicBool::new(false), stop_fd, wait_fd });
        let c = core.clone();
        let helper = std::thread::Builder::new()
            .name("oxccl-ofi".into())
            .spawn(move || helper(c))
            .map_err(|e| Error::from_io("spawning the ofi progress thread", e))?;
        crate::info!(
            "libfabric: endpoint {prov} at {} ({}; receives {})",
            hex(&addr),
            node.unwrap_or("unbound"),
            if directed { "directed to their peer" } else { "matched by tag alone" }
        );
        Ok(Rail { core, helper: Some(helper), provider: prov, addr, max_msg, directed, mr_local, key })
    }
}

/// Lower-case hex of an address.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Drop for Rail {
    fn drop(&mut self) {
        self.core.stop.store(true, Ordering::Release);
        super::link::signal(self.core.stop_fd);
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
        // The endpoint closes with the core (whose last reference is ours now).
        let mut rails = crate::sync::lock(&RAILS);
        rails.retain(|(k, w)| *k != self.key || w.strong_count() > 0);
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        // SAFETY: the eventfd is ours and closed once, after the helper stopped.
        unsafe { libc::close(self.stop_fd) };
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        // The endpoint closes before any staging or drain memory its operations point into is
        // freed: links still closing are taken out first and dropped after it.
        let peers = std::mem::take(&mut st.peers);
        // SAFETY: dropped once, here; nothing uses the endpoint afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut st.ep) };
        drop(peers);
    }
}

/// The progress thread of a rail: reads completions whenever the provider signals (every
/// millisecond where it has no descriptor) and wakes each link whose engine sleeps on it.
fn helper(core: Arc<Core>) {
    let mut woken = Vec::new();
    let mut signalled = false;
    while !core.stop.load(Ordering::Acquire) {
        let (got, sleep) = {
            let mut st = core.lock();
            woken.clear();
            st.progress(&mut woken);
            for id in &woken {
                if let Some(l) = st.peers.get_mut(id) {
                    l.wake();
                }
            }
            st.reap();
            // SAFETY: a valid endpoint, used under the lock.
            (!woken.is_empty(), core.wait_fd >= 0 && unsafe { sys::oxccl_ofi_trywait(st.ep.0) } == 0)
        };
        let fruitless = signalled && !got;
        if got && !sleep {
            signalled = false;
            continue;
        }
        let mut fds = [
            libc::pollfd { fd: core.stop_fd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: core.wait_fd, events: libc::POLLIN, revents: 0 },
        ];
        // When the descriptor stays ready but nothing completes (the provider's socket holds
        // bytes it cannot place yet), look again after a millisecond instead of spinning.
        let (n, ms) = if sleep && !fruitless { (2, 100) } else { (1, 1) };
        // SAFETY: `fds` holds `n` valid pollfds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
        signalled = n == 2 && rc > 0 && fds[1].revents != 0;
    }
}
