//! The safe Rust API on in-memory ranks: typed collectives (f32, f16, bf16, i64, u8), group
//! calls (send/recv rings, all-to-all written with sends and receives, sends to oneself, groups
//! spanning several communicators driven by one thread), and argument errors. Expected values
//! are computed here with plain arithmetic from each rank's inputs.

use half::{bf16, f16};
use oxccl::{Collectives, Communicator, ErrorKind, ReduceOp};

/// Runs `f(comm)` on every rank of an `n`-rank in-memory communicator, one thread each.
fn on_ranks<R: Send>(n: usize, f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    let comms = Communicator::in_memory(n);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Rank `r`'s input element `i`: small integers, exact in every type used here.
fn val(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 11) as f32 - 5.0
}

#[test]
fn typed_collectives_of_every_shape() {
    let n = 4;
    on_ranks(n, |c| {
        let (r, c2) = (c.rank(), 3);
        let mine: Vec<f32> = (0..c2).map(|i| val(r, i)).collect();
        // all_gather: block p is rank p's input.
        let mut all = vec![0f32; n * c2];
        c.all_gather(&mine, &mut all).unwrap();
        for p in 0..n {
            assert_eq!(&all[p * c2..(p + 1) * c2], &(0..c2).map(|i| val(p, i)).collect::<Vec<_>>()[..]);
        }
        // reduce_scatter: block r of the element-wise sum of every rank's n*c2 inputs.
        let big: Vec<f32> = (0..n * c2).map(|i| val(r, i)).collect();
        let mut part = vec![0f32; c2];
        c.reduce_scatter(&big, &mut part, ReduceOp::Sum).unwrap();
        for (i, x) in part.iter().enumerate() {
            assert_eq!(*x, (0..n).map(|p| val(p, r * c2 + i)).sum::<f32>());
        }
        // In place: the same, on one buffer.
        let mut buf = big.clone();
        c.reduce_scatter_in_place(&mut buf, ReduceOp::Max).unwrap();
        for i in 0..c2 {
            assert_eq!(buf[r * c2 + i], (0..n).map(|p| val(p, r * c2 + i)).fold(f32::MIN, f32::max));
        }
        // broadcast and reduce with root 2, half precision.
        let mut h: Vec<f16> = (0..5).map(|i| f16::from_f32(val(r, i))).collect();
        c.broadcast_in_place(&mut h, 2).unwrap();
        assert!(h.iter().enumerate().all(|(i, x)| x.to_f32() == val(2, i)));
        let src: Vec<bf16> = (0..5).map(|i| bf16::from_f32(val(r, i))).collect();
        let mut dst = if r == 2 { vec![bf16::ZERO; 5] } else { Vec::new() };
        c.reduce(&src, &mut dst, ReduceOp::Sum, 2).unwrap();
        if r == 2 {
            assert!(dst.iter().enumerate().all(|(i, x)| x.to_f32() == (0..n).map(|p| val(p, i)).sum::<f32>()));
        }
        // all_to_all of i64: block p of rank r's output is block r of rank p's input.
        let send: Vec<i64> = (0..n * 2).map(|i| (r * 100 + i) as i64).collect();
        let mut recv = vec![0i64; n * 2];
        c.all_to_all(&send, &mut recv).unwrap();
        for p in 0..n {
            assert_eq!(&recv[p * 2..p * 2 + 2], &[(p * 100 + r * 2) as i64, (p * 100 + r * 2 + 1) as i64]);
        }
        // gather / scatter of bytes at root 1.
        let mut g = if r == 1 { vec![0u8; n] } else { Vec::new() };
        c.gather(&[r as u8 + 10], &mut g, 1).unwrap();
        if r == 1 {
            assert_eq!(g, (0..n).map(|p| p as u8 + 10).collect::<Vec<_>>());
        }
        let table: Vec<u8> = if r == 1 { (0..n as u8).map(|p| p * 3).collect() } else { Vec::new() };
        let mut one = [0u8];
        c.scatter(&table, &mut one, 1).unwrap();
        assert_eq!(one[0], r as u8 * 3);
        // all_reduce average of f32, through the inherent method.
        let mut avg = [0f32; 3];
        c.all_reduce(&mine, &mut avg, ReduceOp::Avg).unwrap();
        for (i, x) in avg.iter().enumerate() {
            assert_eq!(*x, (0..n).map(|p| val(p, i)).sum::<f32>() / n as f32);
        }
    });
}

#[test]
fn group_ring_exchange_and_alltoall_by_send_recv() {
    for n in [1, 2, 3, 5, 8] {
        on_ranks(n, |c| {
            let (r, len) = (c.rank(), 1000);
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            // Everyone sends right and receives from the left; without a group every rank would
            // wait in its send for a receive nobody posts yet (for messages past the pipes).
            let mine: Vec<f64> = (0..len).map(|i| (r * len + i) as f64).collect();
            let mut got = vec![0f64; len];
            c.group(|g| {
                g.send(&mine, right)?;
                g.recv(&mut got, left)
            })
            .unwrap();
            assert!(got.iter().enumerate().all(|(i, x)| *x == (left * len + i) as f64));
            // All-to-all with sends and receives, including to itself, in one group.
            let send: Vec<u32> = (0..n * 4).map(|i| (r * 1000 + i) as u32).collect();
            let mut recv = vec![0u32; n * 4];
            c.group(|g| {
                for (p, chunk) in recv.chunks_mut(4).enumerate() {
                    g.recv(chunk, p)?;
                }
                for p in 0..n {
                    g.send(&send[p * 4..p * 4 + 4], p)?;
                }
                Ok(())
            })
            .unwrap();
            for p in 0..n {
                let want: Vec<u32> = (0..4).map(|k| (p * 1000 + r * 4 + k) as u32).collect();
                assert_eq!(&recv[p * 4..p * 4 + 4], &want[..], "rank {r} from {p}");
            }
        });
    }
}

