//! The compressed wire between hosts (`OXCCL_COMPRESS`, docs/COMPRESSION.md), with ranks as
//! processes on fake hosts (`OXCCL_HOSTID` per rank): shared memory within a host, TCP between.
//!
//! * one rank per host and two per host (hierarchical): bf16, fp8 and int8, sum and average,
//!   counts 1, 1000, 65537 and 1 Mi + 3, inputs over a wide dynamic range across blocks with zero
//!   blocks, and inf/NaN inputs: every element within the documented bound of the f64 sum (or
//!   the same non-finite value), every rank's result the same bits, in place and out of place;
//! * reduce-scatter and reduce, one and two ranks per host: within the bound; a reduce's root
//!   that leads its host (its lowest rank) holds the bits the compressed all-reduce gives, and
//!   the other ranks' buffers stay untouched;
//! * the same on device buffers (CUDA stand-in): the proxy's all-reduce and the staged
//!   reduce-scatter and reduce run the compressed host plans on pinned staging;
//! * two ranks on one host with `OXCCL_COMPRESS=bf16`: bitwise the results without it (links
//!   within a host stay exact).

mod common;

use oxccl::reduce::codec::Encoding;
use oxccl::{Collectives, Communicator, DataType, ReduceOp};
use std::time::Duration;

const COUNTS: [usize; 4] = [1, 1000, 65537, (1 << 20) + 3];

/// Rank `r`'s element `i`: a magnitude per 256-element block from 2^-40 to 2^40, both signs,
/// zero blocks, scattered zeros, and a few non-finite values.
fn input(r: usize, i: usize) -> f32 {
    let b = i / 256;
    let h = (i.wrapping_mul(2654435761) ^ r.wrapping_mul(40503)) % 1000;
    match (i, r) {
        (5, 0) | (777, 1) => return f32::INFINITY,
        (6, 1) => return f32::NEG_INFINITY,
        (7, 0) => return f32::NAN,
        (600, 0) => return f32::INFINITY,
        (600, 1) => return f32::NEG_INFINITY,
        _ => {}
    }
    if b % 7 == 3 || h % 13 == 0 {
        return 0.0;
    }
    let mag = 2f32.powi(((b * 37 + r * 11) % 81) as i32 - 40);
    let sign = if (i + r) % 3 == 0 { -1.0 } else { 1.0 };
    sign * mag * (0.25 + h as f32 / 1000.0)
}

/// Per element, over hosts, the largest finite sum of the host's magnitudes in the aligned
/// 256-blocks around it: an upper bound of every block maximum the encodings scale by.
fn window(hosts: &[usize], count: usize) -> Vec<f64> {
    let nh = hosts.iter().max().unwrap() + 1;
    let blocks = count.div_ceil(256);
    let mut w = vec![0f64; count];
    for h in 0..nh {
        let mut bmax = vec![0f64; blocks];
        for k in 0..count {
            let s: f64 = (0..hosts.len())
                .filter(|&r| hosts[r] == h)
                .map(|r| f64::from(input(r, k).abs()))
                .filter(|v| v.is_finite())
                .sum();
            bmax[k / 256] = bmax[k / 256].max(s);
        }
        for (j, v) in w.iter_mut().enumerate() {
            let b = j / 256;
            *v += bmax[b.saturating_sub(1)..(b + 2).min(blocks)].iter().fold(0f64, |a, &c| a.max(c))
                * (1.0 + 2f64.powi(-20));
        }
    }
    w
}

/// Checks `y` against the f64 reference and the bound of docs/COMPRESSION.md.
fn check(enc: Encoding, hosts: &[usize], y: &[f32], avg: bool) -> Result<(), String> {
    check_at(enc, hosts, y, avg, 0)
}

