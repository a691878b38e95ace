//! The small all-reduce path: recursive doubling with one message per round, over the
//! shared-memory links' lanes (`crate::transport::shm::lane`), without a plan.
//!
//! A small all-reduce is all latency: the general engine's bookkeeping (plan steps, per-step
//! state, the signature as a separate piece of the stream, the ring's control words) costs
//! more than the data. Here a rank of a power-of-two communicator copies its input into a
//! stack buffer and, for each bit of its rank, exchanges the whole buffer with the partner
//! across that bit and reduces. The operand of the lower half always goes first, so every
//! rank evaluates the same expression tree and all results are bit-identical, whatever the
//! operator (floating-point max/min of signed zeros and NaNs included).
//!
//! The message carries what the call was (collective, type, operator, count): the receiver
//! compares it with its own call before using a byte (mismatch detection costs nothing extra).
//! A partner whose link is not shared memory (a pair whose segment could not be set up) is
//! served over the link's byte stream with the same message format, so both ends of every
//! pair always agree on the path.
//!
//! Waiting: spin without reading the clock for a few rounds, then spin, yield and sleep as the
//! communicator's policy says ([`crate::wait`]), sleeping on the lane's futex; now and then the
//! link is checked for a dead or failed peer, and the operation is bounded by the timeout.

use crate::error::{Error, Result};
use crate::mismatch::{Desc, Signature, SIG_LEN};
use crate::reduce;
use crate::transport::shm::lane::{Stamp, HEADER, MAX};
use crate::transport::Link;
use crate::types::{DataType, ReduceOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Largest all-reduce (bytes per rank) this path takes ([`crate::algo::select::path`] sends it no
/// more); one slot of the shared-memory lane holds it.
pub const MAX_BYTES: usize = crate::algo::select::LANE_MAX_BYTES;
const _: () = assert!(MAX_BYTES <= MAX, "a lane all-reduce must fit one lane slot");

/// Idle rounds spun before the clock is read.
const CLOCKLESS_ROUNDS: u32 = 64;
/// How often a waiting rank looks at its link for a dead or failed peer.
const CHECK_EVERY: Duration = Duration::from_millis(2);
/// Longest single sleep on the lane's futex.
const NAP: Duration = Duration::from_millis(20);

/// Most rounds (log2 of the ranks) the path takes: communicators of up to 2^20 ranks.
pub const MAX_ROUNDS: usize = crate::algo::select::LANE_MAX_ROUNDS;

/// The partners of `rank` (of `nranks`, a power of two) in round order.
pub fn partners(rank: usize, nranks: usize) -> impl Iterator<Item = usize> {
    (0..nranks.trailing_zeros()).map(move |r| rank ^ (1 << r))
}

/// What a plan-less path (this one, and the host arena's, `super::arena`) needs of the
/// communicator.
pub struct PlanlessCtx<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator (all on this host).
    pub nranks: usize,
    /// Links by peer rank; every peer the path talks to must be connected.
    pub links: &'a mut [Option<Box<dyn Link>>],
    /// Set by `ncclCommAbort`.
    pub abort: &'a AtomicBool,
    /// Longest wait without progress.
    pub timeout: Duration,
    /// How to wait.
    pub spin: crate::wait::Spin,
    /// Whether the peers' calls are compared with this one (`OXCCL_CHECK_MISMATCH`).
    pub check: bool,
    /// Whether buffers in shareable host memory are read by the others where they lie
    /// (`OXCCL_LOCAL_REGISTER`; the host arena, `super::arena`).
    pub share: bool,
}

impl<'a> PlanlessCtx<'a> {
    /// The waiting of one round (lane) or barrier (arena) on `peer`.
    pub(super) fn waiter(&self, round: usize, peer: usize) -> Waiter<'a> {
        Waiter { rank: self.rank, abort: self.abort, timeout: self.timeout, spin: self.spin, round, peer }
    }
}

const WORDS: usize = MAX_BYTES.div_ceil(8);
/// One message's buffer (8-byte aligned).
type Buf = [u64; WORDS];

/// The path's three message buffers (this rank's running result, the partner's message, the
/// next result), kept by the communicator from call to call.
pub struct Bufs(Box<[Buf; 3]>);

impl Default for Bufs {
    fn default() -> Bufs {
        Bufs(Box::new([[0; WORDS]; 3]))
    }
}

fn bytes_of(b: &mut Buf) -> &mut [u8] {
    bytemuck::cast_slice_mut(&mut b[..])
}

