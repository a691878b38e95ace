//! The one-shot CUDA IPC path for every collective but all-reduce (which has its own flow in
//! `ipc.rs`): broadcast, reduce, all-gather, reduce-scatter, all-to-all, gather and scatter
//! between the ranks of one host, entirely on the GPU and ordered on the internal stream.
//!
//! A call runs in chunks. For each chunk, on the stream:
//!
//! 1. every rank copies the part of its send buffer the peers need into its own input area
//!    (the first half of its IPC region; for all-to-all, scatter and reduce-scatter one block
//!    per destination rank);
//! 2. barrier 0 (as in `ipc.rs`): every rank's input area for this chunk is complete;
//! 3. every rank pulls what it receives straight from the peers' mapped input areas into its
//!    receive buffer (a device-to-device copy per peer), or, for reduce and reduce-scatter,
//!    reduces the peers' input areas into its receive buffer with the reduction kernels; its
//!    own block is copied send → receive directly (nothing to do in place);
//! 4. barrier 1: nobody reads a peer's input area after it, so the next chunk's step 1 can
//!    overwrite it.
//!
//! Each rank's data thus crosses one device copy into its own region and one out of it, with no
//! host copy and no host thread in between (the staged path makes two host copies and runs the
//! host plan on the proxy thread). The chunk steps are a pure function ([`chunks`]), unit-tested
//! here on host memory for every collective, in and out of place.
//!
//! Which path a call takes is [`choose`]'s decision (send/receive: the exchange of `p2p.rs`;
//! PreMulSum with a host factor on reduce and reduce-scatter scales the staged bytes in the
//! input area before barrier 0; other PreMulSum calls stay on the staged path). A group runs its calls one after another on the
//! internal stream, each through its own flow, when every one of them has an IPC flow.

use super::exec::{DevOp, Scale};
use super::ipc::Ipc;
use super::{ops, Gpu};
use crate::algo::Collective;
use crate::error::Result;
use crate::types::ReduceOp;

/// One step of a chunk, in bytes relative to the buffers named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Before barrier 0: send buffer at `from` → this rank's input area at `to`.
    Stage { from: usize, to: usize, len: usize },
    /// Between the barriers: rank `q`'s input area at `from` → receive buffer at `to`.
    Pull { q: usize, from: usize, to: usize, len: usize },
    /// Between the barriers: this rank's send buffer at `from` → its receive buffer at `to`
    /// (nothing when they are the same bytes, as in NCCL's in-place layouts).
    Local { from: usize, to: usize, len: usize },
    /// Between the barriers: receive buffer at `to` = every rank's input area at `from`,
    /// reduced (rank order 0, 1, ..., as the all-reduce flow does).
    Reduce { from: usize, to: usize, len: usize },
}

/// One chunk: what runs before barrier 0 and what runs between the barriers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) pre: Vec<Step>,
    pub(crate) post: Vec<Step>,
}

use crate::algo::select::oneshot_blocks as blocks;
/// Which device flow a call takes ([`crate::algo::select::device_flow`] decides).
pub(crate) use crate::algo::select::DeviceFlow as Path;

/// [`crate::algo::select::device_flow`] for `op`, with `ipc` as `Some((ranks, area))` in IPC
/// mode.
#[cfg(test)]
fn choose(op: &DevOp, ipc: Option<(usize, usize)>) -> Path {
    let (n, area) = ipc.map_or((0, None), |(n, a)| (n, Some(a)));
    crate::algo::select::device_flow(&op.shape(), n, area)
}

