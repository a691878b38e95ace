//! A deterministic simulator of plans (tests only): every rank's [`Plan`] is stepped in one
//! thread over bounded in-memory pipes, in an order drawn from a seeded random generator, with
//! time (rounds) as an input. It follows the engine's rules: a step starts once the steps it
//! depends on are done; sends to one peer, and receives from one peer, run one at a time in
//! plan order and may move any part of their bytes at a time; a send reads its source when
//! its bytes go out; a reducing receive stages its bytes and reduces when all have arrived.
//!
//! Ordering bugs (a missing dependency, a message order two ranks disagree on) then show as a
//! wrong result or a deadlock at once instead of a timeout, and a deadlock is reported with
//! the stuck ranks and the steps they wait at.

use super::validate::{layout, Layout};
use super::{Action, Buf, Collective, Plan, Region, Step};
use crate::types::{DataType, ReduceOp};
use std::collections::{HashMap, VecDeque};

/// Percent of startable steps a rank leaves for a later turn (unless nothing else moves).
const SKIP: u64 = 15;

/// Every collective with a plan builder on `n` ranks, roots at both ends and in the middle.
pub(crate) fn collectives(n: usize) -> Vec<Collective> {
    let mut v = vec![Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll];
    let mut roots = vec![0, n / 2, n - 1];
    roots.dedup();
    for root in roots {
        v.extend([
            Collective::Broadcast { root },
            Collective::Reduce { root },
            Collective::Gather { root },
            Collective::Scatter { root },
        ]);
    }
    v
}

