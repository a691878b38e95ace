//! The compressed all-reduce: plans pair up and pass the validator; under random schedules every
//! rank ends with the same bits, the same whatever the arrival order, within the bound of
//! docs/COMPRESSION.md of the f64 sum; non-finite inputs come out as the exact sum has them.

use super::*;
use crate::algo::message_lens;
use crate::algo::sim::Sim;
use crate::algo::validate;
use crate::types::{DataType, ReduceOp};

const LAYOUTS: [&[usize]; 5] = [&[0, 1], &[0, 1, 2], &[0, 0, 1, 1], &[0, 1, 0, 2, 1], &[0, 0, 0, 1]];
const ENCODINGS: [Encoding; 4] = [Encoding::Exact, Encoding::Bf16, Encoding::Fp8, Encoding::Int8];

#[test]
fn plans_pair_up_and_pass_the_validator() {
    for groups in LAYOUTS {
        let n = groups.len();
        for enc in ENCODINGS {
            for (count, chunk) in [(1, 64), (5, 8), (1000, 256), (1000, 1 << 20), (3000, 1024)] {
                for in_place in [false, true] {
                    let plans: Vec<Plan> = (0..n).map(|r| all_reduce(r, groups, count, chunk, enc)).collect();
                    let lay = validate::layout(crate::algo::Collective::AllReduce, in_place);
                    for (r, p) in plans.iter().enumerate() {
                        validate::check(p, &|_| lay).unwrap_or_else(|e| panic!("{groups:?} {enc:?} rank {r}: {e}"));
                        // Scratch is a few chunks, whatever the count.
                        let hosts = groups.iter().max().unwrap() + 1;
                        assert!(p.scratch.first().copied().unwrap_or(0) <= SLOTS * (4 + 3 * hosts + 1) * chunk.max(8));
                    }
                    for a in 0..n {
                        for b in 0..n {
                            let (s, r) = (message_lens(&plans[a], b, true), message_lens(&plans[b], a, false));
                            assert_eq!(s, r, "{groups:?} {enc:?} count={count}: {a} -> {b}");
                        }
                    }
                }
            }
        }
    }
}

/// Rank `r`'s element `i`: a magnitude per 256-element block from 2^-40 to 2^40, both signs,
/// zero blocks and scattered zeros.
pub(crate) fn wide(r: usize, i: usize) -> f32 {
    let b = i / 256;
    let h = (i.wrapping_mul(2654435761) ^ r.wrapping_mul(40503)) % 1000;
    if b % 7 == 3 || h % 13 == 0 {
        return 0.0;
    }
    let mag = 2f32.powi(((b * 37 + r * 11) % 81) as i32 - 40);
    let sign = if (i + r) % 3 == 0 { -1.0 } else { 1.0 };
    sign * mag * (0.25 + h as f32 / 1000.0)
}

/// The documented bound (docs/COMPRESSION.md) of element `j` of an all-reduce over the hosts of
/// `groups` of the inputs `x[r]`, for a sum (`n_div == 1`) or an average (`n_div` ranks);
/// `w[j]`: the sum over hosts of the largest finite |host sum| near `j` ([`window`]).
pub(crate) fn bound(enc: Encoding, x: &[Vec<f32>], w: &[f64], j: usize, n_div: usize) -> f64 {
    let n = x.len();
    let abs_sum: f64 = x.iter().map(|v| f64::from(v[j].abs())).sum();
    let fold = (n + 2) as f64 * 2f64.powi(-23) * abs_sum;
    let q = match enc {
        Encoding::Exact => 0.0,
        Encoding::Bf16 => (2f64.powi(-7) + 2f64.powi(-14)) * abs_sum + 2f64.powi(-130),
        Encoding::Fp8 => (2f64.powi(-3) + 2f64.powi(-7)) * abs_sum + 2f64.powi(-16) * w[j] + 2f64.powi(-130),
        Encoding::Int8 => w[j] / 126.0 * 1.01 + 2f64.powi(-130),
    };
    (q + fold) / n_div as f64
}