/// The chunk steps of `coll` on rank `rank` of `n` for `count` elements of `es` bytes, with an
/// input area of `area` bytes, which must hold one element per staged block
/// ([`crate::algo::select::device_flow`] checks it; otherwise no chunk is made). Every rank gets the same number of chunks (barriers pair by
/// sequence number), at least one for a non-empty call.
pub(crate) fn chunks(coll: Collective, rank: usize, n: usize, count: usize, es: usize, area: usize) -> Vec<Chunk> {
    let c_max = area / (blocks(coll, n) * es);
    if c_max == 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut first = 0;
    while first < count {
        let c = c_max.min(count - first);
        let (at, len, blk) = (first * es, c * es, count * es);
        let mut ch = Chunk::default();
        match coll {
            Collective::Broadcast { root } => {
                if rank == root {
                    ch.pre.push(Step::Stage { from: at, to: 0, len });
                    ch.post.push(Step::Local { from: at, to: at, len });
                } else {
                    ch.post.push(Step::Pull { q: root, from: 0, to: at, len });
                }
            }
            Collective::Reduce { root } => {
                ch.pre.push(Step::Stage { from: at, to: 0, len });
                if rank == root {
                    ch.post.push(Step::Reduce { from: 0, to: at, len });
                }
            }
            Collective::AllGather | Collective::Gather { .. } => {
                let receives = match coll {
                    Collective::Gather { root } => rank == root,
                    _ => true,
                };
                ch.pre.push(Step::Stage { from: at, to: 0, len });
                if receives {
                    for q in 0..n {
                        ch.post.push(if q == rank {
                            Step::Local { from: at, to: q * blk + at, len }
                        } else {
                            Step::Pull { q, from: 0, to: q * blk + at, len }
                        });
                    }
                }
            }
            Collective::AllToAll => {
                for d in (0..n).filter(|&d| d != rank) {
                    ch.pre.push(Step::Stage { from: d * blk + at, to: d * len, len });
                }
                for q in 0..n {
                    ch.post.push(if q == rank {
                        Step::Local { from: q * blk + at, to: q * blk + at, len }
                    } else {
                        Step::Pull { q, from: rank * len, to: q * blk + at, len }
                    });
                }
            }
            Collective::Scatter { root } => {
                if rank == root {
                    for d in (0..n).filter(|&d| d != rank) {
                        ch.pre.push(Step::Stage { from: d * blk + at, to: d * len, len });
                    }
                    ch.post.push(Step::Local { from: rank * blk + at, to: at, len });
                } else {
                    ch.post.push(Step::Pull { q: root, from: rank * len, to: at, len });
                }
            }
            Collective::ReduceScatter => {
                for d in 0..n {
                    ch.pre.push(Step::Stage { from: d * blk + at, to: d * len, len });
                }
                ch.post.push(Step::Reduce { from: rank * len, to: at, len });
            }
            Collective::AllReduce | Collective::Send { .. } | Collective::Recv { .. } => {}
        }
        out.push(ch);
        first += c;
    }
    out
}

