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
pub(super) fn forwards(plan: &Plan, calls: &[Operands], mut fwd: Vec<usize>) -> Vec<usize> {
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
    pub(super) out: *mut u8,
    /// How many (at most what the send has left).
    pub(super) room: usize,
}

impl Exec<'_, '_> {
    /// The forward of receive step `i`'s bytes from `off` on, when it may happen now: its send
    /// is the next one due on its link, has sent exactly the bytes before `off` (all by
    /// forwarding), its link's signature is out, and the link has room in place. Earlier sends
    /// of that link that are ready go out first, as the engine's next round would send them: a
    /// rank whose peer runs ahead receives the peer's next chunk before its own send of that
    /// chunk left, and without this the chunk's reduction would not be forwarded.
    pub(super) fn forward_to(&mut self, i: usize, off: usize) -> Result<Option<Forward>> {
        let Some(j) = self.fwd.get(i).copied().filter(|&j| j != NONE) else { return Ok(None) };
        let Step::Send { peer, src } = self.plan.nodes[j].step else { return Ok(None) };
        let sent = match self.state[j] {
            State::Pending => 0,
            State::Moving(k) => k,
            _ => return Ok(None),
        };
        if sent != off {
            return Ok(None);
        }
        if self.sends[peer].front() != Some(&j) {
            self.progress_sends_to(peer)?;
            if self.sends[peer].front() != Some(&j) {
                return Ok(None);
            }
        }
        if self.ctx.sigs.as_deref().is_some_and(|x| !x.pending_out(peer).is_empty()) {
            return Ok(None);
        }
        let Some((out, room)) = self.ctx.links[peer].as_mut().and_then(|l| l.forward_space()) else { return Ok(None) };
        Ok((room >= MIN_ROOM).then_some(Forward { peer, step: j, out, room: room.min(src.len - off) }))
    }

    /// Sends the `n` bytes forwarded at `off` (written at `f.out`), finishing the send when they
    /// are its last.
    pub(super) fn forwarded(&mut self, f: Forward, off: usize, n: usize) {
        if n == 0 {
            return;
        }
        let Step::Send { src, .. } = self.plan.nodes[f.step].step else { unreachable!("forwards are sends") };
        #[cfg(test)]
        tests::FORWARDED.with(|c| c.set(c.get() + n));
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
        // and overlaps nothing else (the caller's contract); both views end with this block.
        let (from, to) =
            unsafe { (std::slice::from_raw_parts(dst.add(used), n), std::slice::from_raw_parts_mut(out.add(used), n)) };
        crate::transport::copy::copy(to, from);
        used += n;
    }
    used
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::ring;
    use crate::transport::shm::ShmLink;

    thread_local! {
        /// Bytes this thread's engine runs forwarded.
        pub(super) static FORWARDED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn call(op: ReduceOp) -> Operands {
        let bufs = Buffers { send: std::ptr::null(), send_len: 0, recv: std::ptr::null_mut(), recv_len: 0 };
        Operands { bufs, dtype: DataType::Float32, op }
    }

    /// The sends each plan's receives forward, as (receive, send) pairs.
    fn pairs(plan: &Plan, op: ReduceOp) -> Vec<(usize, usize)> {
        let fwd = forwards(plan, &[call(op)], Vec::new());
        fwd.iter().enumerate().filter(|(_, &j)| j != NONE).map(|(i, &j)| (i, j)).collect()
    }

    #[test]
    fn ring_reductions_forward_the_send_of_their_own_result() {
        for n in [2, 3, 5] {
            for ahead in [0, usize::MAX] {
                let plan = ring::all_reduce_ahead(1, n, 1000, 4, 256, ahead);
                let found = pairs(&plan, ReduceOp::Sum);
                // Every send of a reduced chunk (all but the first step's, which reads the input)
                // is forwarded by the receive it depends on, and sends exactly that receive's bytes.
                let reduced_sends = plan
                    .nodes
                    .iter()
                    .filter(|x| matches!(x.step, Step::Send { src, .. } if src.buf == crate::algo::Buf::Recv))
                    .filter(|x| {
                        x.deps.len() == 1
                            && matches!(plan.nodes[x.deps[0]].step, Step::Recv { action, .. } if action != Action::Store)
                    })
                    .count();
                assert!(reduced_sends > 0);
                assert_eq!(found.len(), reduced_sends, "n={n} ahead={ahead}");
                for (i, j) in found {
                    let (Step::Recv { dst, action, .. }, Step::Send { src, .. }) =
                        (&plan.nodes[i].step, &plan.nodes[j].step)
                    else {
                        panic!("forward {i} -> {j} is not a receive forwarding a send");
                    };
                    assert!(action != &Action::Store && dst == src && plan.nodes[j].deps == vec![i]);
                }
            }
        }
    }

    #[test]
    fn an_average_forwards_only_partial_sums() {
        // Two ranks: the one reduction is the final one, whose bytes are divided afterwards.
        let plan = ring::all_reduce_ahead(0, 2, 1000, 4, 256, 0);
        assert!(!pairs(&plan, ReduceOp::Sum).is_empty());
        assert!(pairs(&plan, ReduceOp::Avg).is_empty());
        // Three ranks: the first reduce-scatter step's partial sums still go on as computed.
        let plan = ring::all_reduce_ahead(0, 3, 1000, 4, 256, 0);
        let avg = pairs(&plan, ReduceOp::Avg);
        assert!(!avg.is_empty() && avg.len() < pairs(&plan, ReduceOp::Sum).len());
        assert!(avg
            .iter()
            .all(|&(i, _)| matches!(plan.nodes[i].step, Step::Recv { action: Action::Reduce { .. }, .. })));
    }

    #[test]
    fn blocks_reduce_and_copy_every_byte_across_a_wrapped_ring() {
        // Incoming bytes split unevenly in two (a ring's wrap), one element straddling the split.
        let n = 3 * BLOCK / 4 + 5;
        let mine: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let theirs: Vec<f32> = (0..n).map(|i| (i * 3) as f32 + 0.5).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&theirs);
        let (a, b) = bytes.split_at(BLOCK + 6);
        let mut dst = vec![0f32; n];
        let mut out = vec![0f32; n];
        // SAFETY: `dst`, `mine` and `out` hold `n` floats each and are distinct vectors; `a` and
        // `b` are `n` floats of bytes together.
        let used = unsafe {
            reduce_forward(
                DataType::Float32,
                ReduceOp::Sum,
                dst.as_mut_ptr().cast(),
                mine.as_ptr().cast(),
                a,
                b,
                out.as_mut_ptr().cast(),
            )
        };
        assert_eq!(used, 4 * n);
        for i in 0..n {
            let want = (i as f64) + (i * 3) as f64 + 0.5;
            assert_eq!((dst[i] as f64, out[i] as f64), (want, want), "element {i}");
        }
    }

