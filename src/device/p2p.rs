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
//! 2. pair barrier 0 with every peer that still has a round `i` (`Mesh::pair_barrier`: flags
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
//! The rounds are a pure function (`algo::window::exchange::plan`), simulated on host memory
//! there.

use super::exec::DevOp;
use super::ipc::Ipc;
use super::ops;
use crate::algo::Collective;
use crate::error::{Error, Result};

/// Bytes of each peer's block of an input area of `area` bytes for `n` ranks (aligned to 64).
pub(crate) use crate::algo::select::exchange_block as block;

use crate::algo::window::exchange::{plan, ExchangePlan, Msg};

/// The exchange of rank `me` of `n` for the sends and receives `ops` (other collectives are
/// refused) with blocks of `blk` bytes ([`plan`] on their byte lengths).
fn plan_of(me: usize, n: usize, ops: &[DevOp], blk: usize) -> Result<ExchangePlan> {
    let msgs = ops
        .iter()
        .map(|o| {
            let len = crate::comm::byte_len(o.count, o.dtype)?;
            match o.coll {
                Collective::Send { peer } => Ok(Msg::Send { peer, addr: o.send, len }),
                Collective::Recv { peer } => Ok(Msg::Recv { peer, addr: o.recv, len }),
                c => Err(Error::internal(format!("{c:?} in a CUDA IPC send/receive exchange"))),
            }
        })
        .collect::<Result<Vec<Msg>>>()?;
    plan(me, n, &msgs, blk)
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
            let plan = plan_of(me, n, ops, blk)?;
            // SAFETY: forwarded from this function's contract.
            unsafe { ipc.enqueue_exchange(&plan) }
        })
    }

    /// # Safety
    /// As [`Ipc::exchange`], for the plan's addresses.
    unsafe fn enqueue_exchange(&mut self, plan: &ExchangePlan) -> Result<()> {
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

    #[test]
    fn device_calls_become_messages_and_others_are_refused() {
        let calls = [op(Collective::Send { peer: 1 }, 0, 8), op(Collective::Recv { peer: 1 }, 64, 8)];
        let p = plan_of(0, 2, &calls, 64).unwrap();
        assert_eq!((p.rounds.len(), p.rounds[0].with.as_slice()), (1, &[1][..]));
        assert!(plan_of(0, 2, &[op(Collective::AllGather, 0, 4)], 64).is_err());
        assert_eq!(block(3, 1000), 320);
    }
}
