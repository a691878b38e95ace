//! Forwarding a reduction as it is computed (NCCL's `recvReduceSend`): when a ring step reduces
//! a received chunk into its buffer and the next step sends exactly those bytes on, the engine
//! copies each small block of the result into the next link's memory right after computing
//! it, while the block is still in the first-level cache, instead of reading the whole chunk
//! back once its reduction is done. The send stream is unchanged (the same bytes in the same
//! order); only when they are written differs.
//!
//! A forward happens only while it is safe and in order: the send is the next one due on its
//! link, nothing of it went out otherwise, and the link has room now. Without room the
//! receive goes on unforwarded (waiting for room could deadlock two ranks whose rings are both
//! full) and the send's rest leaves the usual way once the reduction is done.

use super::*;

/// No forwarding send.
pub(super) const NONE: usize = usize::MAX;

/// Bytes reduced before they are copied on: well inside a core's first-level data cache.
const BLOCK: usize = 8 << 10;

/// Least room worth a forward: an element of any type fits.
const MIN_ROOM: usize = 16;

/// For every step of `plan` (reusing `fwd`'s memory), the send step that forwards the bytes the
/// step reduces, or [`NONE`]: a send whose one dependency is a receive that reduces into
/// exactly the bytes it sends (a ring passing a partial sum on, or its last reduction starting
/// the all-gather). Not the final reduction of an `Avg`, whose bytes change once more (the
/// division) after the reduction.
pub(super) fn forwards(plan: &Plan, calls: &[Call], mut fwd: Vec<usize>) -> Vec<usize> {
    fwd.clear();
    fwd.resize(plan.nodes.len(), NONE);
    for (j, node) in plan.nodes.iter().enumerate() {
        let (Step::Send { src, .. }, &[i]) = (&node.step, node.deps.as_slice()) else { continue };
        let Some(Step::Recv { dst, action, .. }) = plan.nodes.get(i).map(|n| &n.step) else { continue };
        let avg = calls.get(dst.call).is_some_and(|c| c.op == ReduceOp::Avg);
        let reduces = match action {
            Action::Reduce { .. } => true,
            Action::ReduceFinal { .. } => !avg,
            Action::Store => false,
        };
        if reduces && dst == src && fwd[i] == NONE {
            fwd[i] = j;
        }
    }
    fwd
}

/// Where the next reduced bytes of a receive step go besides its destination.
#[derive(Clone, Copy)]
pub(super) struct Forward {
    /// The link's peer.
    peer: usize,
    /// The send step.
    step: usize,
    /// Free bytes at the link's write position.
    out: *mut u8,
    /// How many (at most what the send has left).
    pub(super) room: usize,
}

impl Forward {
    /// The free bytes' start.
    pub(super) fn out(&self) -> *mut u8 {
        self.out
    }
}

impl Exec<'_, '_> {
    /// The forward of receive step `i`'s bytes from `off` on, when it may happen now: its send
    /// is the next one due on its link, has sent exactly the bytes before `off` (all by
    /// forwarding), its link's signature is out, and the link has room in place.
    pub(super) fn forward_to(&mut self, i: usize, off: usize) -> Option<Forward> {
        let j = self.fwd.get(i).copied().filter(|&j| j != NONE)?;
        let Step::Send { peer, src } = self.plan.nodes[j].step else { return None };
        let sent = match self.state[j] {
            State::Pending => 0,
            State::Moving(k) => k,
            _ => return None,
        };
        if sent != off || self.sends[peer].front() != Some(&j) {
            return None;
        }
        if self.ctx.sigs.as_deref().is_some_and(|x| !x.pending_out(peer).is_empty()) {
            return None;
        }
        let (out, room) = self.ctx.links[peer].as_mut()?.forward_space()?;
        (room >= MIN_ROOM).then_some(Forward { peer, step: j, out, room: room.min(src.len - off) })
    }

    /// Sends the `n` bytes forwarded at `off` (written at `f.out`), finishing the send when they
    /// are its last.
    pub(super) fn forwarded(&mut self, f: Forward, off: usize, n: usize) {
        if n == 0 {
            return;
        }
        let Step::Send { src, .. } = self.plan.nodes[f.step].step else { unreachable!("forwards are sends") };
        let end = off + n;
        if let Some(l) = self.ctx.links[f.peer].as_mut() {
            l.forward_publish(n, end < src.len);
        }
        if end == src.len {
            self.sends[f.peer].pop_front();
            self.done(f.step);
        } else {
            self.state[f.step] = State::Moving(end);
        }
    }
}

/// Reduces the incoming bytes `a` then `b` into `dst` (as [`reduce_elems`]) in blocks of
/// [`BLOCK`], copying each block of the result to `out` right after computing it; returns the
/// bytes used.
///
/// # Safety
/// As [`reduce_elems`] for `a.len() + b.len()` bytes; `out` must be writable for as many bytes
/// and overlap none of the others.
pub(super) unsafe fn reduce_forward(
    dtype: DataType,
    op: ReduceOp,
    dst: *mut u8,
    with: *const u8,
    a: &[u8],
    b: &[u8],
    out: *mut u8,
) -> usize {
    let mut used = 0;
    loop {
        let (x, y) = if used < a.len() {
            let end = (used + BLOCK).min(a.len());
            (&a[used..end], if end == a.len() { b } else { &[][..] })
        } else {
            let from = used - a.len();
            if from >= b.len() {
                break;
            }
            (&b[from..(from + BLOCK).min(b.len())], &[][..])
        };
        // SAFETY: bytes `used..` of `dst`/`with` lie within the caller's `a.len() + b.len()`
        // bytes, and `x`, `y` are what is left of `a`, `b` from `used` on.
        let n = unsafe { reduce_elems(dtype, op, dst.add(used), with.add(used), x, y) };
        if n == 0 {
            break;
        }
        // SAFETY: the `n` bytes were just written at `dst + used`; `out` is writable for them
        // and overlaps nothing else (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(dst.add(used), out.add(used), n) };
        used += n;
    }
    used
}
