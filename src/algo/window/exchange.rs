//! The send/receive exchange through windows: the sends and receives of one call (a group's,
//! or one `ncclSend` / `ncclRecv`) between ranks that map each other's input areas, in rounds
//! with pair barriers (only the two ranks of a pair wait for each other).
//!
//! Each rank's input area is cut into one block per destination rank (`blk` bytes). What a
//! rank sends to peer `q` (its sends to `q`, concatenated in issue order) is one byte stream;
//! what it receives from `q` (its receives from `q`, in issue order) is another, which must
//! have the length of `q`'s stream to it (NCCL's matching rule). A pair of ranks moves its two
//! streams in `max(⌈sent / blk⌉, ⌈received / blk⌉)` rounds, a number both ranks compute alike.
//! Round `i`: stage the `i`-th piece of each stream to a peer into the peer's block of this
//! rank's input area; pair barrier 0 with every peer that still has a round `i`; pull the
//! `i`-th piece of each stream from a peer out of that peer's input area; pair barrier 1.
//! Messages to itself are copied after the rounds. The device executor is `device/p2p.rs`.

use crate::error::{Error, Result};

/// One device copy `len` bytes from `src` to `dst` (addresses or offsets, as named).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xfer {
    /// Destination.
    pub dst: u64,
    /// Source.
    pub src: u64,
    /// Bytes.
    pub len: usize,
}

/// One round of an exchange.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Round {
    /// Before barrier 0: send buffer address → offset in this rank's input area.
    pub stage: Vec<Xfer>,
    /// Between the barriers: (peer, offset in the peer's input area → receive address).
    pub pull: Vec<(usize, Xfer)>,
    /// The peers of this round's barriers.
    pub with: Vec<usize>,
}

/// An exchange of rank `me` of `n`: its rounds, then the copies of its messages to itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExchangePlan {
    /// The rounds, in order.
    pub rounds: Vec<Round>,
    /// After the rounds: the copies of the rank's messages to itself.
    pub local: Vec<Xfer>,
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

/// One message of an exchange: a send to or a receive from `peer` of `len` bytes at `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Msg {
    /// `len` bytes at `addr` go to `peer`.
    Send {
        /// The destination rank.
        peer: usize,
        /// Where the bytes are.
        addr: u64,
        /// Bytes.
        len: usize,
    },
    /// `len` bytes from `peer` land at `addr`.
    Recv {
        /// The source rank.
        peer: usize,
        /// Where the bytes go.
        addr: u64,
        /// Bytes.
        len: usize,
    },
}

/// The exchange of rank `me` of `n` for the messages `msgs` with blocks of `blk` bytes.
pub fn plan(me: usize, n: usize, msgs: &[Msg], blk: usize) -> Result<ExchangePlan> {
    if blk == 0 {
        return Err(Error::internal("a send/receive exchange through windows without a staging block"));
    }
    let mut sends: Vec<Vec<(u64, usize)>> = vec![Vec::new(); n];
    let mut recvs: Vec<Vec<(u64, usize)>> = vec![Vec::new(); n];
    for &m in msgs {
        match m {
            Msg::Send { peer, addr, len } if peer < n => sends[peer].push((addr, len)),
            Msg::Recv { peer, addr, len } if peer < n => recvs[peer].push((addr, len)),
            m => return Err(Error::internal(format!("{m:?}: no such rank among {n}"))),
        }
    }
    let total = |v: &[(u64, usize)]| v.iter().map(|s| s.1).sum::<usize>();
    let (to_me, from_me) = (total(&sends[me]), total(&recvs[me]));
    if to_me != from_me {
        return Err(Error::invalid_usage(format!(
            "rank {me} sends {to_me} bytes to itself but receives {from_me} bytes from itself"
        )));
    }
    let mut plan = ExchangePlan { rounds: Vec::new(), local: local_copies(&sends[me], &recvs[me]) };
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

#[cfg(test)]
mod tests {
    use super::*;

    fn send(peer: usize, addr: u64, len: usize) -> Msg {
        Msg::Send { peer, addr, len }
    }

    fn recv(peer: usize, addr: u64, len: usize) -> Msg {
        Msg::Recv { peer, addr, len }
    }

    /// Runs every rank's plan on host memory (addresses are offsets in each rank's memory),
    /// round by round; returns each rank's memory.
    fn simulate(n: usize, blk: usize, calls: &[Vec<Msg>], mem_len: usize) -> Vec<Vec<u8>> {
        let mut mem: Vec<Vec<u8>> = (0..n).map(|r| (0..mem_len).map(|i| (r * 31 + i * 7) as u8).collect()).collect();
        let mut area = vec![vec![0u8; n * blk]; n];
        let plans: Vec<ExchangePlan> = (0..n).map(|r| plan(r, n, &calls[r], blk).unwrap()).collect();
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
        let mut calls: Vec<Vec<Msg>> = vec![Vec::new(); n];
        for r in 0..n {
            for q in 0..n {
                let l = len(r, q);
                if l == 0 {
                    continue;
                }
                // The send is split in two messages; the receive in one.
                let s = (1000 * q + 10 * r) as u64;
                calls[r].push(send(q, s, l / 2));
                calls[r].push(send(q, s + (l / 2) as u64, l - l / 2));
                calls[q].push(recv(r, (5000 + 1000 * r) as u64, l));
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
        let calls = [send(0, 0, 8), recv(0, 64, 4)];
        let e = plan(0, 2, &calls, 64).unwrap_err();
        assert!(e.message().contains("itself"), "{e:?}");
        assert!(plan(0, 2, &[send(2, 0, 4)], 64).is_err(), "no rank 2 of 2");
        assert!(plan(0, 2, &calls, 0).is_err(), "no block");
    }
}