/// All-reduce of `count` elements (at most [`MAX_BYTES`] bytes) from `send` into `recv`, with
/// the communicator's message buffers `bufs`; `ctx.nranks` is a power of two.
///
/// # Safety
/// `send` must be readable and `recv` writable for `count * dtype.size()` bytes during the call
/// (they may be equal).
pub unsafe fn all_reduce(
    ctx: PlanlessCtx<'_>,
    bufs: &mut Bufs,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> Result<()> {
    let len = count * dtype.size();
    assert!(len <= MAX_BYTES, "lane all-reduce of {len} bytes");
    let w0 = ctx.waiter(0, 0);
    let PlanlessCtx { rank, nranks, links, check, .. } = ctx;
    let [acc, theirs, out] = &mut *bufs.0;
    // SAFETY: the caller guarantees `len` readable bytes at `send`; the stack buffer holds them.
    unsafe { std::ptr::copy_nonoverlapping(send, bytes_of(acc).as_mut_ptr(), len) };
    let desc = Desc::single(crate::algo::Collective::AllReduce, count, dtype, op);
    let stamp = Stamp { tag: desc.tag, dtype: desc.dtype, op: desc.op, len: len as u32, count: count as u64 };
    // Partners of later rounds learn at once what this rank called (see the lane's notice).
    for p in partners(rank, nranks).skip(1) {
        if let Some(shm) = links.get_mut(p).and_then(|l| l.as_deref_mut()).and_then(|l| l.shm()) {
            shm.lane().announce(&stamp);
        }
    }
    let rounds = nranks.trailing_zeros() as usize;
    for (round, p) in partners(rank, nranks).enumerate() {
        let Some(link) = links.get_mut(p).and_then(|l| l.as_deref_mut()) else {
            return Err(Error::internal(format!("rank {rank}: all_reduce: no link to rank {p}")));
        };
        let w = Waiter { round, peer: p, ..w0 };
        let got = match link.shm() {
            Some(shm) => w.lane(shm, &stamp, &bytes_of(acc)[..len], &mut bytes_of(theirs)[..len])?,
            None => w.stream(link, &stamp, &bytes_of(acc)[..len], &mut bytes_of(theirs)[..len])?,
        };
        if check {
            crate::mismatch::check(rank, &stamp_signature(&stamp, 0), p, &stamp_signature(&got, 0))?;
        } else if got.len as usize != len {
            return Err(Error::invalid_usage(format!(
                "collective mismatch: rank {rank} all-reduces {len} B, rank {p} {} B",
                got.len
            )));
        }
        let (a, b) = if rank & (1 << round) == 0 { (&*acc, &*theirs) } else { (&*theirs, &*acc) };
        let (a, b) = (&bytemuck::cast_slice(&a[..])[..len], &bytemuck::cast_slice(&b[..])[..len]);
        if round + 1 == rounds {
            // The last round reduces straight into the caller's buffer (the input was copied
            // out first, so in place is fine).
            // SAFETY: the caller guarantees `len` writable bytes at `recv`, untouched by
            // anything else during the call; the view ends with this block.
            let dst = unsafe { std::slice::from_raw_parts_mut(recv, len) };
            reduce::reduce_to(dtype, op, dst, a, b);
            if op == ReduceOp::Avg {
                reduce::divide(dtype, dst, nranks);
            }
            return Ok(());
        }
        reduce::reduce_to(dtype, op, &mut bytes_of(out)[..len], a, b);
        std::mem::swap(acc, out);
    }
    Err(Error::internal(format!("rank {rank}: small all-reduce on {nranks} ranks ran no round")))
}

/// The operation signature ([`crate::mismatch`]) of the call a lane message describes, as
/// operation number `seq`.
pub fn stamp_signature(s: &Stamp, seq: u64) -> Signature {
    let desc = Desc { tag: s.tag, dtype: s.dtype, op: s.op, root: u32::MAX, count: s.count };
    Signature { desc, seq, send_bytes: s.len as u64, recv_bytes: s.len as u64 }
}

/// One round's waiting, with what its errors say (also the host arena's, `super::arena`).
#[derive(Clone, Copy)]
pub(super) struct Waiter<'a> {
    pub(super) rank: usize,
    pub(super) abort: &'a AtomicBool,
    pub(super) timeout: Duration,
    pub(super) spin: crate::wait::Spin,
    /// The round (lane) or barrier (arena) waited for.
    pub(super) round: usize,
    /// The rank waited for.
    pub(super) peer: usize,
}

/// Where a wait stands once the clock runs.
pub(super) struct Clock {
    start: Instant,
    checked: Instant,
}