impl Ipc {
    /// Enqueues a call [`choose`] sent here on the internal stream (context current, n ≥ 2).
    /// A failure to enqueue fails the communicator, as for the all-reduce.
    ///
    /// # Safety
    /// `op.send` / `op.recv` must be device addresses on this GPU holding what the collective
    /// uses on this rank ([`Collective::buffer_counts`]), valid until the stream has run the
    /// call; in NCCL's in-place layout or not overlapping.
    pub(crate) unsafe fn collective(&mut self, gpu: &Gpu, op: &DevOp) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        self.guarded(|ipc| unsafe { ipc.enqueue_oneshot(gpu, op) })
    }

    /// # Safety
    /// As [`Ipc::collective`].
    unsafe fn enqueue_oneshot(&mut self, gpu: &Gpu, op: &DevOp) -> Result<()> {
        let (me, n, es) = (self.rank(), self.size(), op.dtype.size());
        let stream = self.stream();
        let plan = chunks(op.coll, me, n, op.count, es, self.half());
        let (send, recv) = (op.send, op.recv);
        for ch in &plan {
            let s = self.next_seq();
            for st in &ch.pre {
                if let Step::Stage { from, to, len } = *st {
                    // SAFETY: inside the send buffer (the contract) and this rank's input area
                    // (`chunks` keeps every chunk within `half` bytes).
                    unsafe { ops::copy(self.input(me) + to as u64, send + from as u64, len, stream)? };
                    if let Some(Scale::Host(f)) = op.scale {
                        let at = self.input(me) + to as u64;
                        // SAFETY: the staged bytes just copied, in this rank's input area.
                        unsafe { ops::scale(gpu, at, at, (len / es) as u64, op.dtype, f, stream)? };
                    }
                }
            }
            self.barrier(0, s, stream)?;
            for st in &ch.post {
                // SAFETY (every arm): inside the call's buffers (the contract) or a mapped input
                // area; peers' areas are complete (barrier 0) and stay so until barrier 1.
                match *st {
                    Step::Pull { q, from, to, len } => unsafe {
                        ops::copy(recv + to as u64, self.input(q) + from as u64, len, stream)?
                    },
                    Step::Local { from, to, len } => unsafe {
                        ops::copy(recv + to as u64, send + from as u64, len, stream)?
                    },
                    Step::Reduce { from, to, len } => unsafe {
                        let (dst, k) = (recv + to as u64, (len / es) as u64);
                        let div = |q: usize| if op.op == ReduceOp::Avg && q == n - 1 { n as u32 } else { 1 };
                        let at = |q: usize| self.input(q) + from as u64;
                        ops::reduce(gpu, dst, at(0), at(1), k, op.dtype, op.op, div(1), stream)?;
                        for q in 2..n {
                            ops::reduce(gpu, dst, dst, at(q), k, op.dtype, op.op, div(q), stream)?;
                        }
                    },
                    Step::Stage { .. } => {}
                }
            }
            self.barrier(1, s, stream)?;
        }
        self.finish_call(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::exec::Scale;

    /// Runs the chunk steps of every rank on host memory (each rank one buffer holding its send
    /// and receive areas at the given offsets, and an input area), barrier by barrier, with i64
    /// sums; returns each rank's buffer.
    fn simulate(coll: Collective, n: usize, count: usize, area_elems: usize, in_place: bool) -> Vec<Vec<i64>> {
        let blk = count;
        // Offsets (elements) of send and receive in each rank's buffer.
        let place = |r: usize| -> (usize, usize) {
            if !in_place {
                return (0, n * blk);
            }
            match coll {
                Collective::AllGather => (r * blk, 0),
                Collective::Gather { root } if root == r => (r * blk, 0),
                Collective::ReduceScatter => (0, r * blk),
                Collective::Scatter { root } if root == r => (0, r * blk),
                _ => (0, 0),
            }
        };
        let mut mem: Vec<Vec<i64>> = (0..n)
            .map(|r| {
                let mut v = vec![-1i64; 2 * n * blk];
                let (s, _) = place(r);
                let (sc, _) = coll.buffer_counts(r, n, count);
                for i in 0..sc {
                    v[s + i] = (1000 * (r + 1) + i) as i64;
                }
                v
            })
            .collect();
        let mut input: Vec<Vec<i64>> = vec![vec![0; area_elems]; n];
        let plans: Vec<Vec<Chunk>> = (0..n).map(|r| chunks(coll, r, n, count, 1, area_elems)).collect();
        let k = plans[0].len();
        assert!(plans.iter().all(|p| p.len() == k), "{coll:?}: chunk counts differ");
        let mut rounds: Vec<_> = plans.iter().map(|p| p.iter()).collect();
        for _ in 0..k {
            let round: Vec<&Chunk> = rounds.iter_mut().map(|i| i.next().unwrap()).collect();
            for r in 0..n {
                let (s, _) = place(r);
                for st in &round[r].pre {
                    let Step::Stage { from, to, len } = *st else { panic!("{st:?} before barrier 0") };
                    input[r][to..to + len].copy_from_slice(&mem[r][s + from..s + from + len]);
                }
            }
            for r in 0..n {
                let (s, d) = place(r);
                for st in &round[r].post {
                    match *st {
                        Step::Pull { q, from, to, len } => {
                            assert_ne!(q, r);
                            mem[r][d + to..d + to + len].copy_from_slice(&input[q][from..from + len]);
                        }
                        Step::Local { from, to, len } => {
                            let src = mem[r][s + from..s + from + len].to_vec();
                            mem[r][d + to..d + to + len].copy_from_slice(&src);
                        }
                        Step::Reduce { from, to, len } => {
                            for i in 0..len {
                                mem[r][d + to + i] = (0..n).map(|q| input[q][from + i]).sum();
                            }
                        }
                        Step::Stage { .. } => panic!("staging after barrier 0"),
                    }
                }
            }
        }
        (0..n).map(|r| mem[r][place(r).1..].to_vec()).collect()
    }

    #[test]
    fn one_shot_chunks_compute_every_collective_in_and_out_of_place() {
        // Independent reference: rank r's send element i is 1000 (r + 1) + i.
        let x = |r: usize, i: usize| (1000 * (r + 1) + i) as i64;
        for n in 2..=4 {
            for count in [1, 5, 13] {
                for area in [1, 3, 4, 64] {
                    for root in [0, n - 1] {
                        for coll in [
                            Collective::Broadcast { root },
                            Collective::Reduce { root },
                            Collective::AllGather,
                            Collective::ReduceScatter,
                            Collective::AllToAll,
                            Collective::Gather { root },
                            Collective::Scatter { root },
                        ] {
                            for in_place in [false, true] {
                                if blocks(coll, n) > area {
                                    assert!(chunks(coll, 0, n, count, 1, area).is_empty());
                                    continue;
                                }
                                let got = simulate(coll, n, count, area, in_place);
                                for (r, g) in got.iter().enumerate() {
                                    let want: Vec<i64> = match coll {
                                        Collective::Broadcast { root } => (0..count).map(|i| x(root, i)).collect(),
                                        Collective::Reduce { root } if r == root => {
                                            (0..count).map(|i| (0..n).map(|q| x(q, i)).sum()).collect()
                                        }
                                        Collective::AllGather => {
                                            (0..n * count).map(|j| x(j / count, j % count)).collect()
                                        }
                                        Collective::Gather { root } if r == root => {
                                            (0..n * count).map(|j| x(j / count, j % count)).collect()
                                        }
                                        Collective::ReduceScatter => {
                                            (0..count).map(|i| (0..n).map(|q| x(q, r * count + i)).sum()).collect()
                                        }
                                        Collective::AllToAll => {
                                            (0..n * count).map(|j| x(j / count, r * count + j % count)).collect()
                                        }
                                        Collective::Scatter { root } => {
                                            (0..count).map(|i| x(root, r * count + i)).collect()
                                        }
                                        _ => continue,
                                    };
                                    let what = format!(
                                        "{coll:?} n {n} count {count} area {area} in place {in_place} rank {r}"
                                    );
                                    assert_eq!(&g[..want.len()], &want[..], "{what}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_fit_the_area_and_the_choice_follows_the_mode() {
        let ch = chunks(Collective::AllToAll, 1, 4, 100, 4, 256);
        // 256 bytes / (4 blocks × 4 bytes) = 16 elements per chunk.
        assert_eq!(ch.len(), 7);
        for c in &ch {
            for s in &c.pre {
                let Step::Stage { to, len, .. } = *s else { panic!() };
                assert!(to + len <= 256);
            }
        }
        assert!(chunks(Collective::AllGather, 0, 2, 0, 4, 256).is_empty());
        let op = |coll, scale| DevOp {
            coll,
            send: 0,
            recv: 0,
            count: 1,
            dtype: crate::types::DataType::Float32,
            op: ReduceOp::Sum,
            scale,
        };
        let ipc = Some((4, 256));
        assert_eq!(choose(&op(Collective::AllGather, None), ipc), Path::OneShot);
        assert_eq!(choose(&op(Collective::AllGather, None), None), Path::Staged);
        assert_eq!(choose(&op(Collective::AllGather, None), Some((1, 256))), Path::Staged);
        // 4 blocks of one 4-byte element fit 16 bytes, not 15.
        assert_eq!(choose(&op(Collective::AllToAll, None), Some((4, 16))), Path::OneShot);
        assert_eq!(choose(&op(Collective::AllToAll, None), Some((4, 15))), Path::Staged);
        assert!(chunks(Collective::AllToAll, 0, 4, 10, 4, 15).is_empty());
        // PreMulSum: a host factor on reduce and reduce-scatter only.
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scale::Host(2.0))), ipc), Path::OneShot);
        assert_eq!(choose(&op(Collective::Reduce { root: 1 }, Some(Scale::Host(2.0))), ipc), Path::OneShot);
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scale::Device(64))), ipc), Path::Staged);
        assert_eq!(choose(&op(Collective::ReduceScatter, Some(Scale::Host(2.0))), None), Path::Staged);
        // Sends and receives: the exchange in IPC mode, when a block of the area (one per rank,
        // 64-byte aligned) holds an element.
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), ipc), Path::Exchange);
        assert_eq!(choose(&op(Collective::Recv { peer: 3 }, None), ipc), Path::Exchange);
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), None), Path::Staged);
        assert_eq!(choose(&op(Collective::Send { peer: 0 }, None), Some((4, 255))), Path::Staged);
        assert_eq!(choose(&op(Collective::AllReduce, None), None), Path::AllReduce);
        assert_eq!(choose(&op(Collective::AllReduce, Some(Scale::Host(2.0))), ipc), Path::Staged);
    }
}
