//! The helper threads of a [`ThreadedTcpLink`](super::ThreadedTcpLink): what they share with the
//! engine, and the sender and receiver loops moving bytes between the rings and the sockets.

use super::super::ring::{Consumer, Producer};
use super::super::tcp::Layout;
use super::CHUNK;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Longest a helper stays parked before it looks again (a safety net; wake-ups are explicit).
const PARK: Duration = Duration::from_millis(100);

/// Data bytes of each ring: 4 MiB shared by the sockets, at least two stripes per socket.
pub(super) fn ring_capacity(nsocks: usize, stripe: usize) -> usize {
    ((4usize << 20) / nsocks).max(2 * stripe).max(64 << 10).next_power_of_two()
}

/// What the engine and the helpers of one link share.
pub(super) struct Shared {
    /// Written by helpers to wake the engine (poll(2)s it).
    pub(super) event: OwnedFd,
    /// The first socket failure, for the engine's error message.
    pub(super) error: Mutex<Option<String>>,
    /// Set when the link is shut down or dropped: helpers exit.
    pub(super) stop: AtomicBool,
    /// The link's sockets (clones), for shutdown.
    pub(super) socks: Vec<TcpStream>,
    /// Sender threads still running (a link whose senders are all gone has nothing to flush).
    pub(super) senders: std::sync::atomic::AtomicUsize,
}

impl Shared {
    /// Wakes the engine (an eventfd counter increment; a full counter already wakes it).
    pub(super) fn notify(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local array to our eventfd.
        let _ = unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Clears pending wake-ups.
    pub(super) fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a local array from our nonblocking eventfd.
        let _ = unsafe { libc::read(self.event.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }

    /// Records a socket failure (the first one is kept) and wakes the engine.
    pub(super) fn fail(&self, text: String) {
        let mut e = crate::sync::lock(&self.error);
        if e.is_none() {
            *e = Some(text);
        }
        drop(e);
        self.notify();
    }

    pub(super) fn error_text(&self) -> Option<String> {
        crate::sync::lock(&self.error).clone()
    }
}

/// One socket as a helper thread sees it: its index, its stream, and its ring end.
pub(super) struct Owned<E> {
    pub(super) index: usize,
    pub(super) sock: TcpStream,
    pub(super) end: E,
    /// Bytes moved on this socket so far.
    pub(super) moved: u64,
    /// False once the socket failed (receivers go on serving their other sockets).
    pub(super) live: bool,
    /// Links with several rails: the socket's failover state ([`super::failover`]).
    pub(super) fo: super::failover::HelperState,
}

/// What a helper thread needs of the stripe rule (shared with [`super::super::tcp::TcpLink`]).
impl Layout {
    /// Among `owned` (live ones only), the one whose current stripe comes first in the stream.
    fn first<E>(&self, owned: &[Owned<E>]) -> Option<usize> {
        (0..owned.len()).filter(|&k| owned[k].live).min_by_key(|&k| self.next(owned[k].index, owned[k].moved).0)
    }
}

/// Whether a blocking call's error only means "try again" (a signal, or a timeout that some
/// other code set on the socket).
pub(super) fn retry(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Parks the calling helper until woken or [`PARK`] passes.
fn park() {
    std::thread::park_timeout(PARK);
}

/// A sender thread: moves bytes from the send rings of its sockets onto them, in stream order.
/// Once the link is shut down it still hands over the bytes the engine counted as sent (as a
/// socket's kernel buffer would), then ends the stream (FIN); a failed socket ends it at once.
pub(super) fn send_loop(mut owned: Vec<Owned<Consumer>>, layout: Layout, shared: Arc<Shared>, peer: String) {
    if send_until_drained(&mut owned, layout, &shared, &peer) {
        for o in &owned {
            let _ = o.sock.shutdown(std::net::Shutdown::Write);
        }
    }
    shared.senders.fetch_sub(1, Ordering::AcqRel);
    shared.notify();
}

/// The body of [`send_loop`]: `true` when it stopped because the link was shut down and every
/// ring was drained, `false` on a socket failure.
fn send_until_drained(owned: &mut [Owned<Consumer>], layout: Layout, shared: &Shared, peer: &str) -> bool {
    while let Some(k) = layout.first(owned) {
        let (_, room) = layout.next(owned[k].index, owned[k].moved);
        let o = &mut owned[k];
        if o.end.readable() == 0 {
            if o.end.closed() || shared.stop.load(Ordering::Acquire) {
                // The engine fills the stripes in stream order, so this thread's other rings,
                // which carry later stripes, are empty too.
                return true;
            }
            if o.end.announce_sleep() == 0 && !o.end.closed() && !shared.stop.load(Ordering::Acquire) {
                park();
            }
            continue;
        }
        let (a, _) = o.end.peek();
        let n = a.len().min(room).min(CHUNK);
        let r = super::super::nosig::send(&o.sock, &a[..n]);
        match r {
            Ok(0) => {
                fail_all(shared, owned, format!("peer {peer} closed the connection (end of stream)"));
                return false;
            }
            Ok(m) => {
                o.end.consume(m);
                o.moved += m as u64;
                if o.end.take_writer_asleep() {
                    shared.notify();
                }
            }
            Err(e) if retry(&e) => {}
            Err(e) => {
                fail_all(shared, owned, format!("peer {peer}: connection failed while sending: {e}"));
                return false;
            }
        }
    }
    true
}

/// A sender failed: records why and closes its rings, so the engine's next send fails.
fn fail_all(shared: &Shared, owned: &[Owned<Consumer>], text: String) {
    if !shared.stop.load(Ordering::Acquire) {
        shared.fail(text);
    }
    for o in owned {
        o.end.close();
    }
    shared.notify();
}

/// A receiver thread: moves bytes from its sockets into their receive rings, in stream order,
/// never past the end of a socket's current stripe.
pub(super) fn recv_loop(mut owned: Vec<Owned<Producer>>, layout: Layout, shared: Arc<Shared>, peer: String) {
    while let Some(k) = layout.first(&owned) {
        let (_, room) = layout.next(owned[k].index, owned[k].moved);
        let o = &mut owned[k];
        if o.end.closed() || shared.stop.load(Ordering::Acquire) {
            return;
        }
        if o.end.writable() == 0 {
            if o.end.announce_sleep() == 0 && !o.end.closed() {
                park();
            }
            continue;
        }
        let buf = o.end.free_slice();
        let n = buf.len().min(room).min(CHUNK);
        let r = (&o.sock).read(&mut buf[..n]);
        match r {
            Ok(m) if m > 0 => received(o, m, &shared),
            Err(e) if retry(&e) => {}
            r => end_of_receiving(o, r, &shared, &peer),
        }
    }
}

/// A receiver's `m` bytes just read into its ring: published, the engine woken if it sleeps.
pub(super) fn received(o: &mut Owned<Producer>, m: usize, shared: &Shared) {
    o.end.publish(m);
    o.moved += m as u64;
    if o.end.take_reader_asleep() {
        shared.notify();
    }
}

/// A receiver's read that ended the stream (`Ok(0)`) or failed for good: what was read stays
/// readable; the link fails (unless it is being shut down) and the socket is done.
pub(super) fn end_of_receiving(o: &mut Owned<Producer>, r: std::io::Result<usize>, shared: &Shared, peer: &str) {
    if !shared.stop.load(Ordering::Acquire) {
        shared.fail(match r {
            Err(e) => format!("peer {peer}: connection failed while receiving: {e}"),
            _ => format!("peer {peer} closed the connection (end of stream)"),
        });
    }
    o.end.close();
    o.live = false;
    shared.notify();
}