/// [`check`] for `y` holding the elements from `off` on (a reduce-scatter's block).
fn check_at(enc: Encoding, hosts: &[usize], y: &[f32], avg: bool, off: usize) -> Result<(), String> {
    let n = hosts.len();
    let w = window(hosts, off + y.len());
    let div = if avg { n as f64 } else { 1.0 };
    for (j, &got) in y.iter().enumerate() {
        let j = off + j;
        let xs: Vec<f64> = (0..n).map(|r| f64::from(input(r, j))).collect();
        let want = xs.iter().sum::<f64>() / div;
        if !want.is_finite() {
            if !(want.is_nan() && got.is_nan() || f64::from(got) == want) {
                return Err(format!("{enc:?} element {j}: {got}, exact {want}"));
            }
            continue;
        }
        let a: f64 = xs.iter().map(|x| x.abs()).sum();
        let q = match enc {
            Encoding::Exact => 0.0,
            Encoding::Bf16 => (2f64.powi(-7) + 2f64.powi(-14)) * a,
            Encoding::Fp8 => (2f64.powi(-3) + 2f64.powi(-7)) * a + 2f64.powi(-16) * w[j],
            Encoding::Int8 => w[j] / 126.0 * 1.01,
        };
        let lim = (q + (n + 2) as f64 * 2f64.powi(-23) * a + 2f64.powi(-130)) / div;
        let err = (f64::from(got) - want).abs();
        if err > lim {
            return Err(format!("{enc:?} avg={avg} element {j}: {got} vs {want}: error {err:e} > bound {lim:e}"));
        }
    }
    Ok(())
}

