//! Running a group: operations collected by the call layer ([`crate::call::Batch`], behind
//! `ncclGroupStart` / `ncclGroupEnd` and [`crate::call::group`]) run together.
//!
//! At the end of a group, the operations of each communicator are merged into one plan, in
//! issue order ([`Plan::append`]: each keeps its own buffers, type and operator), and that
//! plan runs in one engine run. The engine keeps a separate queue per peer and direction, so a
//! send and a receive to the same peer never wait on each other, and any set of matched sends
//! and receives (a ring exchange, an all-to-all written with sends and receives) completes.
//! When a group spans several communicators (one thread driving several ranks), each runs on
//! its own scoped thread, so ranks of one clique in one group cannot wait on each other.
//!
//! Within one communicator's part of a group:
//! - the k-th send to oneself pairs with the k-th receive from oneself and becomes a copy; an
//!   unpaired one, or a pair of different sizes, is `ncclInvalidUsage`;
//! - a receive whose buffer overlaps the buffer of a send in the same group (an in-place
//!   exchange) lands in scratch memory and is copied over once those sends have left.
//!
//! Errors: a call that fails its checks returns the error at once and is not added; the rest of
//! the group still runs at its end (NCCL instead drops the whole group; either way the peers of
//! the failed call time out). The group's own result is the first error of any communicator.

use crate::algo::{direct, Buf, Collective, Plan, Region, Step};
use crate::coll::{overlaps, Op};
use crate::comm::{Caller, Communicator};
use crate::engine::Operands;
use crate::error::{Error, Result};
use std::sync::Arc;

pub(crate) mod host_work;
mod raw;

impl Communicator {
    /// Runs one call now (a group of one). A collective other than a send or receive skips
    /// the group machinery: its (cached) plan runs as is.
    pub fn run(&self, op: Op<'_>) -> Result<()> {
        self.run_for(op, Caller::User)
    }

    /// [`Communicator::run`] for `caller` (whether the call waits for the communicator's
    /// device work in flight: [`Caller`]).
    fn run_for(&self, op: Op<'_>, caller: Caller) -> Result<()> {
        if matches!(op.coll, Collective::Send { .. } | Collective::Recv { .. }) {
            return run_one(self, vec![op], caller);
        }
        self.run_single(op, caller)
    }

    /// Runs one collective for `caller` on its executor: a plan-less one on
    /// [`crate::algo::select::path`]'s answer now ([`Communicator::run_planless`]), else its
    /// (cached) plan on the engine.
    fn run_single(&self, op: Op<'_>, caller: Caller) -> Result<()> {
        if op.planless {
            let path = self.host_path(op.coll, op.count, op.call.dtype);
            // SAFETY: the op's buffers are valid for its lifetime, which outlives this call
            // (the contract of `Communicator::prepare`).
            return unsafe { self.run_planless(&op.call, op.count, path, caller) };
        }
        let desc = crate::mismatch::Desc::single(op.coll, op.count, op.call.dtype, op.call.op);
        // SAFETY: the op's buffers are valid for its lifetime, which outlives this call (the
        // contract of `Communicator::prepare`).
        unsafe { self.execute(op.coll.name(), &desc, &op.plan, &[op.call], caller) }
    }
}

/// Runs operations as one group (see the module docs): a user's host calls, which first wait
/// for their communicators' device work in flight.
pub fn run(ops: Vec<(&Communicator, Op<'_>)>) -> Result<()> {
    let mut parts: Vec<(&Communicator, Vec<Op<'_>>)> = Vec::new();
    for (c, op) in ops {
        match parts.iter_mut().find(|(k, _)| std::ptr::eq(*k, c)) {
            Some((_, v)) => v.push(op),
            None => parts.push((c, vec![op])),
        }
    }
    if parts.len() <= 1 {
        return parts.into_iter().try_for_each(|(c, ops)| run_one(c, ops, Caller::User));
    }
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            parts.into_iter().map(|(c, ops)| s.spawn(move || run_one(c, ops, Caller::User))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::internal("a group's thread panicked"))))
            .collect()
    });
    results.into_iter().collect()
}

/// Merges one communicator's operations and runs them for `caller`.
fn run_one(comm: &Communicator, mut ops: Vec<Op<'_>>, caller: Caller) -> Result<()> {
    if ops.len() == 1 && !matches!(ops[0].coll, Collective::Send { .. } | Collective::Recv { .. }) {
        // A single collective runs its (cached) plan as is: nothing to merge.
        return comm.run_single(ops.pop().expect("one op"), caller);
    }
    let what = Collective::group_name(ops.iter().map(|o| o.coll));
    let desc = match ops.as_slice() {
        [one] => crate::mismatch::Desc::single(one.coll, one.count, one.call.dtype, one.call.op),
        _ => crate::mismatch::Desc::group(ops.len()),
    };
    // PreMulSum copies outlive the merge, which consumes the ops, until the run has ended.
    let _scaled: Vec<Vec<u64>> = ops.iter_mut().filter_map(|op| op.scaled.take()).collect();
    let ops = ops.into_iter().map(|op| comm.planned(op)).collect::<Result<Vec<_>>>()?;
    let (plan, calls) =
        merge(comm.rank(), ops).map_err(|e| comm.record(e.context(format!("rank {}: {what}", comm.rank()))))?;
    // SAFETY: every op's buffers are valid for its lifetime, which outlives this call (the
    // contract of `Communicator::prepare`); `merge` orders the writes into buffers that
    // overlap another op's reads.
    unsafe { comm.execute(&what, &desc, &plan, &calls, caller) }
}