impl Clock {
    /// What is left of `timeout` since the wait began.
    pub(super) fn left(&self, timeout: Duration) -> Duration {
        timeout.saturating_sub(self.start.elapsed())
    }
}

impl Waiter<'_> {
    /// One idle round past the clockless ones: `Ok(true)` to sleep, `Ok(false)` to go on, an
    /// error when the call must stop (abort, timeout, or what `check` reports).
    pub(super) fn idle(&self, clock: &mut Option<Clock>, check: &mut dyn FnMut() -> Result<()>) -> Result<bool> {
        let now = Instant::now();
        let c = clock.get_or_insert(Clock { start: now, checked: now });
        if self.abort.load(Ordering::Relaxed) {
            return Err(Error::invalid_usage(format!("rank {}: communicator was aborted", self.rank)));
        }
        if now.duration_since(c.checked) >= CHECK_EVERY {
            c.checked = now;
            check()?;
        }
        let idle = now.duration_since(c.start);
        if idle >= self.timeout {
            return Err(Error::timeout(format!(
                "rank {}: all_reduce (small-message path, round {}): no message from rank {} for {} ms (OXCCL_TIMEOUT_MS)",
                self.rank,
                self.round,
                self.peer,
                self.timeout.as_millis()
            )));
        }
        if idle < self.spin.pure {
            std::hint::spin_loop();
            return Ok(false);
        }
        if idle < crate::wait::budget(&self.spin) {
            std::thread::yield_now();
            return Ok(false);
        }
        Ok(true)
    }

    /// Records how long the wait lasted (the adaptive spin budget).
    pub(super) fn done(&self, clock: Option<Clock>) {
        if let Some(c) = clock {
            crate::wait::waited(&self.spin, c.start.elapsed());
        }
    }

    /// The exchange over a shared-memory link's lane.
    pub(super) fn lane(
        &self,
        shm: &mut crate::transport::shm::ShmLink,
        stamp: &Stamp,
        mine: &[u8],
        theirs: &mut [u8],
    ) -> Result<Stamp> {
        let seq = shm.lane().post(stamp, mine);
        let mut rounds = 0u32;
        let mut clock = None;
        while !shm.lane().ready(seq) {
            rounds += 1;
            // A partner that last waited on this very CPU can only answer once this rank gives
            // the core away: look every few rounds. Ranks that outnumber the CPUs yield it;
            // ranks that do not (two unpinned ranks the scheduler put on one CPU) sleep
            // instead, so that the partner's wake-up can place this rank on the idle CPU
            // (a yield keeps both on one run queue, with a hand-off per message), and after
            // many such waits move themselves off this CPU (`wait::colocated`).
            if rounds % 8 == 0 && shm.colocated() {
                if self.spin.yields_at_once() {
                    std::thread::yield_now();
                } else if !crate::wait::colocated() {
                    shm.lane().sleep(seq, NAP.min(self.timeout));
                }
            }
            if rounds < CLOCKLESS_ROUNDS {
                std::hint::spin_loop();
                continue;
            }
            let sleep = self.idle(&mut clock, &mut || self.look(shm, seq, stamp))?;
            if sleep {
                let left = clock.as_ref().map_or(NAP, |c| self.timeout.saturating_sub(c.start.elapsed()));
                if !shm.lane().sleep(seq, left.min(NAP)) {
                    continue;
                }
            }
        }
        self.done(clock);
        Ok(shm.lane().take(seq, theirs))
    }

    /// The periodic look at the link of a partner whose message `seq` had not come: an error
    /// when the partner failed or runs another operation. The partner may have posted since
    /// `ready` was tested, finished the call and gone on (ring bytes of its next operation, or
    /// its exit): what the look finds counts only if the message is still not there afterwards
    /// (the partner posted before anything it does next, and this side reads with acquire).
    fn look(&self, shm: &mut crate::transport::shm::ShmLink, seq: u32, stamp: &Stamp) -> Result<()> {
        let mut head = [0u8; SIG_LEN];
        let found = match shm.lane_check(&mut head) {
            Ok(0) => return Ok(()),
            Ok(n) => Err(self.foreign(stamp, &head[..n])),
            Err(e) => Err(e),
        };
        if shm.lane().ready(seq) {
            return Ok(());
        }
        found
    }

    /// The error for a partner that runs another operation: a mismatch naming both calls when
    /// `head` (the first bytes it sent) is its operation signature.
    pub(super) fn foreign(&self, stamp: &Stamp, head: &[u8]) -> Error {
        if let Ok(theirs) = Signature::decode(head) {
            let mine = stamp_signature(stamp, theirs.seq);
            if let Err(e) = crate::mismatch::check(self.rank, &mine, self.peer, &theirs) {
                return e;
            }
        }
        Error::invalid_usage(format!(
            "collective mismatch: rank {} sent the data of another operation while rank {} waits for a small all-reduce's message",
            self.peer, self.rank
        ))
    }

    /// The same exchange over a link's byte stream: header and payload out, then in.
    pub(super) fn stream(&self, link: &mut dyn Link, stamp: &Stamp, mine: &[u8], theirs: &mut [u8]) -> Result<Stamp> {
        let head = stamp.encode(0);
        let mut sent = 0;
        let total = HEADER + mine.len();
        let mut inbound = [0u8; HEADER];
        let mut got = 0;
        let want = HEADER + theirs.len();
        let mut clock = None;
        while sent < total || got < want {
            let mut moved = false;
            if sent < total {
                let n = if sent < HEADER {
                    link.try_send_vectored(&[&head[sent..], mine])?
                } else {
                    link.try_send(&mine[sent - HEADER..])?
                };
                sent += n;
                moved |= n > 0;
            }
            if got < want {
                let n = if got < HEADER {
                    link.try_recv_vectored(&mut inbound[got..], theirs)?
                } else {
                    link.try_recv(&mut theirs[got - HEADER..])?
                };
                if got < HEADER && got + n >= HEADER && Stamp::decode(&inbound).is_none() {
                    return Err(Error::invalid_usage(format!(
                        "collective mismatch: rank {} sent the data of another operation while rank {} waits for a small all-reduce's message",
                        self.peer, self.rank
                    )));
                }
                got += n;
                moved |= n > 0;
            }
            if moved {
                clock = None;
            } else if self.idle(&mut clock, &mut || Ok(()))? {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(Stamp::decode(&inbound).map(|(_, s)| s).unwrap_or_default())
    }
}

/// What the tests of the plan-less paths (here and `super::arena`) build their calls from.
#[cfg(test)]
pub(super) mod testing {
    use super::*;

    /// The stamp of an all-reduce of `count` elements.
    pub fn stamp_of(count: usize, dtype: DataType, op: ReduceOp) -> Stamp {
        let d = Desc::single(crate::algo::Collective::AllReduce, count, dtype, op);
        let len = (count * dtype.size()) as u32;
        Stamp { tag: d.tag, dtype: d.dtype, op: d.op, len, count: count as u64 }
    }

    /// Rank 0 waiting for rank 1 in `round`, with a 5 s timeout.
    pub fn waiter(abort: &AtomicBool, round: usize) -> Waiter<'_> {
        let spin = crate::wait::Spin::for_load(2, 2, None);
        Waiter { rank: 0, abort, timeout: Duration::from_secs(5), spin, round, peer: 1 }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{stamp_of, waiter};
    use super::*;
    use crate::algo::Collective;
    use crate::mismatch::Signature;
    use crate::transport::shm::ShmLink;

    /// Rank 0 posted message 1 of an all-reduce of 2 floats and waits for rank 1's. Rank 1
    /// sends the signature of a broadcast on the ring, after posting its message 1 (`posted`:
    /// it finished the all-reduce and went on) or without it (it runs the broadcast instead).
    fn look_after(posted: bool) -> Result<()> {
        let (mut a, mut b) = ShmLink::pair(1 << 16).unwrap();
        let stamp = stamp_of(2, DataType::Float32, ReduceOp::Sum);
        let seq = a.lane().post(&stamp, &[0; 8]);
        if posted {
            assert_eq!(b.lane().post(&stamp, &[0; 8]), seq);
        }
        let bd = Desc::single(Collective::Broadcast { root: 1 }, 64, DataType::Float32, ReduceOp::Sum);
        let sig = Signature { desc: bd, seq: 2, send_bytes: 256, recv_bytes: 256 }.encode();
        assert_eq!(b.try_send(&sig).unwrap(), sig.len());
        let abort = AtomicBool::new(false);
        waiter(&abort, 0).look(&mut a, seq, &stamp)
    }

    #[test]
    fn a_partner_that_posted_and_went_on_is_no_mismatch() {
        look_after(true).expect("the ring bytes of the partner's next operation");
    }

    #[test]
    fn a_partner_in_another_operation_is_a_mismatch() {
        let e = look_after(false).expect_err("the partner runs a broadcast");
        assert_eq!(e.kind(), crate::error::ErrorKind::InvalidUsage, "{e}");
        assert!(e.message().contains("collective mismatch"), "{e}");
    }
}
