//! Send/receive on the CUDA IPC path: the sends and receives of one call (a group's, or a
//! single `ncclSend` / `ncclRecv`) run as one exchange between the ranks of one host, on the
//! internal stream, through the peers' mapped input areas.
//!
//! Each rank's input area is cut into one block per destination rank ([`block`] bytes). What a
//! rank sends to peer `q` (its sends to `q`, concatenated in issue order) is one byte stream;
//! what it receives from `q` (its receives from `q`, in issue order) is another, which must
//! have the length of `q`'s stream to it (NCCL's matching rule). A pair of ranks moves its two
//! streams in `max(⌈sent / block⌉, ⌈received / block⌉)` rounds, a number both ranks compute
//! alike. Round `i`, on the stream of every rank that has one:
//!
//! 1. copy the `i`-th block-sized piece of each stream to a peer into the peer's block of this
//!    rank's input area;
//! 2. pair barrier 0 with every peer that still has a round `i` (`Ipc::pair_barrier`: flags
//!    that count per pair of ranks, so ranks outside the exchange take no part in it, as in
//!    NCCL);
//! 3. pull the `i`-th piece of each stream from a peer out of that peer's input area (its
//!    block for this rank) into the receive buffers;
//! 4. pair barrier 1: the peers no longer read this rank's blocks, so round `i + 1` may
//!    overwrite them.
//!
//! Every rank runs its rounds in the same order and each barrier writes every flag before it
//! waits for any, so a round's waits are always satisfied once every rank reached it: no cycle,
//! whatever the pattern (rings, all pairs, unequal sizes). Messages to itself are copied send →
//! receive after the rounds. The watchdog times the exchange like a collective and treats a
//! peer of the exchange that died before its last barrier as a failure.
//!
//! The rounds are a pure function ([`plan`]), unit-tested here on host memory.

use super::exec::DevOp;
use super::ipc::Ipc;
use super::ops;
use crate::algo::Collective;
use crate::error::{Error, Result};

/// Bytes of each peer's block of an input area of `area` bytes for `n` ranks (aligned to 64).
pub(crate) use crate::algo::select::exchange_block as block;

/// One device copy `len` bytes from `src` to `dst` (addresses or offsets, as named).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Xfer {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
}

/// One round of an exchange.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// Before barrier 0: send buffer address → offset in this rank's input area.
    pub(crate) stage: Vec<Xfer>,
    /// Between the barriers: (peer, offset in the peer's input area → receive address).
    pub(crate) pull: Vec<(usize, Xfer)>,
    /// The peers of this round's barriers.
    pub(crate) with: Vec<usize>,
}

/// An exchange of rank `me` of `n`: its rounds, then the copies of its messages to itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) rounds: Vec<Round>,
    pub(crate) local: Vec<Xfer>,
}

/// The pieces of the byte stream made of `segs` (address, length) that cover `[at, at + len)`:
/// (address, length, offset of the piece from `at`).
fn pieces(segs: &[(u64, usize)], at: usize, len: usize) -> Vec<(u64, usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for &(addr, l) in segs {
        let (lo, hi) = (at.max(start), (at + len).min(start + l));
        if lo < hi {
            out.push((addr + (lo - start) as u64, hi - lo, lo - at));
        }
        start += l;
    }
    out
}

/// The exchange of rank `me` of `n` for the sends and receives `ops` (other collectives are
/// refused) with blocks of `blk` bytes.
pub(crate) fn plan(me: usize, n: usize, ops: &[DevOp], blk: usize) -> Result<Plan> {
    if blk == 0 {
        return Err(Error::internal("send/receive through CUDA IPC without a staging block"));
    }
    let mut sends: Vec<Vec<(u64, usize)>> = vec![Vec::new(); n];
    let mut recvs: Vec<Vec<(u64, usize)>> = vec![Vec::new(); n];
    for o in ops {
        let len = crate::comm::byte_len(o.count, o.dtype)?;
        match o.coll {
            Collective::Send { peer } if peer < n => sends[peer].push((o.send, len)),
            Collective::Recv { peer } if peer < n => recvs[peer].push((o.recv, len)),
            c => return Err(Error::internal(format!("{c:?} in a CUDA IPC send/receive exchange"))),
        }
    }
    let total = |v: &[(u64, usize)]| v.iter().map(|s| s.1).sum::<usize>();
    let (to_me, from_me) = (total(&sends[me]), total(&recvs[me]));
    if to_me != from_me {
        return Err(Error::invalid_usage(format!(
            "rank {me} sends {to_me} bytes to itself but receives {from_me} bytes from itself"
        )));
    }
    let mut plan = Plan { rounds: Vec::new(), local: local_copies(&sends[me], &recvs[me]) };
    let rounds = (0..n)
        .filter(|&q| q != me)
        .map(|q| total(&sends[q]).div_ceil(blk).max(total(&recvs[q]).div_ceil(blk)))
        .max()
        .unwrap_or(0);
    for i in 0..rounds {
        let mut r = Round::default();
        for q in (0..n).filter(|&q| q != me) {
            let (s, v) = (total(&sends[q]), total(&recvs[q]));
            if i >= s.div_ceil(blk).max(v.div_ceil(blk)) {
                continue;
            }
            r.with.push(q);
            let at = i * blk;
            for (src, len, o) in pieces(&sends[q], at, blk.min(s.saturating_sub(at))) {
                r.stage.push(Xfer { dst: (q * blk + o) as u64, src, len });
            }
            for (dst, len, o) in pieces(&recvs[q], at, blk.min(v.saturating_sub(at))) {
                r.pull.push((q, Xfer { dst, src: (me * blk + o) as u64, len }));
            }
        }
        plan.rounds.push(r);
    }
    Ok(plan)
}

