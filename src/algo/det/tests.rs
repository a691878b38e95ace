//! The fixed-order schedules: they pair up, pass the validator, give the reduction under random
//! schedules, and give the left fold in rank order bit for bit whatever the chunk size.

use super::*;
use crate::algo::sim::{check, Sim};
use crate::algo::validate::{self, Layout};
use crate::algo::{message_lens, Collective};
use crate::types::{DataType, ReduceOp};

fn plan_of(coll: Collective, rank: usize, n: usize, count: usize, elem: usize, chunk: usize, ip: bool) -> Plan {
    match coll {
        Collective::AllReduce => all_reduce(rank, n, count, elem, chunk),
        Collective::ReduceScatter => reduce_scatter(rank, n, count, elem, chunk, ip),
        Collective::Reduce { root } => reduce(rank, n, count, elem, chunk, root),
        _ => unreachable!(),
    }
}

fn colls(n: usize) -> Vec<Collective> {
    vec![
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::Reduce { root: 0 },
        Collective::Reduce { root: n / 2 },
        Collective::Reduce { root: n - 1 },
    ]
}

#[test]
fn plans_pair_up_and_pass_the_validator() {
    for n in 1..=9 {
        for coll in colls(n) {
            for (count, chunk) in [(0, 64), (1, 8), (5, 8), (37, 16), (1000, 64), (1000, 1 << 20)] {
                for in_place in [false, true] {
                    let plans: Vec<Plan> = (0..n).map(|r| plan_of(coll, r, n, count, 8, chunk, in_place)).collect();
                    for (r, p) in plans.iter().enumerate() {
                        let (s, rl) = coll.buffer_counts(r, n, count);
                        let ip = in_place && s > 0 && rl > 0;
                        let lay = validate::layout(coll, ip);
                        validate::check(p, &|_| lay).unwrap_or_else(|e| panic!("{coll:?} n={n} rank {r}: {e}"));
                        // Scratch stays bounded by the slots, whatever the count.
                        let seg = if coll == Collective::ReduceScatter { count } else { count.div_ceil(n) };
                        let slot = n * chunk.min(seg * 8).max(8);
                        assert!(p.scratch.first().copied().unwrap_or(0) <= SLOTS * slot + count * 8);
                    }
                    for a in 0..n {
                        for b in 0..n {
                            let (s, r) = (message_lens(&plans[a], b, true), message_lens(&plans[b], a, false));
                            assert_eq!(s, r, "{coll:?} n={n} count={count} chunk={chunk}: {a} -> {b}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn plans_reduce_under_random_schedules() {
    for n in [1, 2, 3, 4, 5, 8] {
        for coll in colls(n) {
            for count in [0, 1, 7, 97] {
                for in_place in [false, true] {
                    for seed in 0..3u64 {
                        let chunk = [8, 24, 1 << 20][seed as usize];
                        let op = if seed == 1 { ReduceOp::Max } else { ReduceOp::Sum };
                        let build = |r, ip| plan_of(coll, r, n, count, 8, chunk, ip);
                        check(coll, n, count, in_place, op, 1 + 13 * seed as usize, seed, &build)
                            .unwrap_or_else(|e| panic!("{coll:?} n={n} count={count} in_place={in_place}: {e}"));
                    }
                }
            }
        }
    }
}

/// Inputs whose sum depends on the order: magnitudes from 2^-30 to 2^30, both signs.
fn hard(rank: usize, i: usize) -> f64 {
    let h = (i.wrapping_mul(2654435761) ^ rank.wrapping_mul(40503)) % 61;
    let sign = if (i + rank) % 3 == 0 { -1.0 } else { 1.0 };
    sign * 2f64.powi(h as i32 - 30) * (1.0 + ((i * 7 + rank) % 97) as f64 / 97.0)
}

/// The left fold in rank order of `hard`, in f32 or f64.
fn left_fold(dtype: DataType, n: usize, i: usize) -> Vec<u8> {
    if dtype == DataType::Float32 {
        let mut acc = hard(0, i) as f32;
        (1..n).for_each(|q| acc += hard(q, i) as f32);
        acc.to_le_bytes().to_vec()
    } else {
        let mut acc = hard(0, i);
        (1..n).for_each(|q| acc += hard(q, i));
        acc.to_le_bytes().to_vec()
    }
}

/// Runs an all-reduce or reduce-scatter of `hard` inputs in the simulator; rank `r`'s result.
fn simulate(coll: Collective, dtype: DataType, n: usize, count: usize, chunk: usize, seed: u64) -> Vec<Vec<u8>> {
    let elem = dtype.size();
    let mut sends = Vec::new();
    let (mut recv_len, mut at, mut plans) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..n {
        let (s, rl) = coll.buffer_counts(r, n, count);
        let vals: Vec<f64> = (0..s).map(|i| hard(r, i)).collect();
        let mut bytes = vec![0u8; s * elem];
        crate::reduce::from_f64(dtype, &vals, &mut bytes);
        sends.push(bytes);
        recv_len.push(rl * elem);
        at.push((Layout::Apart, 0));
        plans.push(plan_of(coll, r, n, count, elem, chunk, false));
    }
    let sim = Sim::new(plans, &sends, &recv_len, &at, 64 + seed as usize * 1000, dtype, ReduceOp::Sum, seed);
    sim.run(1 << 22).expect("runs").recv
}

#[test]
fn every_element_is_the_left_fold_in_rank_order_whatever_the_chunk() {
    for dtype in [DataType::Float32, DataType::Float64] {
        let elem = dtype.size();
        for n in [3, 4, 5] {
            let count = 301;
            let want: Vec<u8> = (0..count).flat_map(|i| left_fold(dtype, n, i)).collect();
            for (seed, chunk) in [8, 40, 1 << 20].into_iter().enumerate() {
                let got = simulate(Collective::AllReduce, dtype, n, count, chunk, seed as u64);
                for (r, g) in got.iter().enumerate() {
                    assert!(g == &want, "{dtype:?} n={n} chunk={chunk} rank {r}");
                }
                // A shorter call on the same inputs: the same bits element by element.
                let short = simulate(Collective::AllReduce, dtype, n, 17, chunk, seed as u64);
                assert!(short[0][..] == want[..17 * elem]);
                let rs = simulate(Collective::ReduceScatter, dtype, n, 50, chunk, seed as u64);
                for (r, g) in rs.iter().enumerate() {
                    let want: Vec<u8> = (r * 50..(r + 1) * 50).flat_map(|i| left_fold(dtype, n, i)).collect();
                    assert!(g == &want, "reduce-scatter {dtype:?} n={n} rank {r}");
                }
            }
        }
    }
}