/// Per element `j`, over hosts, the largest finite sum of magnitudes of the host's inputs in
/// the aligned 256-blocks around `j` (which cover every block of 256 that holds `j`): an upper
/// bound of the block maxima the encodings scale by.
pub(crate) fn window(groups: &[usize], x: &[Vec<f32>]) -> Vec<f64> {
    let count = x[0].len();
    let hosts = groups.iter().max().unwrap() + 1;
    let blocks = count.div_ceil(256);
    let mut w = vec![0f64; count];
    for h in 0..hosts {
        let mut bmax = vec![0f64; blocks];
        for k in 0..count {
            let s: f64 = (0..x.len())
                .filter(|&r| groups[r] == h)
                .map(|r| f64::from(x[r][k].abs()))
                .filter(|v| v.is_finite())
                .sum();
            bmax[k / 256] = bmax[k / 256].max(s);
        }
        for (j, v) in w.iter_mut().enumerate() {
            let b = j / 256;
            let m = bmax[b.saturating_sub(1)..(b + 2).min(blocks)].iter().fold(0f64, |a, &c| a.max(c));
            *v += m * (1.0 + 2f64.powi(-20));
        }
    }
    w
}

/// The f64 reference: `Σ x` (or the average) with IEEE non-finite rules.
pub(crate) fn exact(x: &[Vec<f32>], j: usize, avg: bool) -> f64 {
    let s: f64 = x.iter().map(|v| f64::from(v[j])).sum();
    if avg {
        s / x.len() as f64
    } else {
        s
    }
}

/// Asserts element by element that `y` is within the bound of the reference (or the same
/// non-finite value).
pub(crate) fn assert_within(enc: Encoding, groups: &[usize], x: &[Vec<f32>], y: &[f32], avg: bool, what: &str) {
    let n_div = if avg { x.len() } else { 1 };
    let w = window(groups, x);
    for (j, &got) in y.iter().enumerate() {
        let want = exact(x, j, avg);
        if !want.is_finite() {
            assert!(
                want.is_nan() && got.is_nan() || f64::from(got) == want,
                "{what}: element {j}: {got}, exact {want}"
            );
            continue;
        }
        let err = (f64::from(got) - want).abs();
        let lim = bound(enc, x, &w, j, n_div);
        assert!(err <= lim, "{what}: element {j}: {got} vs exact {want}: error {err:e} > bound {lim:e}");
    }
}

fn simulate(groups: &[usize], enc: Encoding, x: &[Vec<f32>], op: ReduceOp, chunk: usize, seed: u64) -> Vec<Vec<f32>> {
    let n = groups.len();
    let count = x[0].len();
    let in_place = seed % 2 == 1;
    let lay = validate::layout(crate::algo::Collective::AllReduce, in_place);
    let plans: Vec<Plan> = (0..n).map(|r| all_reduce(r, groups, count, chunk, enc)).collect();
    let sends: Vec<Vec<u8>> = x.iter().map(|v| bytemuck::cast_slice::<f32, u8>(v).to_vec()).collect();
    let at = vec![(lay, 0); n];
    let sim = Sim::new(plans, &sends, &vec![count * 4; n], &at, 64 + seed as usize * 997, DataType::Float32, op, seed);
    let out = sim.run(1 << 24).unwrap_or_else(|e| panic!("{groups:?} {enc:?}: {e}"));
    out.recv.iter().map(|b| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()).collect()
}