/// Copies moving the byte stream `sends` into the byte stream `recvs` (equal lengths).
fn local_copies(sends: &[(u64, usize)], recvs: &[(u64, usize)]) -> Vec<Xfer> {
    let mut out = Vec::new();
    let mut at = 0;
    for &(dst, len) in recvs {
        for (src, l, o) in pieces(sends, at, len) {
            out.push(Xfer { dst: dst + o as u64, src, len: l });
        }
        at += len;
    }
    out
}

impl Ipc {
    /// Enqueues the sends and receives `ops` of one call as one exchange on the internal
    /// stream (context current). A failure to plan (messages to itself that do not match) or
    /// to enqueue fails the communicator: its peers' pair counters would no longer match it,
    /// and the abort word releases them at once instead of at the timeout.
    ///
    /// # Safety
    /// Each send's buffer must hold `count` elements readable, each receive's `count` elements
    /// writable, on this GPU, valid until the stream has run the exchange.
    pub(crate) unsafe fn exchange(&mut self, ops: &[DevOp]) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let blk = block(n, self.half());
        self.guarded(|ipc| {
            let plan = plan(me, n, ops, blk)?;
            // SAFETY: forwarded from this function's contract.
            unsafe { ipc.enqueue_exchange(&plan) }
        })
    }

    /// # Safety
    /// As [`Ipc::exchange`], for the plan's addresses.
    unsafe fn enqueue_exchange(&mut self, plan: &Plan) -> Result<()> {
        let (me, stream) = (self.rank(), self.stream());
        let mut last: Vec<(usize, u32)> = Vec::new();
        for r in &plan.rounds {
            let with: Vec<(usize, u32)> = r.with.iter().map(|&q| (q, self.next_pair(q))).collect();
            for c in &r.stage {
                // SAFETY: inside a send buffer (the contract) and this rank's input area (each
                // block lies within it, `block`).
                unsafe { ops::copy(self.input(me) + c.dst, c.src, c.len, stream)? };
            }
            self.pair_barrier(0, &with, stream)?;
            for &(q, c) in &r.pull {
                // SAFETY: inside a receive buffer (the contract) and peer q's mapped input
                // area, complete since q's barrier-0 write and unchanged until its barrier 1.
                unsafe { ops::copy(c.dst, self.input(q) + c.src, c.len, stream)? };
            }
            self.pair_barrier(1, &with, stream)?;
            for (q, v) in with {
                match last.iter_mut().find(|(p, _)| *p == q) {
                    Some(slot) => slot.1 = v,
                    None => last.push((q, v)),
                }
            }
        }
        for c in &plan.local {
            // SAFETY: inside a send and a receive buffer of this rank (the contract).
            unsafe { ops::copy(c.dst, c.src, c.len, stream)? };
        }
        self.finish_pairs(stream, last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{DataType, ReduceOp};

    fn op(coll: Collective, at: u64, count: usize) -> DevOp {
        DevOp { coll, send: at, recv: at, count, dtype: DataType::Int8, op: ReduceOp::Sum, scale: None }
    }

    /// Runs every rank's plan on host memory (addresses are offsets in each rank's memory),
    /// round by round; returns each rank's memory.
    fn simulate(n: usize, blk: usize, calls: &[Vec<DevOp>], mem_len: usize) -> Vec<Vec<u8>> {
        let mut mem: Vec<Vec<u8>> = (0..n).map(|r| (0..mem_len).map(|i| (r * 31 + i * 7) as u8).collect()).collect();
        let mut area = vec![vec![0u8; n * blk]; n];
        let plans: Vec<Plan> = (0..n).map(|r| plan(r, n, &calls[r], blk).unwrap()).collect();
        let rounds = plans.iter().map(|p| p.rounds.len()).max().unwrap();
        for i in 0..rounds {
            for r in 0..n {
                for c in plans[r].rounds.get(i).map_or(&[][..], |x| &x.stage) {
                    let (d, s) = (c.dst as usize, c.src as usize);
                    area[r][d..d + c.len].copy_from_slice(&mem[r][s..s + c.len]);
                }
            }
            // Barrier peers must agree both ways.
            for r in 0..n {
                for &q in plans[r].rounds.get(i).map_or(&[][..], |x| &x.with) {
                    assert!(plans[q].rounds[i].with.contains(&r), "round {i}: {r} waits for {q}, not back");
                }
            }
            for r in 0..n {
                for &(q, c) in plans[r].rounds.get(i).map_or(&[][..], |x| &x.pull) {
                    let (d, s) = (c.dst as usize, c.src as usize);
                    mem[r][d..d + c.len].copy_from_slice(&area[q][s..s + c.len]);
                }
            }
        }
        for (r, p) in plans.iter().enumerate() {
            for c in &p.local {
                let src = mem[r][c.src as usize..c.src as usize + c.len].to_vec();
                mem[r][c.dst as usize..c.dst as usize + c.len].copy_from_slice(&src);
            }
        }
        mem
    }

    #[test]
    fn exchanges_move_every_message_in_order() {
        // 3 ranks, blocks of 64 bytes: unequal sizes per peer (several rounds for some pairs,
        // one or none for others), two messages to one peer, a message to itself, a rank that
        // takes no part with one peer.
        let n = 3;
        let blk = 64;
        // Rank r sends to q `len(r, q)` bytes from offset 1000*q + 10*r (first message) and
        // receives from q into 5000 + 1000*q.
        let len = |r: usize, q: usize| -> usize {
            match (r, q) {
                (0, 1) => 200,
                (1, 0) => 7,
                (0, 0) => 70,
                (1, 2) => 129,
                (2, 1) => 64,
                (2, 0) => 1,
                _ => 0,
            }
        };
        let mut calls: Vec<Vec<DevOp>> = vec![Vec::new(); n];
        for r in 0..n {
            for q in 0..n {
                let l = len(r, q);
                if l == 0 {
                    continue;
                }
                // The send is split in two messages; the receive in one.
                let s = (1000 * q + 10 * r) as u64;
                calls[r].push(op(Collective::Send { peer: q }, s, l / 2));
                calls[r].push(op(Collective::Send { peer: q }, s + (l / 2) as u64, l - l / 2));
                calls[q].push(op(Collective::Recv { peer: r }, (5000 + 1000 * r) as u64, l));
            }
        }
        let before = simulate(n, blk, &vec![Vec::new(); n], 9000);
        let after = simulate(n, blk, &calls, 9000);
        for (r, got) in after.iter().enumerate() {
            for (q, sent) in before.iter().enumerate() {
                let l = len(q, r);
                let s = 1000 * r + 10 * q;
                let d = 5000 + 1000 * q;
                assert_eq!(got[d..d + l], sent[s..s + l], "{q} -> {r}");
            }
        }
        // Pair rounds: 0-1 has ⌈200/64⌉ = 4, 1-2 has 3, 0-2 has 1.
        let p0 = plan(0, n, &calls[0], blk).unwrap();
        assert_eq!(p0.rounds.len(), 4);
        assert_eq!(p0.rounds[0].with, [1, 2]);
        assert_eq!(p0.rounds[3].with, [1]);
        assert_eq!(p0.local.iter().map(|c| c.len).sum::<usize>(), 70);
    }

    #[test]
    fn mismatched_messages_to_itself_are_refused() {
        let calls = [op(Collective::Send { peer: 0 }, 0, 8), op(Collective::Recv { peer: 0 }, 64, 4)];
        let e = plan(0, 2, &calls, 64).unwrap_err();
        assert!(e.message().contains("itself"), "{e:?}");
        assert!(plan(0, 2, &[op(Collective::AllGather, 0, 4)], 64).is_err());
        assert_eq!(block(3, 1000), 320);
    }
}
