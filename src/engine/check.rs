//! The checks of a plan before the engine runs it (`Exec::new`): every step's regions lie in
//! their buffers, its dependencies come first, its peer has a link, folds and codings have
//! sides apart and of matching sizes; and the queue each step waits in.

use super::{Ctx, Mem, Operands};
use crate::algo::{Action, Node, Region, Step};
use crate::error::{Error, Result};
use crate::types::DataType;

/// Where a checked plan step waits to run.
pub(super) enum Queue {
    /// On the send queue of this peer.
    Send(usize),
    /// On the receive queue of this peer.
    Recv(usize),
    /// With the local steps (copies, folds, codings, finishes).
    Local,
}

/// Checks that region `r` lies inside its buffer as `mem` sees it.
fn check_region(mem: &Mem, r: &Region) -> Result<()> {
    let (base, cap) =
        mem.base(r).ok_or_else(|| Error::internal(format!("plan region {r:?} names a call that does not exist")))?;
    if base.is_null() && r.len > 0 {
        return Err(Error::internal(format!("plan region {r:?} is in a buffer that is NULL")));
    }
    if r.off.checked_add(r.len).is_none_or(|e| e > cap) {
        return Err(Error::internal(format!("plan region {r:?} exceeds its buffer ({cap} bytes)")));
    }
    Ok(())
}

/// Whether regions `a` and `b` do not overlap in memory.
fn apart(mem: &Mem, a: &Region, b: &Region) -> bool {
    mem.ptr(*a) as usize >= mem.ptr(*b) as usize + b.len || mem.ptr(*b) as usize >= mem.ptr(*a) as usize + a.len
}

/// Checks plan step `i` before anything runs: its dependencies come before it, its regions
/// lie in their buffers, its peer has a link, a fold's or a coding's two sides are apart and
/// of matching sizes. Returns the queue it waits in.
pub(super) fn check_step(i: usize, node: &Node, mem: &Mem, calls: &[Operands], ctx: &Ctx<'_>) -> Result<Queue> {
    if node.deps.iter().any(|&d| d >= i) {
        return Err(Error::internal(format!("plan step {i} depends on a later step")));
    }
    let linked = |peer: usize| {
        if ctx.links.get(peer).is_some_and(|l| l.is_some()) {
            Ok(())
        } else {
            Err(Error::internal(format!("rank {}: no link to rank {peer} for {}", ctx.rank, ctx.what)))
        }
    };
    let check = |r: &Region| check_region(mem, r);
    match &node.step {
        Step::Send { peer, src } => {
            check(src)?;
            linked(*peer)?;
            Ok(Queue::Send(*peer))
        }
        Step::Recv { peer, dst, action } => {
            check(dst)?;
            if let Action::Reduce { with } | Action::ReduceFinal { with } = action {
                check(with)?;
                if with.len != dst.len {
                    return Err(Error::internal("plan reduce operands differ in length"));
                }
            }
            linked(*peer)?;
            Ok(Queue::Recv(*peer))
        }
        Step::Copy { src, dst } => {
            check(src)?;
            check(dst)?;
            Ok(Queue::Local)
        }
        Step::Finish { dst } => {
            check(dst)?;
            Ok(Queue::Local)
        }
        Step::Fold { src, dst } => {
            check(src)?;
            check(dst)?;
            if dst.len == 0 || src.len % dst.len != 0 || !apart(mem, src, dst) {
                return Err(Error::internal(format!("plan fold {src:?} into {dst:?} is malformed")));
            }
            Ok(Queue::Local)
        }
        Step::Encode { src, dst, enc } | Step::Decode { src: dst, dst: src, enc, .. } => {
            // `src`: the f32 side, `dst`: the encoded side (whichever way the step goes).
            check(src)?;
            check(dst)?;
            let f32s = calls[src.call].dtype == DataType::Float32 || !enc.lossy();
            if src.len % 4 != 0 || dst.len != enc.size(src.len / 4) || !apart(mem, src, dst) || !f32s {
                return Err(Error::internal(format!("plan coding {src:?} as {enc:?} in {dst:?} is malformed")));
            }
            Ok(Queue::Local)
        }
    }
}