/// Byte range `(start, len)` an op reads as a point-to-point sender.
fn send_range(op: &Op<'_>) -> Option<(usize, usize)> {
    matches!(op.coll, Collective::Send { .. }).then_some((op.call.bufs.send as usize, op.call.bufs.send_len))
}

/// Byte range `(start, len)` an op writes as a point-to-point receiver.
fn recv_range(op: &Op<'_>) -> Option<(usize, usize)> {
    matches!(op.coll, Collective::Recv { .. }).then_some((op.call.bufs.recv as usize, op.call.bufs.recv_len))
}

/// Merges one communicator's operations into one plan with one call per operation.
fn merge(rank: usize, ops: Vec<Op<'_>>) -> Result<(Plan, Vec<Operands>)> {
    let is_self = |op: &Op<'_>, want_send: bool| match op.coll {
        Collective::Send { peer } => want_send && peer == rank,
        Collective::Recv { peer } => !want_send && peer == rank,
        _ => false,
    };
    let self_sends: Vec<usize> = (0..ops.len()).filter(|&i| is_self(&ops[i], true)).collect();
    let self_recvs: Vec<usize> = (0..ops.len()).filter(|&i| is_self(&ops[i], false)).collect();
    if self_sends.len() != self_recvs.len() {
        return Err(Error::invalid_usage(format!(
            "{} send(s) to itself but {} receive(s) from itself in one group: each needs its partner",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    for (&s, &r) in self_sends.iter().zip(&self_recvs) {
        let (sl, rl) = (ops[s].call.bufs.send_len, ops[r].call.bufs.recv_len);
        if sl != rl {
            return Err(Error::invalid_usage(format!(
                "a send to itself of {sl} bytes is paired with a receive from itself of {rl} bytes"
            )));
        }
    }
    // Receives that would overwrite bytes a send of this group still reads are staged.
    let readers = |j: usize| -> Vec<usize> {
        let Some((r, rl)) = recv_range(&ops[j]) else { return Vec::new() };
        (0..ops.len())
            .filter(|&i| i != j && send_range(&ops[i]).is_some_and(|(s, sl)| overlaps(s, sl, r, rl)))
            .collect()
    };
    let hazards: Vec<Vec<usize>> = (0..ops.len()).map(readers).collect();
    let mut plan = Plan::default();
    let mut calls = Vec::with_capacity(ops.len());
    let mut ranges = Vec::with_capacity(ops.len());
    let mut staged = vec![None; ops.len()];
    for (i, op) in ops.into_iter().enumerate() {
        let start = plan.nodes.len();
        let part = match op.coll {
            Collective::Recv { peer } if peer != rank && !hazards[i].is_empty() && op.call.bufs.recv_len > 0 => {
                staged[i] = Some(start);
                direct::recv(peer, op.call.bufs.recv_len, true)
            }
            _ => Arc::try_unwrap(op.plan).unwrap_or_else(|shared| (*shared).clone()),
        };
        plan.append(part, i);
        ranges.push(start..plan.nodes.len());
        calls.push(op.call);
    }
    // Each self pair's copy waits for the network sends that read its destination.
    let mut copy_of = vec![None; calls.len()];
    for (&s, &r) in self_sends.iter().zip(&self_recvs) {
        let len = calls[s].bufs.send_len;
        if len == 0 {
            continue;
        }
        let deps = hazards[r].iter().filter(|&&i| i != s).flat_map(|&i| ranges[i].clone()).collect();
        let src = Region { call: s, buf: Buf::Send, off: 0, len };
        let dst = Region { call: r, buf: Buf::Recv, off: 0, len };
        copy_of[s] = Some(plan.push(Step::Copy { src, dst }, deps));
    }
    // Staged receives are copied over once their bytes arrived and the overlapping sends left.
    for (j, readers) in hazards.iter().enumerate() {
        let Some(got) = staged[j] else { continue };
        let len = calls[j].bufs.recv_len;
        let mut deps = vec![got];
        for &i in readers {
            deps.extend(ranges[i].clone());
            deps.extend(copy_of[i]);
        }
        let src = Region { call: j, buf: Buf::Scratch, off: 0, len };
        let dst = Region { call: j, buf: Buf::Recv, off: 0, len };
        plan.push(Step::Copy { src, dst }, deps);
    }
    Ok((plan, calls))
}