#[test]
fn every_rank_holds_the_same_bits_within_the_bound() {
    for groups in LAYOUTS {
        let n = groups.len();
        for count in [1, 1000, 65537] {
            let x: Vec<Vec<f32>> = (0..n).map(|r| (0..count).map(|i| wide(r, i)).collect()).collect();
            for enc in ENCODINGS {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let mut first: Option<Vec<f32>> = None;
                    for (seed, chunk) in [(0u64, 4096), (1, 1000), (2, 1 << 20)] {
                        let y = simulate(groups, enc, &x, op, chunk, seed);
                        for r in 1..n {
                            assert!(
                                bits(&y[r]) == bits(&y[0]),
                                "{groups:?} {enc:?} {op:?} count={count}: rank {r} differs"
                            );
                        }
                        let what = format!("{groups:?} {enc:?} {op:?} count={count} chunk={chunk}");
                        assert_within(enc, groups, &x, &y[0], op == ReduceOp::Avg, &what);
                        // With the same chunk the bits depend neither on the schedule nor on the
                        // placement (this one out of place, the next in place).
                        if chunk == 4096 {
                            let again = simulate(groups, enc, &x, op, chunk, seed + 3);
                            assert!(bits(&again[0]) == bits(&y[0]), "{what}: in place, another schedule, other bits");
                        }
                        first.get_or_insert(y[0].clone());
                    }
                }
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn non_finite_inputs_come_out_as_the_exact_sum_has_them() {
    let groups = &[0, 1, 1, 2];
    let count = 700;
    let mut x: Vec<Vec<f32>> = (0..4).map(|r| (0..count).map(|i| wide(r, i) + 1.0).collect()).collect();
    x[0][5] = f32::INFINITY;
    x[1][6] = f32::NEG_INFINITY;
    x[2][7] = f32::NAN;
    x[3][300] = f32::INFINITY;
    x[1][300] = f32::NEG_INFINITY; // +inf + -inf: NaN
    x[2][400] = f32::INFINITY;
    x[3][400] = f32::INFINITY;
    for enc in ENCODINGS {
        let y = simulate(groups, enc, &x, ReduceOp::Sum, 1024, 3);
        assert_within(enc, groups, &x, &y[2], false, &format!("{enc:?}"));
        assert_eq!(y[0][5], f32::INFINITY);
        assert!(y[0][300].is_nan() && y[0][7].is_nan());
        // The blocks holding them keep their other values' accuracy (checked by the bound).
        assert!(y[0][4].is_finite() && y[0][8].is_finite());
    }
}

#[test]
fn exact_encoding_is_the_left_fold_over_hosts() {
    // One rank per host, the `Exact` stage: the sum in host order, bit for bit.
    let groups = &[0, 1, 2];
    let x: Vec<Vec<f32>> = (0..3).map(|r| (0..999).map(|i| wide(r, i)).collect()).collect();
    let y = simulate(groups, Encoding::Exact, &x, ReduceOp::Sum, 512, 0);
    for j in 0..999 {
        assert_eq!(y[1][j].to_bits(), (x[0][j] + x[1][j] + x[2][j]).to_bits(), "{j}");
    }
}

/// The compressed reduce-scatter (one or several ranks per host): plans pair up and pass the
/// validator, and under random schedules each rank's block is within the all-reduce's bound of
/// the f64 reference (it has one quantisation fewer) and, with the same chunk, the same bits
/// whatever the schedule and placement.
#[test]
fn reduce_scatter_is_within_the_bound_on_every_schedule() {
    use crate::algo::Collective;
    for groups in LAYOUTS {
        let n = groups.len();
        // Several ranks on a host: a smaller large count (still more chunks than slots), for time.
        let one_per_host = groups.iter().max() == Some(&(n - 1));
        let counts: &[usize] = if one_per_host { &[1, 1000, 65537] } else { &[1, 1000, 4099] };
        for &count in counts {
            let x: Vec<Vec<f32>> = (0..n).map(|r| (0..n * count).map(|i| wide(r, i)).collect()).collect();
            let sends: Vec<Vec<u8>> = x.iter().map(|v| bytemuck::cast_slice::<f32, u8>(v).to_vec()).collect();
            for enc in ENCODINGS {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    let mut first: Option<Vec<Vec<u32>>> = None;
                    for (seed, chunk) in [(0u64, 4096), (1, 4096), (2, 1000), (3, 1 << 20)] {
                        let in_place = seed % 2 == 1;
                        let lay = validate::layout(Collective::ReduceScatter, in_place);
                        let plans: Vec<Plan> =
                            (0..n).map(|r| reduce_scatter(r, groups, count, chunk, enc, in_place)).collect();
                        for (r, p) in plans.iter().enumerate() {
                            validate::check(p, &|_| lay).unwrap_or_else(|e| panic!("{groups:?} {enc:?} rank {r}: {e}"));
                        }
                        for a in 0..n {
                            for b in 0..n {
                                let (s, r) = (message_lens(&plans[a], b, true), message_lens(&plans[b], a, false));
                                assert_eq!(s, r, "{groups:?} {enc:?} count={count}: {a} -> {b}");
                            }
                        }
                        let recv = if in_place { n * count * 4 } else { count * 4 };
                        let at = vec![(lay, 0); n];
                        let sim = Sim::new(
                            plans,
                            &sends,
                            &vec![recv; n],
                            &at,
                            64 + seed as usize * 997,
                            DataType::Float32,
                            op,
                            seed,
                        );
                        let out = sim.run(1 << 24).unwrap_or_else(|e| panic!("{groups:?} {enc:?}: {e}"));
                        let what = format!("{groups:?} {enc:?} {op:?} count={count} chunk={chunk} in_place={in_place}");
                        let mut blocks = Vec::new();
                        for (r, b) in out.recv.iter().enumerate() {
                            let off = if in_place { r * count * 4 } else { 0 };
                            let y: Vec<f32> = b[off..off + count * 4]
                                .chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                                .collect();
                            let xr: Vec<Vec<f32>> = x.iter().map(|v| v[r * count..(r + 1) * count].to_vec()).collect();
                            assert_within(enc, groups, &xr, &y, op == ReduceOp::Avg, &what);
                            blocks.push(bits(&y));
                        }
                        // With the same chunk (the block grid), the same bits whatever the
                        // schedule or placement.
                        if let Some(f) = first.as_ref().filter(|_| chunk == 4096) {
                            assert!(f == &blocks, "{what}: other bits than the first schedule");
                        }
                        first.get_or_insert(blocks);
                    }
                }
            }
        }
    }
}

/// The compressed reduce (one or several ranks per host): plans pair up and pass the
/// validator, only the root writes its receive buffer, and under random schedules and
/// placements the root's result is within the bound of the f64 reference and, where the root
/// leads its host as in the all-reduce (the lowest rank there), bit for bit what the compressed
/// all-reduce in the same chunks gives it.
#[test]
fn reduce_gives_the_root_the_all_reduces_bits() {
    use crate::algo::Collective;
    let one_per_host: [&[usize]; 3] = [&[0, 1], &[0, 1, 2], &[0, 1, 2, 3]];
    for groups in one_per_host.into_iter().chain(LAYOUTS) {
        let n = groups.len();
        for count in [1, 1000, 65537] {
            let x: Vec<Vec<f32>> = (0..n).map(|r| (0..count).map(|i| wide(r, i)).collect()).collect();
            let sends: Vec<Vec<u8>> = x.iter().map(|v| bytemuck::cast_slice::<f32, u8>(v).to_vec()).collect();
            for enc in ENCODINGS {
                for (op, root, seed, chunk) in [
                    (ReduceOp::Sum, 0, 0u64, 4096),
                    (ReduceOp::Avg, n - 1, 1, 1000),
                    (ReduceOp::Sum, n / 2, 2, 1 << 20),
                ] {
                    let coll = Collective::Reduce { root };
                    let plans: Vec<Plan> = (0..n).map(|r| reduce(r, groups, count, chunk, enc, root)).collect();
                    for a in 0..n {
                        for b in 0..n {
                            let (s, r) = (message_lens(&plans[a], b, true), message_lens(&plans[b], a, false));
                            assert_eq!(s, r, "{groups:?} {enc:?} count={count}: {a} -> {b}");
                        }
                    }
                    let in_place = seed % 2 == 1;
                    let mut at = Vec::new();
                    let mut recv = Vec::new();
                    for (r, p) in plans.iter().enumerate() {
                        let rl = coll.buffer_counts(r, n, count).1;
                        let lay = validate::layout(coll, in_place && rl > 0);
                        validate::check(p, &|_| lay).unwrap_or_else(|e| panic!("{groups:?} {enc:?} rank {r}: {e}"));
                        at.push((lay, 0));
                        recv.push(rl * 4);
                    }
                    let sim =
                        Sim::new(plans, &sends, &recv, &at, 64 + seed as usize * 997, DataType::Float32, op, seed);
                    let out = sim.run(1 << 24).unwrap_or_else(|e| panic!("{groups:?} {enc:?}: {e}"));
                    let y: Vec<f32> =
                        out.recv[root].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    let what = format!("{groups:?} {enc:?} {op:?} count={count} root={root} chunk={chunk}");
                    assert_within(enc, groups, &x, &y, op == ReduceOp::Avg, &what);
                    // The receive buffers of the other ranks stay as they were (empty here).
                    for (r, b) in out.recv.iter().enumerate().filter(|&(r, _)| r != root) {
                        assert!(b.is_empty(), "{what}: rank {r} has a receive buffer");
                    }
                    if groups.iter().position(|&h| h == groups[root]) == Some(root) {
                        let all = simulate(groups, enc, &x, op, chunk, seed + 5);
                        assert!(bits(&y) == bits(&all[root]), "{what}: not the all-reduce's bits");
                    }
                }
            }
        }
    }
}

/// The simulated all-reduce of `x` with the leaders folding in sub-pieces of `sub` elements.
fn simulate_sub(groups: &[usize], enc: Encoding, x: &[Vec<f32>], chunk: usize, sub: usize, seed: u64) -> Vec<Vec<f32>> {
    let (n, count) = (groups.len(), x[0].len());
    let lay = validate::layout(crate::algo::Collective::AllReduce, seed % 2 == 1);
    let plans: Vec<Plan> = (0..n).map(|r| all_reduce_in(r, groups, count, chunk, enc, sub)).collect();
    for p in &plans {
        validate::check(p, &|_| lay).unwrap_or_else(|e| panic!("{groups:?} {enc:?} sub={sub}: {e}"));
    }
    let sends: Vec<Vec<u8>> = x.iter().map(|v| bytemuck::cast_slice::<f32, u8>(v).to_vec()).collect();
    let at = vec![(lay, 0); n];
    let sim = Sim::new(
        plans,
        &sends,
        &vec![count * 4; n],
        &at,
        64 + seed as usize * 997,
        DataType::Float32,
        ReduceOp::Sum,
        seed,
    );
    let out = sim.run(1 << 24).unwrap_or_else(|e| panic!("{groups:?} {enc:?} sub={sub}: {e}"));
    out.recv.iter().map(|b| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()).collect()
}

/// A leader folds its host's inputs sub-piece by sub-piece and encodes each at its place in
/// the chunk's message: the bits are those of whole chunks read at once (no sub-piece split),
/// on every rank, for chunks and counts that are no multiple of the block or of the sub-piece.
#[test]
fn sub_pieces_keep_the_bits_of_whole_chunks() {
    for groups in [&[0, 0, 1, 1][..], &[0, 1, 0, 2, 1], &[0, 0, 0, 1]] {
        let n = groups.len();
        for (count, chunk) in [(1, 4000), (700, 4000), (5003, 4000), (5003, 6144), (70001, 1 << 20)] {
            let x: Vec<Vec<f32>> = (0..n).map(|r| (0..count).map(|i| wide(r, i)).collect()).collect();
            for enc in ENCODINGS {
                let whole = simulate_sub(groups, enc, &x, chunk, 1 << 30, 0);
                assert_within(enc, groups, &x, &whole[0], false, &format!("{groups:?} {enc:?} count={count}"));
                for (seed, sub) in [(1, 256), (2, 768), (3, SUB)] {
                    let y = simulate_sub(groups, enc, &x, chunk, sub, seed);
                    for (r, v) in y.iter().enumerate() {
                        assert!(
                            bits(v) == bits(&whole[0]),
                            "{groups:?} {enc:?} count={count} chunk={chunk} sub={sub}: rank {r} differs"
                        );
                    }
                }
            }
        }
    }
}