/// A small seeded generator (SplitMix64): the whole schedule follows from the seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A number in `1..=max` (`max` at least 1): `max` half of the time, else uniform.
    fn upto(&mut self, max: usize) -> usize {
        let x = self.next();
        if x & 1 == 0 {
            max
        } else {
            1 + ((x >> 1) % max as u64) as usize
        }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

/// One rank: its plan, its memory (send, receive and scratch bytes in one vector, aliased as
/// the call's layout says) and where each of its steps stands.
struct Rank {
    plan: Plan,
    mem: Vec<u8>,
    /// Offsets in `mem` of the send, receive and scratch buffers, and their lengths.
    base: [usize; 3],
    len: [usize; 3],
    done: Vec<bool>,
    remaining: usize,
    /// Bytes already moved by each send / receive step.
    moved: Vec<usize>,
    /// Per peer: the peer, its queue of steps, and the pipe they use.
    sends: Vec<(usize, VecDeque<usize>, usize)>,
    recvs: Vec<(usize, VecDeque<usize>, usize)>,
    locals: Vec<usize>,
    /// Bytes staged by the receive steps that reduce.
    staged: HashMap<usize, Vec<u8>>,
}

impl Rank {
    /// In place, the call layer hands the engine one buffer as both send and receive buffer
    /// (the larger of the two, see [`crate::coll`]).
    fn new(plan: Plan, send_len: usize, recv_len: usize, at: Layout) -> Rank {
        let (send_at, recv_at, send_len, recv_len) = match at {
            Layout::Apart => (recv_len, 0, send_len, recv_len),
            Layout::InPlace(_) => (0, 0, send_len.max(recv_len), send_len.max(recv_len)),
        };
        let scratch_at = (recv_at + recv_len).max(send_at + send_len);
        let scratch = plan.scratch.first().copied().unwrap_or(0);
        let n = plan.nodes.len();
        let mut r = Rank {
            mem: vec![0; scratch_at + scratch],
            base: [send_at, recv_at, scratch_at],
            len: [send_len, recv_len, scratch],
            done: vec![false; n],
            remaining: n,
            moved: vec![0; n],
            sends: Vec::new(),
            recvs: Vec::new(),
            locals: Vec::new(),
            staged: HashMap::new(),
            plan,
        };
        for (i, node) in r.plan.nodes.iter().enumerate() {
            let queue = match node.step {
                Step::Send { .. } => &mut r.sends,
                Step::Recv { .. } => &mut r.recvs,
                _ => {
                    r.locals.push(i);
                    continue;
                }
            };
            let peer = match node.step {
                Step::Send { peer, .. } | Step::Recv { peer, .. } => peer,
                _ => unreachable!(),
            };
            match queue.iter_mut().find(|(p, _, _)| *p == peer) {
                Some((_, q, _)) => q.push_back(i),
                None => queue.push((peer, VecDeque::from([i]), 0)),
            }
        }
        r
    }

    /// The bytes of `reg` in `mem`, or an error when it is outside its buffer.
    fn span(&self, reg: Region) -> Result<std::ops::Range<usize>, String> {
        let b = match reg.buf {
            Buf::Send => 0,
            Buf::Recv => 1,
            Buf::Scratch => 2,
        };
        if reg.call != 0 || reg.off + reg.len > self.len[b] {
            return Err(format!("region {reg:?} is outside its buffer of {} bytes", self.len[b]));
        }
        Ok(self.base[b] + reg.off..self.base[b] + reg.off + reg.len)
    }

    fn ready(&self, i: usize) -> bool {
        !self.done[i] && self.plan.nodes[i].deps.iter().all(|&d| self.done[d])
    }

    fn finish(&mut self, i: usize) {
        self.done[i] = true;
        self.remaining -= 1;
    }
}

/// The regions a step names.
fn regions(step: &Step) -> Vec<Region> {
    match *step {
        Step::Send { src, .. } => vec![src],
        Step::Recv { dst, action: Action::Store, .. } => vec![dst],
        Step::Recv { dst, action: Action::Reduce { with } | Action::ReduceFinal { with }, .. } => vec![dst, with],
        Step::Copy { src, dst } => vec![src, dst],
        Step::Finish { dst } => vec![dst],
        Step::Fold { src, dst } | Step::Encode { src, dst, .. } | Step::Decode { src, dst, .. } => vec![src, dst],
    }
}

/// Runs rank `r`'s local step `i` (a copy, a fold, an encode or decode, a finish) on its memory.
fn local_step(r: &mut Rank, i: usize, dtype: DataType, op: ReduceOp, nranks: usize) -> Result<(), String> {
    let overlap = |s: &std::ops::Range<usize>, d: &std::ops::Range<usize>| s.start < d.end && d.start < s.end;
    match r.plan.nodes[i].step {
        Step::Copy { src, dst } => {
            let (s, d) = (r.span(src)?, r.span(dst)?);
            r.mem.copy_within(s, d.start);
        }
        Step::Finish { dst } => {
            if op == ReduceOp::Avg && nranks > 1 {
                let d = r.span(dst)?;
                crate::reduce::divide(dtype, &mut r.mem[d], nranks);
            }
        }
        Step::Fold { src, dst } => {
            let (s, d) = (r.span(src)?, r.span(dst)?);
            if dst.len == 0 || src.len % dst.len != 0 || overlap(&s, &d) {
                return Err(format!("fold {src:?} into {dst:?}: bad shape"));
            }
            let pieces = r.mem[s].to_vec();
            crate::reduce::fold(dtype, op, &mut r.mem[d], &pieces, src.len / dst.len);
        }
        Step::Encode { src, dst, enc } => {
            let (s, d) = (r.span(src)?, r.span(dst)?);
            if dst.len != enc.size(src.len / 4) || overlap(&s, &d) {
                return Err(format!("encode {src:?} into {dst:?}: bad shape"));
            }
            let x = r.mem[s].to_vec();
            enc.encode(&x, &mut r.mem[d]);
        }
        Step::Decode { src, dst, enc, add } => {
            let (s, d) = (r.span(src)?, r.span(dst)?);
            if src.len != enc.size(dst.len / 4) || overlap(&s, &d) {
                return Err(format!("decode {src:?} into {dst:?}: bad shape"));
            }
            let w = r.mem[s].to_vec();
            if add {
                enc.decode_add(&w, &mut r.mem[d]);
            } else {
                enc.decode(&w, &mut r.mem[d]);
            }
        }
        _ => unreachable!(),
    }
    Ok(())
}

/// The memory of a receive that completed: `Store` wrote it already; a reduction combines.
fn complete_recv(r: &mut Rank, i: usize, dtype: DataType, op: ReduceOp, nranks: usize) -> Result<(), String> {
    let Step::Recv { dst, action, .. } = r.plan.nodes[i].step else { unreachable!() };
    let with = match action {
        Action::Store => return Ok(()),
        Action::Reduce { with } | Action::ReduceFinal { with } => with,
    };
    let incoming = r.staged.remove(&i).unwrap_or_default();
    let (d, w) = (r.span(dst)?, r.span(with)?);
    let operand = r.mem[w].to_vec();
    crate::reduce::reduce_to(dtype, op, &mut r.mem[d.clone()], &operand, &incoming);
    if matches!(action, Action::ReduceFinal { .. }) && op == ReduceOp::Avg {
        crate::reduce::divide(dtype, &mut r.mem[d], nranks);
    }
    Ok(())
}

/// The outcome of a run: each rank's receive buffer, and the rounds it took.
pub(crate) struct Outcome {
    pub(crate) recv: Vec<Vec<u8>>,
    pub(crate) rounds: u64,
}

/// All ranks of one call, and the pipes between them.
pub(crate) struct Sim {
    ranks: Vec<Rank>,
    pipes: Vec<VecDeque<u8>>,
    /// Sender and receiver of each pipe.
    ends: Vec<(usize, usize)>,
    capacity: usize,
    /// Ranks to visit next round (something may have changed for them), and whether listed.
    next: Vec<usize>,
    listed: Vec<bool>,
    /// Ranks not done.
    busy: usize,
    dtype: DataType,
    op: ReduceOp,
    rng: Rng,
}

impl Sim {
    /// `plans[r]` is rank `r`'s plan; `sends[r]` its send buffer's contents and `recv_len[r]`
    /// its receive buffer's length; `at[r]` whether it runs in place, and then at which byte
    /// of the one buffer its send data starts. Pipes hold at most `capacity` bytes each way.
    #[allow(clippy::too_many_arguments)] // one per simulated setting; built only by the tests
    pub(crate) fn new(
        plans: Vec<Plan>,
        sends: &[Vec<u8>],
        recv_len: &[usize],
        at: &[(Layout, usize)],
        capacity: usize,
        dtype: DataType,
        op: ReduceOp,
        seed: u64,
    ) -> Sim {
        let mut ranks: Vec<Rank> = plans
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let (layout, send_off) = at[i];
                let mut r = Rank::new(p, sends[i].len(), recv_len[i], layout);
                // Unwritten receive bytes read as NaN, so that a missed write shows.
                let (b, l) = (r.base[1], r.len[1]);
                r.mem[b..b + l].fill(0xFF);
                let s = r.base[0] + send_off;
                r.mem[s..s + sends[i].len()].copy_from_slice(&sends[i]);
                r
            })
            .collect();
        let mut ids: HashMap<(usize, usize), usize> = HashMap::new();
        let mut ends = Vec::new();
        let mut id = |e: (usize, usize)| {
            *ids.entry(e).or_insert_with(|| {
                ends.push(e);
                ends.len() - 1
            })
        };
        for (me, r) in ranks.iter_mut().enumerate() {
            for (peer, _, pipe) in &mut r.sends {
                *pipe = id((me, *peer));
            }
            for (peer, _, pipe) in &mut r.recvs {
                *pipe = id((*peer, me));
            }
        }
        let n = ranks.len();
        Sim {
            busy: ranks.iter().filter(|r| r.remaining > 0).count(),
            ranks,
            pipes: vec![VecDeque::new(); ends.len()],
            ends,
            capacity: capacity.max(1),
            next: (0..n).collect(),
            listed: vec![true; n],
            dtype,
            op,
            rng: Rng::new(seed),
        }
    }

    /// Puts rank `r` on the next round's list.
    fn wake(&mut self, r: usize) {
        if !self.listed[r] {
            self.listed[r] = true;
            self.next.push(r);
        }
    }

    /// One rank's turn: tries each of its startable steps once, in a random order, skipping
    /// some unless `all`. Returns whether anything moved; puts on the next round's list this
    /// rank when it moved or skipped something, and the peers whose pipes it touched.
    fn turn(&mut self, me: usize, all: bool) -> Result<bool, String> {
        let busy = self.ranks[me].remaining > 0;
        let moved = self.steps(me, all)?;
        if busy && self.ranks[me].remaining == 0 {
            self.busy -= 1;
        }
        Ok(moved)
    }

    /// Tries each of rank `me`'s startable steps once, the three kinds (local steps, sends,
    /// receives) in a random order, skipping some unless `all`. Returns whether anything moved;
    /// puts `me` on the next round's list when it moved or skipped something.
    fn steps(&mut self, me: usize, all: bool) -> Result<bool, String> {
        let mut moved = false;
        let mut again = false;
        let mut kinds = [0u8, 1, 2];
        self.rng.shuffle(&mut kinds);
        for kind in kinds {
            moved |= match kind {
                0 => self.locals(me, all, &mut again)?,
                1 => self.sends(me, all, &mut again)?,
                _ => self.recvs(me, all, &mut again)?,
            };
        }
        if moved || again {
            self.wake(me);
        }
        Ok(moved)
    }

    /// Runs rank `me`'s ready local steps (copies, folds, codecs, finishes), skipping some
    /// unless `all` (setting `again`). Returns whether one ran.
    fn locals(&mut self, me: usize, all: bool, again: &mut bool) -> Result<bool, String> {
        let (n, dtype, op) = (self.ranks.len(), self.dtype, self.op);
        let mut moved = false;
        let mut k = 0;
        while k < self.ranks[me].locals.len() {
            let i = self.ranks[me].locals[k];
            if !self.ranks[me].ready(i) {
                k += 1;
                continue;
            }
            if !all && self.rng.chance(SKIP) {
                *again = true;
                k += 1;
                continue;
            }
            let r = &mut self.ranks[me];
            local_step(r, i, dtype, op, n)?;
            r.locals.swap_remove(k);
            r.finish(i);
            moved = true;
        }
        Ok(moved)
    }

    /// Moves a random part of each of rank `me`'s ready front sends into its pipe (as much as
    /// the pipe takes), skipping some unless `all` (setting `again`); a send whose bytes all
    /// went is done. Returns whether anything moved.
    fn sends(&mut self, me: usize, all: bool, again: &mut bool) -> Result<bool, String> {
        let mut moved = false;
        for q in 0..self.ranks[me].sends.len() {
            let (peer, front, pi) = {
                let (p, queue, pi) = &self.ranks[me].sends[q];
                (*p, queue.front().copied(), *pi)
            };
            let Some(i) = front else { continue };
            if !self.ranks[me].ready(i) {
                continue;
            }
            if !all && self.rng.chance(SKIP) {
                *again = true;
                continue;
            }
            let Step::Send { src, .. } = self.ranks[me].plan.nodes[i].step else { unreachable!() };
            let pipe = &mut self.pipes[pi];
            let left = src.len - self.ranks[me].moved[i];
            let room = self.capacity - pipe.len();
            if left > 0 && room > 0 {
                let k = self.rng.upto(left.min(room));
                let r = &mut self.ranks[me];
                let s = r.span(src)?;
                let from = s.start + r.moved[i];
                pipe.extend(&r.mem[from..from + k]);
                r.moved[i] += k;
                moved = true;
                self.wake(peer);
            }
            let r = &mut self.ranks[me];
            if r.moved[i] == src.len {
                r.sends[q].1.pop_front();
                r.finish(i);
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Takes a random part of what waits in each of rank `me`'s front receives' pipes, skipping
    /// some unless `all` (setting `again`); a receive with all its bytes and its dependencies
    /// done completes. Returns whether anything moved.
    fn recvs(&mut self, me: usize, all: bool, again: &mut bool) -> Result<bool, String> {
        let n = self.ranks.len();
        let mut moved = false;
        for q in 0..self.ranks[me].recvs.len() {
            let (peer, front, pi) = {
                let (p, queue, pi) = &self.ranks[me].recvs[q];
                (*p, queue.front().copied(), *pi)
            };
            let Some(i) = front else { continue };
            if !all && self.rng.chance(SKIP) {
                *again = true;
                continue;
            }
            let Step::Recv { dst, action, .. } = self.ranks[me].plan.nodes[i].step else { unreachable!() };
            // A store writes its destination directly, so it waits for its
            // dependencies; a reduction stages its bytes and waits only to apply.
            let ready = self.ranks[me].ready(i);
            let may_read = ready || action != Action::Store;
            let left = dst.len - self.ranks[me].moved[i];
            if may_read && left > 0 && !self.pipes[pi].is_empty() {
                let k = self.rng.upto(left.min(self.pipes[pi].len()));
                let (pipe, r) = (&mut self.pipes[pi], &mut self.ranks[me]);
                if action == Action::Store {
                    let d = r.span(dst)?;
                    let at = d.start + r.moved[i];
                    for (b, x) in r.mem[at..at + k].iter_mut().zip(pipe.drain(..k)) {
                        *b = x;
                    }
                } else {
                    r.staged.entry(i).or_default().extend(pipe.drain(..k));
                }
                r.moved[i] += k;
                moved = true;
                self.wake(peer);
            }
            if ready && self.ranks[me].moved[i] == dst.len {
                complete_recv(&mut self.ranks[me], i, self.dtype, self.op, n)?;
                let r = &mut self.ranks[me];
                r.recvs[q].1.pop_front();
                r.finish(i);
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Runs until every rank is done, for at most `max_rounds` rounds (a round gives every
    /// rank a turn, in a random order). A round in which nothing can move is a deadlock: the
    /// error names the stuck ranks and the steps they wait at.
    pub(crate) fn run(mut self, max_rounds: u64) -> Result<Outcome, String> {
        for r in &self.ranks {
            if let Some(reg) = r.plan.nodes.iter().flat_map(|nd| regions(&nd.step)).find(|&g| r.span(g).is_err()) {
                return Err(r.span(reg).unwrap_err());
            }
        }
        let n = self.ranks.len();
        let mut rounds = 0;
        while self.busy > 0 {
            if rounds == max_rounds {
                return Err(format!("not done after {max_rounds} rounds: {}", self.stuck()));
            }
            rounds += 1;
            // Only ranks for which something changed can move.
            let mut order = std::mem::take(&mut self.next);
            for &r in &order {
                self.listed[r] = false;
            }
            self.rng.shuffle(&mut order);
            let mut moved = false;
            for &r in &order {
                moved |= self.turn(r, false)?;
            }
            if !moved {
                for r in 0..n {
                    moved |= self.turn(r, true)?;
                }
            }
            if !moved {
                return Err(format!("deadlock after {rounds} rounds: {}", self.stuck()));
            }
        }
        if let Some(p) = (0..self.pipes.len()).find(|&p| !self.pipes[p].is_empty()) {
            let (a, b) = self.ends[p];
            return Err(format!("{} bytes from rank {a} to rank {b} were never received", self.pipes[p].len()));
        }
        let recv = self.ranks.iter().map(|r| r.mem[r.base[1]..r.base[1] + r.len[1]].to_vec()).collect();
        Ok(Outcome { recv, rounds })
    }

    /// The ranks not done, each with the first step it waits at (at most 8 named).
    fn stuck(&self) -> String {
        let stuck: Vec<usize> = (0..self.ranks.len()).filter(|&r| self.ranks[r].remaining > 0).collect();
        let named: Vec<String> = stuck
            .iter()
            .take(8)
            .map(|&r| {
                let rank = &self.ranks[r];
                let i = (0..rank.done.len()).find(|&i| !rank.done[i]).unwrap_or(0);
                format!("rank {r} at step {i} ({:?}, {} bytes moved)", rank.plan.nodes[i].step, rank.moved[i])
            })
            .collect();
        format!("stuck ranks {stuck:?}: {}", named.join("; "))
    }
}

/// Rank `r`'s send element `i`: a small integer, so that sums in any order are exact.
fn value(r: usize, i: usize) -> f64 {
    ((r * 31 + i * 7) % 13) as f64 + 1.0
}

/// The f64 reference of rank `r`'s receive buffer for `coll` on `n` ranks with `count`
/// elements (NCCL's count argument) under `op` (sum or max).
fn reference(coll: Collective, op: ReduceOp, r: usize, n: usize, count: usize) -> Vec<f64> {
    let fold = |vals: &mut dyn Iterator<Item = f64>| match op {
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        _ => vals.sum(),
    };
    let (_, recv) = coll.buffer_counts(r, n, count);
    (0..recv)
        .map(|j| match coll {
            Collective::AllReduce => fold(&mut (0..n).map(|q| value(q, j))),
            Collective::Reduce { .. } => fold(&mut (0..n).map(|q| value(q, j))),
            Collective::Broadcast { root } => value(root, j),
            Collective::AllGather | Collective::Gather { .. } => value(j / count, j % count),
            Collective::ReduceScatter => fold(&mut (0..n).map(|q| value(q, r * count + j))),
            Collective::AllToAll => value(j / count, r * count + j % count),
            Collective::Scatter { root } => value(root, r * count + j),
            Collective::Send { .. } | Collective::Recv { .. } => unreachable!(),
        })
        .collect()
}

/// Whether rank `r`'s call is in place when the caller asks for `in_place`: as the call layer
/// decides it ([`crate::coll`]), only where the rank has both a send and a receive buffer.
fn in_place_at(coll: Collective, r: usize, n: usize, count: usize, in_place: bool) -> bool {
    let (s, rl) = coll.buffer_counts(r, n, count);
    in_place && s > 0 && rl > 0
}

/// Simulates `coll` on `n` ranks (plans from `build(rank, in_place)`) with `count` f64
/// elements, and checks every receive buffer against the f64 reference. Returns the rounds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check(
    coll: Collective,
    n: usize,
    count: usize,
    in_place: bool,
    op: ReduceOp,
    capacity: usize,
    seed: u64,
    build: &dyn Fn(usize, bool) -> Plan,
) -> Result<u64, String> {
    let mut sends = Vec::new();
    let (mut recv_len, mut at, mut result_at) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..n {
        let (s, rl) = coll.buffer_counts(r, n, count);
        let vals: Vec<f64> = (0..s).map(|i| value(r, i)).collect();
        sends.push(bytemuck::cast_slice::<f64, u8>(&vals).to_vec());
        recv_len.push(rl * 8);
        let mine = in_place_at(coll, r, n, count, in_place);
        // NCCL's in-place layouts: an all-gather (gather) sends from its own block of the
        // receive buffer, a reduce-scatter (scatter) receives into its own block of the send
        // buffer.
        let own = r * count * 8;
        let (send_off, res_off) = match coll {
            _ if !mine => (0, 0),
            Collective::AllGather | Collective::Gather { .. } => (own, 0),
            Collective::ReduceScatter | Collective::Scatter { .. } => (0, own),
            _ => (0, 0),
        };
        at.push((layout(coll, mine), send_off));
        result_at.push(res_off);
    }
    let plans = (0..n).map(|r| build(r, in_place_at(coll, r, n, count, in_place))).collect();
    let sim = Sim::new(plans, &sends, &recv_len, &at, capacity, DataType::Float64, op, seed);
    let out = sim.run(1 << 22)?;
    for r in 0..n {
        let res = &out.recv[r][result_at[r]..result_at[r] + recv_len[r]];
        let got: Vec<f64> = res.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        let want = reference(coll, op, r, n, count);
        if let Some(j) = (0..want.len()).find(|&j| got[j] != want[j]) {
            return Err(format!("rank {r} element {j}: got {} want {}", got[j], want[j]));
        }
    }
    Ok(out.rounds)
}

#[cfg(test)]
mod tests;