fn fnv(v: &[f32]) -> u64 {
    v.iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

fn all_reduce(comm: &Communicator, count: usize, op: ReduceOp, in_place: bool) -> Vec<f32> {
    let x: Vec<f32> = (0..count).map(|i| input(comm.rank(), i)).collect();
    let mut y = vec![0f32; count];
    if in_place {
        y.copy_from_slice(&x);
        let p = y.as_mut_ptr() as *mut u8;
        // SAFETY: `y` holds `count` f32 elements; in place, one buffer.
        unsafe { comm.all_reduce_raw(p, p, count, DataType::Float32, op) }.expect("all_reduce");
    } else {
        // SAFETY: both buffers hold `count` f32 elements.
        unsafe {
            comm.all_reduce_raw(x.as_ptr() as *const u8, y.as_mut_ptr() as *mut u8, count, DataType::Float32, op)
        }
        .expect("all_reduce");
    }
    y
}

/// A rank: takes host `COMPRESS_HOSTS[rank]`, runs every case, prints one `HASH` line per case.
#[test]
fn child_compress() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let hosts: Vec<usize> = std::env::var("COMPRESS_HOSTS").unwrap().split(',').map(|h| h.parse().unwrap()).collect();
    std::env::set_var("OXCCL_HOSTID", format!("compress-host-{}", hosts[rank]));
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    for (k, &count) in COUNTS.iter().enumerate() {
        for enc in [Encoding::Bf16, Encoding::Fp8, Encoding::Int8] {
            comm.set_compression(enc);
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let route = comm.route(oxccl::algo::Collective::AllReduce, count, DataType::Float32, op);
                assert!(matches!(route, oxccl::algo::Route::Compressed(e, _) if e == enc), "{route:?}");
                let y = all_reduce(&comm, count, op, k % 2 == 1);
                if let Err(e) = check(enc, &hosts, &y, op == ReduceOp::Avg) {
                    panic!("rank {rank}: count {count}: {e}");
                }
                // The other placement gives the same bits.
                if count == 65537 {
                    let other = all_reduce(&comm, count, op, k % 2 == 0);
                    assert!(fnv(&other) == fnv(&y), "rank {rank}: {enc:?} {op:?}: in place and out of place differ");
                }
                eprintln!("HASH {} {count} {op:?} {:016x}", enc.name(), fnv(&y));
            }
        }
    }
    // Reduce-scatter: compressed, within the bound.
    for count in [1000, 65537] {
        let x: Vec<f32> = (0..n * count).map(|i| input(rank, i)).collect();
        for enc in [Encoding::Bf16, Encoding::Fp8, Encoding::Int8] {
            comm.set_compression(enc);
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let route = comm.route(oxccl::algo::Collective::ReduceScatter, count, DataType::Float32, op);
                assert!(matches!(route, oxccl::algo::Route::Compressed(e, _) if e == enc), "{route:?}");
                let mut y = vec![0f32; count];
                comm.reduce_scatter(&x, &mut y, op).expect("reduce_scatter");
                if let Err(e) = check_at(enc, &hosts, &y, op == ReduceOp::Avg, rank * count) {
                    panic!("rank {rank}: reduce_scatter of {count}: {e}");
                }
            }
        }
    }
    // Reduce: compressed; the root's result within the bound and, where the root is its host's
    // lowest rank (its leader in the all-reduce), the bits the all-reduce gives; the other
    // ranks' buffers untouched.
    for (count, root, in_place) in [(1000, 0, false), (65537, n - 1, true)] {
        let x: Vec<f32> = (0..count).map(|i| input(rank, i)).collect();
        for enc in [Encoding::Bf16, Encoding::Fp8, Encoding::Int8] {
            comm.set_compression(enc);
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let route = comm.route(oxccl::algo::Collective::Reduce { root }, count, DataType::Float32, op);
                assert!(matches!(route, oxccl::algo::Route::Compressed(e, _) if e == enc), "{route:?}");
                let poison = f32::from_bits(0x7fa5_a5a5);
                let mut y = vec![poison; count];
                if in_place {
                    y.copy_from_slice(&x);
                    comm.reduce_in_place(&mut y, op, root).expect("reduce");
                } else {
                    comm.reduce(&x, &mut y, op, root).expect("reduce");
                }
                if rank != root {
                    let kept = if in_place { fnv(&x) } else { fnv(&vec![poison; count]) };
                    assert!(fnv(&y) == kept, "rank {rank}: reduce to {root} wrote a non-root buffer");
                }
                let all = all_reduce(&comm, count, op, false);
                if rank != root {
                    continue;
                }
                if let Err(e) = check(enc, &hosts, &y, op == ReduceOp::Avg) {
                    panic!("rank {rank}: reduce of {count} to {root}: {e}");
                }
                if hosts.iter().position(|&h| h == hosts[root]) == Some(root) {
                    assert!(fnv(&y) == fnv(&all), "{enc:?} {op:?}: the reduce's bits are not the all-reduce's");
                }
            }
        }
    }
    // Other types and operators stay exact: an f32 max is the exact max.
    comm.set_compression(Encoding::Int8);
    let y = all_reduce(&comm, 1000, ReduceOp::Max, false);
    for (j, v) in y.iter().enumerate() {
        let want = (0..n).map(|r| input(r, j)).fold(f32::NEG_INFINITY, f32::max);
        assert!(v.to_bits() == want.to_bits() || v.is_nan() && want.is_nan(), "max {j}: {v} vs {want}");
    }
}

fn run(hosts: &str, n: usize) {
    let env = [
        ("COMPRESS_HOSTS", hosts.to_string()),
        ("OXCCL_TIMEOUT_MS", "120000".to_string()),
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
    ];
    let res = common::run_ranks("child_compress", n, &env, Duration::from_secs(600));
    common::assert_all_ok(&res);
    let lines = |s: &str| -> Vec<String> { s.lines().filter(|l| l.starts_with("HASH ")).map(String::from).collect() };
    let first = lines(&res[0].1);
    assert_eq!(first.len(), COUNTS.len() * 6, "rank 0 output:\n{}", res[0].1);
    for (r, out) in res.iter().enumerate().skip(1) {
        assert_eq!(lines(&out.1), first, "rank {r}'s results differ from rank 0's");
    }
}

#[test]
fn one_rank_per_host() {
    run("0,1", 2);
}

#[test]
fn two_ranks_per_host() {
    run("0,0,1,1", 4);
}