    /// Runs rank `rank`'s half of a 2-rank ring all-reduce (NCCL's chunk order, 32 KiB chunks)
    /// of `input` over `link`; returns the result and the bytes this rank forwarded.
    fn pair_rank(rank: usize, link: ShmLink, input: Vec<f32>) -> (Vec<f32>, usize) {
        let plan = ring::all_reduce_ahead(rank, 2, input.len(), 4, 32 << 10, 0);
        let mut out = vec![0f32; input.len()];
        let mut links: Vec<Option<Box<dyn Link>>> = vec![None, None];
        links[1 - rank] = Some(Box::new(link));
        let (abort, mut staging, mut scratch) = (AtomicBool::new(false), Vec::new(), Vec::new());
        let bytes = input.len() * 4;
        let bufs =
            Buffers { send: input.as_ptr().cast(), send_len: bytes, recv: out.as_mut_ptr().cast(), recv_len: bytes };
        let calls = [Operands { bufs, dtype: DataType::Float32, op: ReduceOp::Sum }];
        let ctx = Ctx {
            rank,
            nranks: 2,
            links: &mut links,
            notifier: None,
            abort: &abort,
            timeout: Duration::from_secs(60),
            what: "all_reduce",
            staging: &mut staging,
            scratch: &mut scratch,
            spin: crate::wait::Spin::for_load(2, 2, None),
            sigs: None,
        };
        FORWARDED.with(|c| c.set(0));
        // SAFETY: `input` and `out` are live, distinct and `bytes` long for the whole run, and
        // nothing else touches them meanwhile.
        unsafe { run(&plan, &calls, ctx) }.expect("all-reduce");
        (out, FORWARDED.with(|c| c.get()))
    }

    #[test]
    fn every_reduced_chunk_of_a_pair_is_forwarded_whichever_rank_runs_ahead() {
        // 64 chunks of 32 KiB per half. Each rank's send of chunk c+1 waits behind the forward
        // of chunk c, so at most a few chunks are in flight on the 1 MiB rings: every chunk's
        // reduction finds room, and must forward even when the peer's chunk arrives before the
        // rank's own send of it left (the peer running ahead, which two threads do at random).
        let count = 1 << 20;
        let inputs: Vec<Vec<f32>> =
            (0..2).map(|r| (0..count).map(|i| ((i * 7 + r * 13) % 1001) as f32 - 500.0).collect()).collect();
        let (a, b) = ShmLink::pair_with(1 << 20, None).unwrap();
        let results: Vec<(Vec<f32>, usize)> = std::thread::scope(|s| {
            let h: Vec<_> = [a, b]
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let input = inputs[r].clone();
                    s.spawn(move || pair_rank(r, l, input))
                })
                .collect();
            h.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (out, forwarded)) in results.iter().enumerate() {
            for (i, &x) in out.iter().enumerate() {
                let want = inputs[0][i] as f64 + inputs[1][i] as f64;
                assert_eq!(x as f64, want, "rank {r} element {i}");
            }
            // The half a rank reduces goes to its peer only by forwarding.
            assert_eq!(*forwarded, count / 2 * 4, "rank {r} forwarded");
        }
    }
}
