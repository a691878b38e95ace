//! Runs every rank's window plan on host memory, phase by phase, and checks (1) that no byte
//! written by one rank in a phase is read or written by another rank in that phase, and (2)
//! the results against an independent reference. Folds are order-sensitive here
//! (`acc * P + x`), so a plan that folds out of rank order, or gives ranks different bits,
//! fails.

use super::*;
use std::collections::HashMap;

/// Order-sensitive combination of two values: the reference and the simulated fold agree only
/// when both fold in the same order.
fn combine(acc: u64, x: u64) -> u64 {
    acc.wrapping_mul(1_000_003).wrapping_add(x)
}

fn fold_ref(xs: impl Iterator<Item = u64>) -> u64 {
    xs.reduce(combine).expect("at least one source")
}

/// The PreMulSum factor of the simulation.
fn scale(x: u64) -> u64 {
    x.wrapping_mul(3)
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Key {
    User(usize),
    Area(usize, usize),
}

/// Every rank's memory: one user buffer holding its input at `place[r].0` and its output at
/// `place[r].1` (equal offsets in place), and its areas.
struct World {
    user: Vec<Vec<u64>>,
    areas: Vec<Vec<Vec<u64>>>,
    place: Vec<(usize, usize)>,
}

impl World {
    fn new(n: usize, user_len: usize, areas: &[usize], place: impl Fn(usize) -> (usize, usize)) -> World {
        World {
            user: vec![vec![u64::MAX; user_len]; n],
            areas: (0..n).map(|_| areas.iter().map(|&a| vec![u64::MAX - 1; a]).collect()).collect(),
            place: (0..n).map(place).collect(),
        }
    }

    fn key(&self, a: &At) -> (Key, usize) {
        match a.mem {
            Mem::Input(q) => (Key::User(q), self.place[q].0 + a.off),
            Mem::Output(q) => (Key::User(q), self.place[q].1 + a.off),
            Mem::Area { rank, id } => (Key::Area(rank, id), a.off),
        }
    }

    fn mem(&mut self, k: Key) -> &mut Vec<u64> {
        match k {
            Key::User(q) => &mut self.user[q],
            Key::Area(q, id) => &mut self.areas[q][id],
        }
    }
}

/// Who touched a byte in the current phase.
#[derive(Default)]
struct Touch {
    writer: Option<usize>,
    readers: Vec<usize>,
}

struct Phase {
    touched: HashMap<(Key, usize), Touch>,
}

impl Phase {
    fn read(&mut self, r: usize, k: Key, at: usize, len: usize) -> Result<(), String> {
        for i in at..at + len {
            let t = self.touched.entry((k, i)).or_default();
            if let Some(w) = t.writer.filter(|&w| w != r) {
                return Err(format!("rank {r} reads {k:?}[{i}], written by rank {w} in the same phase"));
            }
            t.readers.push(r);
        }
        Ok(())
    }

    fn write(&mut self, r: usize, k: Key, at: usize, len: usize) -> Result<(), String> {
        for i in at..at + len {
            let t = self.touched.entry((k, i)).or_default();
            if let Some(w) = t.writer.filter(|&w| w != r) {
                return Err(format!("rank {r} writes {k:?}[{i}], written by rank {w} in the same phase"));
            }
            if let Some(o) = t.readers.iter().find(|&&o| o != r) {
                return Err(format!("rank {r} writes {k:?}[{i}], read by rank {o} in the same phase"));
            }
            t.writer = Some(r);
        }
        Ok(())
    }
}

/// Runs `plans` (one per rank) on `w`; an error names a race or a barrier-count mismatch.
fn run(plans: &[WindowPlan], w: &mut World) -> Result<(), String> {
    let phases: Vec<Vec<&[WindowStep]>> =
        plans.iter().map(|p| p.ops.split(|o| matches!(o, WindowStep::Barrier)).collect()).collect();
    let k = phases[0].len();
    if let Some(r) = phases.iter().position(|p| p.len() != k) {
        return Err(format!("rank {r} has {} barriers, rank 0 {}", phases[r].len() - 1, k - 1));
    }
    for p in 0..k {
        let mut ph = Phase { touched: HashMap::new() };
        for (r, rank_phases) in phases.iter().enumerate() {
            for op in rank_phases[p] {
                match op {
                    WindowStep::Copy { from, to, len } => {
                        let ((fk, fa), (tk, ta)) = (w.key(from), w.key(to));
                        ph.read(r, fk, fa, *len)?;
                        ph.write(r, tk, ta, *len)?;
                        let src = w.mem(fk)[fa..fa + len].to_vec();
                        w.mem(tk)[ta..ta + len].copy_from_slice(&src);
                    }
                    WindowStep::Scale { at, len } => {
                        let (k, a) = w.key(at);
                        ph.read(r, k, a, *len)?;
                        ph.write(r, k, a, *len)?;
                        w.mem(k)[a..a + len].iter_mut().for_each(|x| *x = scale(*x));
                    }
                    WindowStep::Fold { from, to, len } => {
                        let srcs: Vec<(Key, usize)> = from.iter().map(|a| w.key(a)).collect();
                        for &(k, a) in &srcs {
                            ph.read(r, k, a, *len)?;
                        }
                        let vals: Vec<u64> =
                            (0..*len).map(|i| fold_ref(srcs.iter().map(|&(k, a)| w.mem(k)[a + i]))).collect();
                        for d in to {
                            let (k, a) = w.key(d);
                            ph.write(r, k, a, *len)?;
                            w.mem(k)[a..a + len].copy_from_slice(&vals);
                        }
                    }
                    WindowStep::Barrier => unreachable!("split at barriers"),
                }
            }
        }
    }
    Ok(())
}

fn x(r: usize, i: usize) -> u64 {
    (1000 * (r + 1) + i) as u64
}

/// Runs an all-reduce plan family for `n` ranks, `bytes` bytes; checks every output byte.
fn check_all_reduce(
    what: &str,
    n: usize,
    bytes: usize,
    in_place: bool,
    areas: &[usize],
    plan: impl Fn(usize) -> WindowPlan,
) {
    let mut w = World::new(n, 2 * bytes.max(1), areas, |_| if in_place { (0, 0) } else { (0, bytes) });
    for r in 0..n {
        for i in 0..bytes {
            w.user[r][i] = x(r, i);
        }
    }
    let plans: Vec<WindowPlan> = (0..n).map(plan).collect();
    let bounds = Bounds { input: bytes, output: bytes, areas: areas.to_vec(), nranks: n };
    for (r, p) in plans.iter().enumerate() {
        validate(p, &bounds).unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
    }
    run(&plans, &mut w).unwrap_or_else(|e| panic!("{what}: {e}"));
    for r in 0..n {
        let out = w.place[r].1;
        for i in 0..bytes {
            assert_eq!(w.user[r][out + i], fold_ref((0..n).map(|q| x(q, i))), "{what}: rank {r} byte {i}");
        }
    }
}

#[test]
fn direct_all_reduce_is_exact_race_free_and_moves_2ns() {
    for n in 1..=5 {
        for count in [0, 1, 3, 17, 40, 129] {
            for elem in [1, 2, 4, 8] {
                for in_place in [false, true] {
                    let what = format!("direct n {n} count {count} elem {elem} in place {in_place}");
                    check_all_reduce(&what, n, count * elem, in_place, &[], |r| all_reduce_direct(r, n, count, elem));
                    // Traffic: every input byte read once and every output byte written once.
                    let (mut read, mut written) = (0, 0);
                    for r in 0..n {
                        let p = all_reduce_direct(r, n, count, elem);
                        assert_eq!(p.barriers(), 2, "{what}");
                        for op in &p.ops {
                            if let WindowStep::Fold { from, to, len } = op {
                                read += from.len() * len;
                                written += to.len() * len;
                                assert!(from.iter().chain(to).all(|a| a.off % 16 == 0 || elem * count < 16), "{what}");
                            }
                        }
                    }
                    assert_eq!((read, written), (n * count * elem, n * count * elem), "{what}");
                }
            }
        }
    }
}

#[test]
fn staged_all_reduce_is_exact_and_race_free() {
    for n in 2..=4 {
        for count in [1, 5, 33, 100] {
            for area in [4, 12, 64, 1024] {
                for in_place in [false, true] {
                    let what = format!("staged n {n} count {count} area {area} in place {in_place}");
                    check_all_reduce(&what, n, count * 4, in_place, &[area, area], |r| {
                        all_reduce_staged(r, n, count, 4, area)
                    });
                }
            }
        }
    }
}

#[test]
fn small_all_reduces_reuse_their_slots_without_a_closing_barrier() {
    // Three calls back to back (parities 0, 1, 0) as one plan: the race check sees that a slot
    // is rewritten only after every rank's fold of it.
    for n in 2..=5 {
        for count in [1, 7, 64] {
            let what = format!("small n {n} count {count}");
            let calls = |r: usize| {
                let mut p = all_reduce_small(r, n, count, 1, 0);
                p.ops.extend(all_reduce_small(r, n, count, 1, 1).ops);
                p.ops.extend(all_reduce_small(r, n, count, 1, 0).ops);
                p
            };
            check_all_reduce(&what, n, count, false, &[0, 0, count, count], calls);
            // In place, one call (a second would fold the first one's results).
            check_all_reduce(&what, n, count, true, &[0, 0, count, count], |r| all_reduce_small(r, n, count, 1, 1));
        }
    }
    // A closing barrier is needed with one slot: the same parity twice in a row races.
    let same = |r: usize| {
        let mut p = all_reduce_small(r, 2, 4, 1, 0);
        p.ops.extend(all_reduce_small(r, 2, 4, 1, 0).ops);
        p
    };
    let mut w = World::new(2, 8, &[0, 0, 4, 4], |_| (0, 4));
    let plans: Vec<WindowPlan> = (0..2).map(same).collect();
    let e = run(&plans, &mut w).expect_err("a slot rewritten while a peer reads it");
    assert!(e.contains("in the same phase"), "{e}");
}

#[test]
fn captured_small_all_reduces_mix_with_uncaptured_ones_in_any_order() {
    // A graph may replay between any two uncaptured calls, and replays follow each other:
    // uncaptured calls alternate parities, captured ones use their own slot.
    let areas = [0, 0, 8, 8, 8];
    for n in 2..=4 {
        for pattern in ["uuccuc", "ccuuc", "ucucu", "cccc"] {
            let plans = |r: usize| {
                let mut p = WindowPlan::default();
                let mut parity = 0;
                for k in pattern.chars() {
                    let call = if k == 'c' {
                        all_reduce_small_captured(r, n, 8, 1)
                    } else {
                        parity ^= 1;
                        all_reduce_small(r, n, 8, 1, parity)
                    };
                    p.ops.extend(call.ops);
                }
                p
            };
            let what = format!("small calls {pattern} on {n} ranks");
            check_all_reduce(&what, n, 8, false, &areas, plans);
        }
    }
    // Through a parity slot instead (with its closing barrier), a replay right after an
    // uncaptured call of that parity races with the peers' reads of it.
    let parity_slot = |r: usize| {
        let mut p = all_reduce_small(r, 2, 8, 1, 1);
        let mut c = all_reduce_small(r, 2, 8, 1, 1);
        c.ops.push(WindowStep::Barrier);
        p.ops.extend(c.ops);
        p
    };
    let mut w = World::new(2, 16, &areas, |_| (0, 8));
    let plans: Vec<WindowPlan> = (0..2).map(parity_slot).collect();
    let e = run(&plans, &mut w).expect_err("a slot rewritten while a peer reads it");
    assert!(e.contains("in the same phase"), "{e}");
}

#[test]
fn one_shot_collectives_compute_every_collective_in_and_out_of_place() {
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
                            for scaled in [false, coll.reduces()] {
                                one_shot_case(coll, n, count, area, in_place, scaled);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn one_shot_case(coll: Collective, n: usize, count: usize, area: usize, in_place: bool, scaled: bool) {
    let what = format!("{coll:?} n {n} count {count} area {area} in place {in_place} scaled {scaled}");
    if crate::algo::select::oneshot_blocks(coll, n) > area {
        assert!(collective(coll, 0, n, count, 1, area, scaled).ops.is_empty(), "{what}");
        return;
    }
    let blk = count;
    // NCCL's in-place layouts: offsets of send and receive in each rank's buffer.
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
    let mut w = World::new(n, 2 * n * blk, &[area], place);
    for r in 0..n {
        let (s, _) = place(r);
        for i in 0..coll.buffer_counts(r, n, count).0 {
            w.user[r][s + i] = x(r, i);
        }
    }
    let plans: Vec<WindowPlan> = (0..n).map(|r| collective(coll, r, n, count, 1, area, scaled)).collect();
    let bounds = Bounds { input: n * blk, output: n * blk, areas: vec![area], nranks: n };
    for p in &plans {
        validate(p, &bounds).unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    run(&plans, &mut w).unwrap_or_else(|e| panic!("{what}: {e}"));
    let f = |v: u64| if scaled { scale(v) } else { v };
    for r in 0..n {
        let want: Vec<u64> = match coll {
            Collective::Broadcast { root } => (0..count).map(|i| x(root, i)).collect(),
            Collective::Reduce { root } if r == root => {
                (0..count).map(|i| fold_ref((0..n).map(|q| f(x(q, i))))).collect()
            }
            Collective::AllGather => (0..n * count).map(|j| x(j / count, j % count)).collect(),
            Collective::Gather { root } if r == root => (0..n * count).map(|j| x(j / count, j % count)).collect(),
            Collective::ReduceScatter => (0..count).map(|i| fold_ref((0..n).map(|q| f(x(q, r * count + i))))).collect(),
            Collective::AllToAll => (0..n * count).map(|j| x(j / count, r * count + j % count)).collect(),
            Collective::Scatter { root } => (0..count).map(|i| x(root, r * count + i)).collect(),
            _ => continue,
        };
        let out = place(r).1;
        assert_eq!(&w.user[r][out..out + want.len()], &want[..], "{what}: rank {r}");
    }
}

#[test]
fn segments_are_aligned_and_cover_the_count() {
    for count in [0, 1, 15, 16, 17, 1000] {
        for n in 1..=6 {
            for align in [1, 2, 4, 16] {
                let s = segments(count, n, align);
                assert_eq!(s.len(), n);
                assert_eq!(s.iter().map(|p| p.1).sum::<usize>(), count);
                let mut next = 0;
                for &(f, l) in &s {
                    assert_eq!(f, next.min(count));
                    assert!(f % align == 0 || f == count, "count {count} n {n} align {align}: {s:?}");
                    next = f + l;
                }
            }
        }
    }
}

#[test]
fn validate_refuses_ranges_past_their_memory() {
    let b = Bounds { input: 16, output: 16, areas: vec![8], nranks: 2 };
    assert!(validate(&all_reduce_direct(0, 2, 4, 4), &b).is_ok());
    let e = validate(&all_reduce_direct(1, 2, 5, 4), &b).expect_err("20 bytes in 16");
    assert!(e.contains("past the 16 bytes"), "{e}");
    let e = validate(&all_reduce_direct(0, 3, 4, 4), &b).expect_err("rank 2 of 2");
    assert!(e.contains("rank 2 of 2"), "{e}");
    let b = Bounds { areas: vec![16], ..b };
    let e = validate(&all_reduce_staged(1, 2, 4, 4, 16), &b).expect_err("no result area");
    assert!(e.contains("no area 1"), "{e}");
}

/// Sharing mixes for `n` ranks: nothing, everything, and some ranks' inputs or outputs only
/// (in place, a rank's input and output are one buffer: both shared or neither).
fn arena_mixes(n: usize, in_place: bool) -> Vec<Vec<(bool, bool)>> {
    let pick = |f: &dyn Fn(usize) -> (bool, bool)| -> Vec<(bool, bool)> {
        (0..n).map(|q| if in_place { (f(q).0, f(q).0) } else { f(q) }).collect()
    };
    let mut v = vec![
        pick(&|_| (false, false)),
        pick(&|_| (true, true)),
        pick(&|q| (q % 2 == 0, q % 2 == 0)),
        pick(&|q| (q == 0, false)),
        pick(&|q| (false, q == n - 1)),
        pick(&|q| (q % 2 == 1, q % 3 == 0)),
    ];
    v.dedup();
    v
}

/// Bytes and barriers of rank `rank`'s part of an arena all-reduce as the host arena's own
/// loop counted them before it ran plans: (copied in, folded from, fold results written,
/// copied out, barriers).
fn arena_traffic_by_hand(
    rank: usize,
    n: usize,
    count: usize,
    es: usize,
    slot: usize,
    shared: &[(bool, bool)],
) -> (usize, usize, usize, usize, usize) {
    let per_piece = slot / es;
    let align = (64 / es).max(1);
    let (mut t, mut start) = ((0, 0, 0, 0, 0), 0);
    while start < count {
        let m = per_piece.min(count - start);
        let per = m.div_ceil(n).div_ceil(align) * align;
        let slice = |q: usize| ((q * per).min(m), ((q + 1) * per).min(m));
        let (lo, hi) = slice(rank);
        if !shared[rank].0 {
            t.0 += (m - (hi - lo)) * es;
        }
        t.1 += n * (hi - lo) * es;
        t.2 += (hi - lo) * es * if shared[rank].1 { 1 } else { 2 };
        t.3 += (0..n).filter(|&q| q != rank).map(|q| (slice(q).1 - slice(q).0) * es).sum::<usize>();
        t.4 += 2;
        start += m;
    }
    if count > 0 && shared.iter().any(|&(i, o)| i || o) {
        t.4 += 1;
    }
    t
}

#[test]
fn arena_all_reduce_is_exact_race_free_and_moves_what_the_arena_moved() {
    for n in 2..=5 {
        for (count, es) in [(1, 4), (7, 8), (40, 4), (100, 4), (300, 4), (129, 8), (70, 1)] {
            for slot in [64, 100, 256, 4096] {
                for in_place in [false, true] {
                    for shared in arena_mixes(n, in_place) {
                        let what =
                            format!("arena n {n} count {count} es {es} slot {slot} in place {in_place} {shared:?}");
                        let plan = |r: usize, h: usize| arena_all_reduce(r, n, count, es, slot, &shared, h);
                        // After the call, the caller writes its buffers again (a copy onto
                        // itself is a read and a write here): no peer may still read them.
                        let bytes = count * es;
                        let reuse = |r: usize| {
                            let mut p = plan(r, 1);
                            p.ops.push(WindowStep::Copy { from: At::input(r, 0), to: At::input(r, 0), len: bytes });
                            p.ops.push(WindowStep::Copy { from: At::output(r, 0), to: At::output(r, 0), len: bytes });
                            p
                        };
                        check_all_reduce(&what, n, bytes, in_place, &[slot, slot], reuse);
                        for r in 0..n {
                            let p = plan(r, 0);
                            let mut t = (0, 0, 0, 0, p.barriers());
                            for op in &p.ops {
                                match op {
                                    WindowStep::Copy { to, len, .. } if matches!(to.mem, Mem::Area { .. }) => {
                                        t.0 += len
                                    }
                                    WindowStep::Copy { len, .. } => t.3 += len,
                                    WindowStep::Fold { from, to, len } => {
                                        t.1 += from.len() * len;
                                        t.2 += to.len() * len;
                                        // Rank order, and slices on cache lines of the piece.
                                        assert!(
                                            from.iter().enumerate().all(|(q, a)| match a.mem {
                                                Mem::Input(p) | Mem::Area { rank: p, .. } => p == q,
                                                Mem::Output(_) => false,
                                            }),
                                            "{what}: {from:?}"
                                        );
                                        let piece = (slot / es) * es;
                                        assert_eq!(to[0].off % piece % ARENA_ALIGN, 0, "{what}");
                                    }
                                    _ => {}
                                }
                            }
                            assert_eq!(t, arena_traffic_by_hand(r, n, count, es, slot, &shared), "{what}: rank {r}");
                            // What runs before the first barrier depends on this rank's own
                            // sharing and the first piece only.
                            let mut alone = vec![(false, false); n];
                            alone[r] = shared[r];
                            let first = (slot / es).min(count);
                            let pre = arena_all_reduce(r, n, first, es, slot, &alone, 0);
                            let k = |p: &WindowPlan| p.ops.iter().position(|o| *o == WindowStep::Barrier).unwrap();
                            assert_eq!(p.ops[..k(&p)], pre.ops[..k(&pre)], "{what}: rank {r}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn arena_calls_back_to_back_reuse_the_halves_without_a_closing_barrier() {
    // Out of place (a second call in place would fold the first one's results), every mix,
    // calls of different sizes (their slices lie elsewhere in the slots): each call starts on
    // the half after the last piece of the one before.
    for n in 2..=4 {
        for (count, slot) in [(10, 16), (30, 64), (64, 64), (200, 256), (5, 4096)] {
            for shared in arena_mixes(n, false) {
                let what = format!("arena calls n {n} count {count} slot {slot} {shared:?}");
                let calls = |r: usize| {
                    let (mut p, mut h) = (WindowPlan::default(), 0);
                    for c in [count, count / 2 + 1, count] {
                        p.ops.extend(arena_all_reduce(r, n, c, 4, slot, &shared, h).ops);
                        h ^= arena_pieces(c, 4, slot) & 1;
                    }
                    p
                };
                check_all_reduce(&what, n, count * 4, false, &[slot, slot], calls);
            }
        }
    }
    // Starting the next call on the half of this call's last piece races with its copy-out:
    // rank 1 copies the next call's first 128 bytes into its slot while rank 0 still copies
    // out rank 1's slice of this call, bytes 64..128 of that slot.
    let same = |r: usize| {
        let mut p = arena_all_reduce(r, 2, 128, 1, 256, &[(false, false); 2], 0);
        p.ops.extend(arena_all_reduce(r, 2, 256, 1, 256, &[(false, false); 2], 0).ops);
        p
    };
    let mut w = World::new(2, 512, &[256, 256], |_| (0, 256));
    let plans: Vec<WindowPlan> = (0..2).map(same).collect();
    let e = run(&plans, &mut w).expect_err("a half rewritten while a peer copies out of it");
    assert!(e.contains("in the same phase"), "{e}");
}