#[test]
fn in_place_ring_exchange_stages_the_receive() {
    // Send and receive the same buffer: the incoming bytes must not overwrite the outgoing
    // ones before they left, whatever the size.
    for len in [1usize, 100, 300_000] {
        on_ranks(3, |c| {
            let (r, n) = (c.rank(), 3);
            let mut buf: Vec<i32> = (0..len).map(|i| (r * 7 + i) as i32).collect();
            let p = buf.as_mut_ptr().cast::<u8>();
            // SAFETY: the buffer holds `len` i32s for the whole group and nothing else uses it.
            let (s, v) = unsafe {
                let s = c
                    .prepare(
                        oxccl::Collective::Send { peer: (r + 1) % n },
                        p,
                        std::ptr::null_mut(),
                        len,
                        oxccl::DataType::Int32,
                        ReduceOp::Sum,
                    )
                    .unwrap();
                let v = c
                    .prepare(
                        oxccl::Collective::Recv { peer: (r + n - 1) % n },
                        std::ptr::null(),
                        p,
                        len,
                        oxccl::DataType::Int32,
                        ReduceOp::Sum,
                    )
                    .unwrap();
                (s, v)
            };
            oxccl::group::run(vec![(c, s), (c, v)]).unwrap();
            let left = (r + n - 1) % n;
            assert!(buf.iter().enumerate().all(|(i, x)| *x == (left * 7 + i) as i32), "rank {r} len {len}");
        });
    }
}

#[test]
fn one_thread_drives_every_rank_in_one_group() {
    let n = 4;
    let comms = Communicator::in_memory(n);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..64).map(|i| val(r, i)).collect()).collect();
    let mut bufs = inputs.clone();
    let mut gathered: Vec<Vec<f32>> = vec![vec![0f32; 64 * n]; n];
    oxccl::group(|g| {
        for (((c, input), b), out) in comms.iter().zip(&inputs).zip(bufs.iter_mut()).zip(gathered.iter_mut()) {
            g.on(c).all_gather(input, out)?;
            g.on(c).all_reduce_in_place(b, ReduceOp::Sum)?;
        }
        Ok(())
    })
    .unwrap();
    for r in 0..n {
        for i in 0..64 {
            assert_eq!(bufs[r][i], (0..n).map(|p| val(p, i)).sum::<f32>());
            assert_eq!(gathered[r][(r + 1) % n * 64 + i], val((r + 1) % n, i));
        }
    }
}

#[test]
fn self_send_pairs_and_errors() {
    on_ranks(2, |c| {
        let r = c.rank();
        // A send to oneself pairs with a receive from oneself in the same group.
        let mine = [r as u64 + 40, 2];
        let mut back = [0u64; 2];
        c.group(|g| {
            g.send(&mine, r)?;
            g.recv(&mut back, r)
        })
        .unwrap();
        assert_eq!(back, mine);
        // Unpaired, or paired with a different size: invalid usage (nothing else runs on the
        // peer, so this does not leave it waiting).
        let e = c.send(&mine, r).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        let mut short = [0u64; 1];
        let e = c.group(|g| {
            g.send(&mine, r)?;
            g.recv(&mut short, r)
        });
        assert_eq!(e.unwrap_err().kind(), ErrorKind::InvalidUsage);
    });
}

#[test]
fn invalid_arguments_are_reported_and_the_group_still_runs() {
    on_ranks(3, |c| {
        let r = c.rank();
        let x = [1f32; 4];
        let mut y = [0f32; 4];
        let e = c.broadcast(&x, &mut y, 3).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("root 3"), "{e}");
        assert!(c.last_error().contains("root 3"));
        let mut wrong = [0f32; 5];
        assert_eq!(c.all_reduce(&x, &mut wrong, ReduceOp::Sum).unwrap_err().kind(), ErrorKind::InvalidArgument);
        let mut not_blocks = [0f32; 4];
        assert_eq!(c.all_to_all_in_place(&mut not_blocks[..]).unwrap_err().kind(), ErrorKind::InvalidArgument);
        // Overlapping buffers that are not NCCL's in-place layout.
        let mut buf = [0f32; 8];
        let p = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: the buffer holds 8 floats; the call is refused before touching it.
        let e = unsafe { c.all_reduce_raw(p, p.add(4), 4, oxccl::DataType::Float32, ReduceOp::Sum) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        // Inside a group the bad call fails alone; the good one still runs at the end.
        let mut sum = [0f32; 4];
        let res = c.group(|g| {
            let bad = g.send(&x, 7);
            assert_eq!(bad.unwrap_err().kind(), ErrorKind::InvalidArgument);
            g.all_reduce(&x, &mut sum, ReduceOp::Sum)
        });
        res.unwrap();
        assert_eq!(sum, [3.0; 4], "rank {r}");
        // A closure that fails still runs what it queued, then returns its error.
        let mut sum2 = [0f32; 4];
        let res: oxccl::Result<()> = c.group(|g| {
            g.all_reduce(&x, &mut sum2, ReduceOp::Sum)?;
            Err(oxccl::Error::invalid_usage("stop"))
        });
        assert_eq!(res.unwrap_err().message(), "stop");
        assert_eq!(sum2, [3.0; 4]);
    });
}

#[test]
fn blocking_send_and_recv_outside_a_group() {
    on_ranks(2, |c| {
        let data: Vec<u32> = (0..50_000).collect();
        if c.rank() == 0 {
            c.send(&data, 1).unwrap();
        } else {
            let mut got = vec![0u32; data.len()];
            c.recv(&mut got, 0).unwrap();
            assert_eq!(got, data);
        }
    });
}