/// Two ranks on one host: the switch changes nothing (no link leaves the host).
#[test]
fn child_one_host() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    assert_eq!(comm.compression(), Encoding::Bf16, "OXCCL_COMPRESS=bf16 is read");
    for count in [1000, 65537, (1 << 20) + 3] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            comm.set_compression(Encoding::Bf16);
            let on = all_reduce(&comm, count, op, false);
            comm.set_compression(Encoding::Exact);
            let off = all_reduce(&comm, count, op, false);
            assert!(fnv(&on) == fnv(&off), "count {count} {op:?}: bf16 changed an all-reduce within one host");
            let want: Vec<f32> = (0..count).map(|j| (0..n).map(|r| input(r, j)).sum::<f32>()).collect();
            if op == ReduceOp::Sum {
                assert!(on.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan()));
            }
        }
    }
}

#[test]
fn one_host_stays_exact() {
    let env = [("OXCCL_COMPRESS", "bf16".to_string()), ("OXCCL_SOCKET_IFNAME", "lo".to_string())];
    common::assert_all_ok(&common::run_ranks("child_one_host", 2, &env, Duration::from_secs(300)));
}

/// The C switch: set, get, an unknown mode refused without a change, a NULL out-pointer refused.
#[test]
fn c_api_sets_and_gets_the_mode() {
    use oxccl::ffi::comm::{ncclCommDestroy, ncclCommInitRank, ncclGetUniqueId};
    use oxccl::ffi::oxccl_ext::*;
    use oxccl::ffi::{ncclComm_t, ncclResult_t, ncclUniqueId};
    if common::child_role().is_some() {
        return;
    }
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(ncclGetUniqueId(&mut id), ncclResult_t::ncclSuccess);
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, 1, id, 0), ncclResult_t::ncclSuccess);
    let mut mode = -1;
    assert_eq!(oxcclCommGetCompression(comm, &mut mode), ncclResult_t::ncclSuccess);
    assert_eq!(mode, OXCCL_COMPRESS_OFF);
    for m in [OXCCL_COMPRESS_BF16, OXCCL_COMPRESS_FP8, OXCCL_COMPRESS_INT8] {
        assert_eq!(oxcclCommSetCompression(comm, m), ncclResult_t::ncclSuccess);
        assert_eq!(oxcclCommGetCompression(comm, &mut mode), ncclResult_t::ncclSuccess);
        assert_eq!(mode, m);
    }
    assert_eq!(oxcclCommSetCompression(comm, 4), ncclResult_t::ncclInvalidArgument);
    assert_eq!(oxcclCommSetCompression(comm, -1), ncclResult_t::ncclInvalidArgument);
    assert_eq!(oxcclCommGetCompression(comm, &mut mode), ncclResult_t::ncclSuccess);
    assert_eq!(mode, OXCCL_COMPRESS_INT8, "a refused mode changes nothing");
    assert_eq!(oxcclCommGetCompression(comm, std::ptr::null_mut()), ncclResult_t::ncclInvalidArgument);
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

/// Features of the training test's linear model (its gradient is `DIM + 1` elements: several
/// blocks of the block formats).
const DIM: usize = 600;
/// Samples per rank.
const SAMPLES: usize = 500;
/// Gradient steps.
const STEPS: usize = 60;
/// Learning rate.
const LR: f32 = 0.5;

/// Rank `rank`'s shard of a regression drawn around fixed weights (xorshift, deterministic).
fn shard(rank: usize) -> (Vec<f32>, Vec<f32>) {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (rank as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w: Vec<f32> = (0..=DIM).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect();
    let x: Vec<f32> = (0..SAMPLES * DIM).map(|_| next()).collect();
    let y =
        x.chunks(DIM).map(|row| row.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + w[DIM] + 0.01 * next()).collect();
    (x, y)
}

/// Mean-squared error of `model` on a shard, and its gradient.
fn loss_and_grad(model: &[f32], x: &[f32], y: &[f32]) -> (f32, Vec<f32>) {
    let mut grad = vec![0f32; DIM + 1];
    let mut loss = 0f32;
    for (row, &target) in x.chunks(DIM).zip(y) {
        let err = row.iter().zip(model).map(|(a, b)| a * b).sum::<f32>() + model[DIM] - target;
        loss += err * err;
        grad.iter_mut().zip(row).for_each(|(g, a)| *g += 2.0 * err * a);
        grad[DIM] += 2.0 * err;
    }
    let n = y.len() as f32;
    grad.iter_mut().for_each(|g| *g /= n);
    (loss / n, grad)
}

/// A rank of the data-parallel training: for each mode, `STEPS` steps of SGD from the same
/// start with the gradients averaged by an all-reduce in that mode; prints the global loss per
/// step and a hash of the final model, and checks with an (exact) all-gather that every rank's
/// model has the same bits.
#[test]
fn child_train() {
    let Some((rank, n, id)) = common::child_role() else { return };
    std::env::set_var("OXCCL_HOSTID", format!("train-host-{rank}"));
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    let (x, y) = shard(rank);
    for enc in Encoding::ALL {
        comm.set_compression(enc);
        let route = comm.route(oxccl::algo::Collective::AllReduce, DIM + 1, DataType::Float32, ReduceOp::Avg);
        assert_eq!(matches!(route, oxccl::algo::Route::Compressed(..)), enc.lossy(), "{enc:?}: {route:?}");
        let mut model = vec![0f32; DIM + 1];
        let mut losses = Vec::with_capacity(STEPS);
        for _ in 0..STEPS {
            let (l, mut grad) = loss_and_grad(&model, &x, &y);
            comm.all_reduce_in_place(&mut grad, ReduceOp::Avg).expect("gradient all-reduce");
            model.iter_mut().zip(&grad).for_each(|(w, g)| *w -= LR * g);
            let mut l = [l as f64];
            comm.all_reduce_in_place(&mut l, ReduceOp::Avg).expect("loss all-reduce");
            losses.push(l[0]);
        }
        let mut all = vec![0f32; n * (DIM + 1)];
        comm.all_gather(&model, &mut all).expect("all-gather");
        for (r, m) in all.chunks(DIM + 1).enumerate() {
            assert!(fnv(m) == fnv(&model), "{enc:?}: rank {r}'s model differs from rank {rank}'s");
        }
        let curve: Vec<String> = losses.iter().map(|l| format!("{l:e}")).collect();
        eprintln!("LOSS {} {}", enc.name(), curve.join(" "));
        eprintln!("MODEL {} {:016x}", enc.name(), fnv(&model));
    }
}

/// Data-parallel training on two fake hosts, gradients all-reduced exact, bf16, fp8 and int8
/// (docs/COMPRESSION.md, "Training"): every compressed loss curve within 2% + 1e-4 of the exact
/// one at every step, the loss falling by 100× or more, and each run's model the same bits on
/// both ranks.
#[test]
fn training_tracks_the_exact_loss() {
    let env = [("OXCCL_TIMEOUT_MS", "120000".to_string()), ("OXCCL_SOCKET_IFNAME", "lo".to_string())];
    let res = common::run_ranks("child_train", 2, &env, Duration::from_secs(600));
    common::assert_all_ok(&res);
    let curves = |out: &str| -> Vec<(String, Vec<f64>)> {
        out.lines()
            .filter_map(|l| l.strip_prefix("LOSS "))
            .map(|l| {
                let mut it = l.split(' ');
                let name = it.next().unwrap().to_string();
                (name, it.map(|v| v.parse().unwrap()).collect())
            })
            .collect()
    };
    let c = curves(&res[0].1);
    assert_eq!(c.len(), 4, "rank 0 output:\n{}", res[0].1);
    assert_eq!(curves(&res[1].1), c, "the ranks saw different global losses");
    let exact = &c[0].1;
    assert!(exact[STEPS - 1] < exact[0] / 100.0, "the exact run does not learn: {exact:?}");
    for (name, curve) in &c[1..] {
        for (s, (a, e)) in curve.iter().zip(exact).enumerate() {
            eprintln!("{name} step {s}: {a:e} vs exact {e:e} ({:+.3}%)", (a - e) / e * 100.0);
            assert!((a - e).abs() <= 0.02 * e + 1e-4, "{name} step {s}: loss {a} vs exact {e}");
        }
    }
}

/// Device buffers between hosts (CUDA stand-in, or the real driver under the GPU kit): the
/// proxy's all-reduce and the staged reduce-scatter and reduce run the host plans on pinned
/// staging, so they take the compressed route too. One rank: every case on device buffers
/// through the C API, results within the bound (exact where the route is exact), one `HASH`
/// line per all-reduce and reduce-scatter, the reduce's root the bits of the all-reduce.
#[test]
fn child_device() {
    use cudarc::driver::{result, sys};
    use oxccl::ffi::coll::{ncclAllReduce, ncclReduce, ncclReduceScatter};
    use oxccl::ffi::ncclResult_t;
    use oxccl::ffi::oxccl_ext::oxcclCommSetCompression;
    let Some((rank, n, id)) = common::child_role() else { return };
    let hosts: Vec<usize> = std::env::var("COMPRESS_HOSTS").unwrap().split(',').map(|h| h.parse().unwrap()).collect();
    std::env::set_var("OXCCL_HOSTID", format!("compress-device-host-{}", hosts[rank]));
    let (comm, streams, _ctx) = common::standin::join(rank, n, &id);
    let s = streams[0];
    let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    // Runs `call(send, recv)` on device buffers holding `x` (send) and `init` (receive; the send
    // buffer itself in place), and returns the receive buffer.
    let on_device = |x: &[f32], init: &[f32], in_place: bool, call: &dyn Fn(u64, u64) -> ncclResult_t| {
        let sbuf = common::standin::DevMem::new(x.len() * 4);
        let rbuf = common::standin::DevMem::new(init.len() * 4);
        common::standin::upload(sbuf.0, &f32s(x), s);
        common::standin::upload(rbuf.0, &f32s(init), s);
        let (send, recv) = if in_place { (sbuf.0, sbuf.0) } else { (sbuf.0, rbuf.0) };
        assert_eq!(call(send, recv), ncclResult_t::ncclSuccess, "rank {rank}: device collective");
        let mut got = vec![0u8; init.len() * 4];
        // SAFETY: `recv` holds `init.len()` f32 (in place: the send buffer, at least that long);
        // the stream is synchronised before `got` is read.
        unsafe {
            result::memcpy_dtoh_async(&mut got, recv, s).expect("download");
            result::stream::synchronize(s).expect("cuStreamSynchronize");
        }
        got.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<f32>>()
    };
    let st: oxccl::ffi::cudaStream_t = s.cast();
    let f = DataType::Float32 as i32;
    for (mode, enc) in [(1, Encoding::Bf16), (2, Encoding::Fp8), (3, Encoding::Int8)] {
        assert_eq!(oxcclCommSetCompression(comm, mode), ncclResult_t::ncclSuccess);
        for (k, count) in [1000usize, 65537].into_iter().enumerate() {
            let x: Vec<f32> = (0..n * count).map(|i| input(rank, i)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let (o, avg) = (op as i32, op == ReduceOp::Avg);
                let in_place = (k + avg as usize) % 2 == 1;
                let xs = &x[..count];
                let ar = |sp: u64, rp: u64| ncclAllReduce(sp as _, rp as _, count, f, o, comm, st);
                let all = on_device(xs, xs, in_place, &ar);
                check(enc, &hosts, &all, avg)
                    .unwrap_or_else(|e| panic!("rank {rank}: device all_reduce of {count}: {e}"));
                eprintln!("HASH all_reduce {} {count} {op:?} {:016x}", enc.name(), fnv(&all));
                let rs = |sp: u64, rp: u64| {
                    let rp = if in_place { sp + (rank * count * 4) as u64 } else { rp };
                    ncclReduceScatter(sp as _, rp as _, count, f, o, comm, st)
                };
                let got = on_device(&x, &x[..if in_place { n * count } else { count }], in_place, &rs);
                let y = if in_place { &got[rank * count..(rank + 1) * count] } else { &got[..] };
                check_at(enc, &hosts, y, avg, rank * count)
                    .unwrap_or_else(|e| panic!("rank {rank}: device reduce_scatter of {count}: {e}"));
                eprintln!("HASH rank {rank} reduce_scatter {} {count} {op:?} {:016x}", enc.name(), fnv(y));
                let root = k % n;
                let red = |sp: u64, rp: u64| ncclReduce(sp as _, rp as _, count, f, o, root as i32, comm, st);
                let poison = vec![f32::from_bits(0x7fa5_a5a5); count];
                let r = on_device(xs, if in_place { xs } else { &poison }, in_place, &red);
                if rank != root {
                    let kept = if in_place { fnv(xs) } else { fnv(&poison) };
                    assert!(fnv(&r) == kept, "rank {rank}: device reduce to {root} wrote a non-root buffer");
                    continue;
                }
                check(enc, &hosts, &r, avg).unwrap_or_else(|e| panic!("rank {rank}: device reduce of {count}: {e}"));
                if hosts.iter().position(|&h| h == hosts[root]) == Some(root) {
                    assert!(fnv(&r) == fnv(&all), "{enc:?} {op:?}: the device reduce's bits are not the all-reduce's");
                }
            }
        }
    }
    for s in streams {
        // SAFETY: synchronised above; destroyed once.
        unsafe { result::stream::destroy(s as sys::CUstream) }.expect("cuStreamDestroy");
    }
    assert_eq!(oxccl::ffi::comm::ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

/// [`child_device`] on one and two ranks per host, each with the proxy forced (no CUDA IPC):
/// every rank's all-reduce the same bits, and the compressed route taken on device buffers
/// (the `OXCCL_DEBUG=INFO` line of the plans, and the device paths of the calls).
#[test]
fn device_buffers_between_hosts() {
    if common::child_role().is_some() {
        return;
    }
    for (hosts, n) in [("0,1", 2), ("0,0,1,1", 4)] {
        let mut env = common::standin::standin_env();
        env.extend([
            ("COMPRESS_HOSTS", hosts.to_string()),
            ("OXCCL_TIMEOUT_MS", "120000".to_string()),
            ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
            ("OXCCL_DEBUG", "INFO".to_string()),
        ]);
        let res = common::run_ranks("child_device", n, &env, Duration::from_secs(300));
        common::assert_all_ok(&res);
        let lines = |s: &str| -> Vec<String> {
            s.lines().filter(|l| l.starts_with("HASH all_reduce")).map(String::from).collect()
        };
        let first = lines(&res[0].1);
        assert_eq!(first.len(), 12, "rank 0 output:\n{}", res[0].1);
        for (r, (_, out)) in res.iter().enumerate() {
            assert_eq!(lines(out), first, "rank {r}'s device all-reduce results differ from rank 0's");
            for line in
                ["device all_reduce path: proxy", "device reduce_scatter path: staged", "device reduce path: staged"]
            {
                assert!(out.contains(line), "rank {r}: no {line:?} in its log:\n{out}");
            }
            for enc in ["bf16", "fp8", "int8"] {
                for coll in ["all_reduce", "reduce_scatter", "reduce"] {
                    let line = format!("rank {r}: {coll} of 65537 f32 elements: compressed between hosts as {enc}");
                    assert!(out.contains(&line), "rank {r}: no {line:?} in its log:\n{out}");
                }
            }
        }
        eprintln!("device buffers between hosts {hosts}: ok");
    }
}
