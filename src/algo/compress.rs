//! The compressed all-reduce: `f32` data crosses between hosts in a narrower wire encoding
//! ([`Encoding`]), quantised once each way (docs/COMPRESSION.md).
//!
//! Ranks are grouped by host ([`super::hier::host_groups`]); the lowest rank of each host is its
//! *leader*. Per leader, pipelined in chunks:
//!
//! 1. **within the host, exact**: the host's other ranks send their buffers to the leader,
//!    which folds them into its receive buffer in rank order (as [`super::hier`] does);
//! 2. **between hosts, encoded**: the leaders' data is cut into one segment per leader. Each
//!    leader encodes its piece of every other segment once ([`Step::Encode`]) and sends it to
//!    the segment's owner; the owner folds all pieces in host order into an `f32` accumulator
//!    ([`Step::Decode`] with `add`, its own piece exact), finishes the operator (`Avg` divides by
//!    the communicator's rank count), encodes the result once and sends those bytes to every
//!    other leader; every leader, the owner included, stores the *decoded* result. So each
//!    value is quantised twice whatever the number of hosts, the fold's order does not depend
//!    on arrival order, and every leader holds the same bits;
//! 3. **within the host, exact**: the leader sends each finished chunk to the host's others.
//!
//! [`reduce_scatter`]: block `p` is folded exactly on each host by that host's *agent* of `p`,
//! which encodes it once and sends it to `p`; `p` folds the hosts' sums and stores its fold
//! without encoding it again (one rank per host: step 2 alone). [`reduce`]: steps 1 and 2 with
//! the root leading its host, the owners sending their encoded results to the root only.
//!
//! Scratch: [`SLOTS`] chunks in flight per peer for the pieces going out and coming in and for
//! the accumulators (a slot's next user waits for the step that last read it), plus this
//! leader's encoded results (its segment in the wire encoding: `enc.size(count / hosts)` bytes).

use super::{chunks, partition, Action, Buf, Encoding, Plan, Region, Step};

/// Chunk (bytes of `f32` input) where the settings fix none. With [`SLOTS`] slots per peer it
/// keeps `SLOTS × enc.size(chunk)` encoded bytes in flight to each peer (about 1 MiB for fp8 and
/// int8: 8 ms of a 1 Gbit/s link), enough for the wire to keep busy while a loaded CPU runs
/// something else; 256 KiB chunks measured 10–15% slower at 64 MiB on a 1 Gbit/s link
/// (docs/PERFORMANCE.md).
pub const COMPRESS_CHUNK: usize = 1 << 20;
/// Scratch slots per peer and purpose.
pub const SLOTS: usize = 4;

/// Rank `rank`'s compressed all-reduce of `count` `f32` elements, `groups[r]` being rank r's
/// host index, in chunks of at most `chunk_bytes` bytes, the inter-host stage in `enc`.
pub fn all_reduce(rank: usize, groups: &[usize], count: usize, chunk_bytes: usize, enc: Encoding) -> Plan {
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let n = groups.len();
    let host = groups[rank];
    let local: Vec<usize> = (0..n).filter(|&r| groups[r] == host).collect();
    let leader = local[0];
    let ce = (chunk_bytes / 4).max(1);
    let host_chunks: Vec<Region> = chunks(count, ce).map(|(o, l)| Region::recv(o * 4, l * 4)).collect();
    if rank != leader {
        for c in &host_chunks {
            plan.push(Step::Send { peer: leader, src: Region { buf: Buf::Send, ..*c } }, vec![]);
        }
        for c in &host_chunks {
            plan.push(Step::Recv { peer: leader, dst: *c, action: Action::Store }, vec![]);
        }
        return plan;
    }
    // 1. The host's other ranks folded into the receive buffer, chunk by chunk, in rank order.
    let members = &local[1..];
    let mut ready = Vec::with_capacity(host_chunks.len());
    for c in host_chunks.iter().filter(|_| !members.is_empty()) {
        let mut last = None;
        for &m in members {
            let with = if last.is_none() { Region { buf: Buf::Send, ..*c } } else { *c };
            let deps = last.into_iter().collect();
            last = Some(plan.push(Step::Recv { peer: m, dst: *c, action: Action::Reduce { with } }, deps));
        }
        ready.push(last.expect("members is not empty"));
    }
    let input = Input::at_data(if members.is_empty() { Buf::Send } else { Buf::Recv });
    let leaders: Vec<usize> = (0..n).filter(|&r| groups[..r].iter().all(|&g| g != groups[r])).collect();
    let segs = partition(count, leaders.len());
    let stage =
        Stage { leaders: &leaders, me: host, count, ce, enc, input, ready: &ready, segs, out: Out::All, base: 0 };
    // 2. Between the leaders.
    let writers = stage.build(&mut plan);
    // 3. Each finished chunk to the host's other ranks.
    for c in &host_chunks {
        let deps: Vec<usize> =
            writers.iter().filter(|(w, _)| w.off < c.off + c.len && c.off < w.off + w.len).map(|&(_, i)| i).collect();
        for &m in members {
            plan.push(Step::Send { peer: m, src: *c }, deps.clone());
        }
    }
    let bytes = stage.scratch_bytes();
    plan.with_scratch(bytes)
}

/// Rank `rank`'s compressed reduce-scatter of `count` `f32` elements per rank, `groups[r]` being
/// rank r's host index: rank `p`'s block is folded exactly within each host by the host's
/// *agent* of block `p` (the rank whose place among its host's ranks is `p`'s among its own,
/// modulo the host's size; `p` itself on its own host), each agent encodes its host's sum once
/// and sends it to `p`, which folds the sums in host order in `f32` (its own host's exact),
/// finishes the operator and stores the result without a second quantisation. With one rank per
/// host there is nothing to fold within a host: the stage between hosts alone, every rank
/// encoding its piece of every other rank's block.
pub fn reduce_scatter(
    rank: usize,
    groups: &[usize],
    count: usize,
    chunk_bytes: usize,
    enc: Encoding,
    in_place: bool,
) -> Plan {
    let n = groups.len();
    let out = Out::Owner(if in_place { rank * count * 4 } else { 0 });
    let hosts = host_lists(groups);
    if hosts.len() == n {
        let segs = (0..n).map(|p| (p * count, count)).collect();
        return one_rank_per_host(rank, n, count, chunk_bytes, enc, segs, out);
    }
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let ce = (chunk_bytes / 4).max(1);
    let host = groups[rank];
    // The agent on host `h` of block `p`.
    let agent = |h: usize, p: usize| {
        let place = hosts[groups[p]].iter().position(|&r| r == p).expect("p is on its host");
        hosts[h][place % hosts[h].len()]
    };
    let pieces =
        |p: usize| -> Vec<(usize, usize)> { chunks(count, ce).map(|(o, l)| ((p * count + o) * 4, l * 4)).collect() };
    // 1. Within the host, exact, in block order: each block to its agent here, or the host's
    //    others' pieces of it folded after this rank's own (into scratch, a block each).
    let members: Vec<usize> = hosts[host].iter().copied().filter(|&r| r != rank).collect();
    let mut scratch = 0;
    let mut sums: Vec<Option<(Input, Vec<usize>)>> = vec![None; n];
    for (p, sum) in sums.iter_mut().enumerate() {
        let a = agent(host, p);
        if a != rank {
            for (o, l) in pieces(p) {
                plan.push(Step::Send { peer: a, src: Region { buf: Buf::Send, ..Region::recv(o, l) } }, vec![]);
            }
            continue;
        }
        let input = if members.is_empty() {
            Input::at_data(Buf::Send)
        } else {
            let i = Input { buf: Buf::Scratch, at: scratch, from: p * count * 4 };
            scratch += (count * 4).next_multiple_of(64);
            i
        };
        let ready = fold_host(&mut plan, &members, &pieces(p), &input);
        *sum = Some((input, ready));
    }
    // 2. Between hosts, per block this rank is the agent of (its own first): the block's
    //    agents are the stage's leaders, its owner the only one with a segment.
    for p in (0..n).map(|k| (rank + k) % n) {
        let Some((input, ready)) = &sums[p] else { continue };
        let leaders: Vec<usize> = (0..hosts.len()).map(|h| agent(h, p)).collect();
        let mut segs = vec![(p * count, 0); hosts.len()];
        segs[groups[p]] = (p * count, count);
        let stage =
            Stage { leaders: &leaders, me: host, count, ce, enc, input: *input, ready, segs, out, base: scratch };
        stage.build(&mut plan);
        scratch = stage.scratch_bytes();
    }
    plan.with_scratch(scratch)
}

/// Rank `rank`'s compressed reduce of `count` `f32` elements to `root`, `groups[r]` being rank
/// r's host index: the all-reduce's schedule with the root as its host's leader (the lowest rank
/// leads every other host), except that each owner sends its encoded result to the root only,
/// and only the root writes its receive buffer (the decoded results, its own segment
/// included). A leader other than the root that has its host's others to fold sums them in
/// scratch (its receive buffer is not written). With the same leaders and chunks, the root
/// holds bit for bit what the compressed all-reduce gives it: always with one rank per host.
pub fn reduce(rank: usize, groups: &[usize], count: usize, chunk_bytes: usize, enc: Encoding, root: usize) -> Plan {
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let hosts = host_lists(groups);
    let (host, home) = (groups[rank], groups[root]);
    let leaders: Vec<usize> = (0..hosts.len()).map(|h| if h == home { root } else { hosts[h][0] }).collect();
    let ce = (chunk_bytes / 4).max(1);
    let pieces: Vec<(usize, usize)> = chunks(count, ce).map(|(o, l)| (o * 4, l * 4)).collect();
    if rank != leaders[host] {
        for &(o, l) in &pieces {
            plan.push(Step::Send { peer: leaders[host], src: Region { buf: Buf::Send, ..Region::recv(o, l) } }, vec![]);
        }
        return plan;
    }
    let members: Vec<usize> = hosts[host].iter().copied().filter(|&r| r != rank).collect();
    let (input, base) = match (members.is_empty(), rank == root) {
        (true, _) => (Input::at_data(Buf::Send), 0),
        (false, true) => (Input::at_data(Buf::Recv), 0),
        (false, false) => (Input { buf: Buf::Scratch, at: 0, from: 0 }, (count * 4).next_multiple_of(64)),
    };
    let ready = fold_host(&mut plan, &members, &pieces, &input);
    let segs = partition(count, hosts.len());
    let stage =
        Stage { leaders: &leaders, me: host, count, ce, enc, input, ready: &ready, segs, out: Out::Root(home), base };
    stage.build(&mut plan);
    let bytes = stage.scratch_bytes();
    plan.with_scratch(bytes)
}

/// The ranks of each host, in rank order, hosts in index order.
fn host_lists(groups: &[usize]) -> Vec<Vec<usize>> {
    let mut hosts = vec![Vec::new(); groups.iter().max().map_or(0, |&h| h + 1)];
    for (r, &h) in groups.iter().enumerate() {
        hosts[h].push(r);
    }
    hosts
}

/// This rank's fold of its host's inputs of the byte ranges `pieces` into `sum`: its own first,
/// then the host's others (`members`, each sending its pieces in the same order) in rank order;
/// returns per piece the step finishing it (none when there are no others).
fn fold_host(plan: &mut Plan, members: &[usize], pieces: &[(usize, usize)], sum: &Input) -> Vec<usize> {
    let mut ready = Vec::new();
    for &(o, l) in pieces.iter().filter(|_| !members.is_empty()) {
        let dst = sum.region(o, l);
        let mut last: Option<usize> = None;
        for &m in members {
            let with = if last.is_none() { Region { buf: Buf::Send, ..Region::recv(o, l) } } else { dst };
            let step = Step::Recv { peer: m, dst, action: Action::Reduce { with } };
            last = Some(plan.push(step, last.into_iter().collect()));
        }
        ready.extend(last);
    }
    ready
}

/// The stage between hosts alone, every rank a leader reading its send buffer: the plan of
/// [`reduce_scatter`] and [`reduce`], which differ in the segments and in what owners do with
/// their folded results.
fn one_rank_per_host(
    rank: usize,
    n: usize,
    count: usize,
    chunk_bytes: usize,
    enc: Encoding,
    segs: Vec<(usize, usize)>,
    out: Out,
) -> Plan {
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let leaders: Vec<usize> = (0..n).collect();
    let ce = (chunk_bytes / 4).max(1);
    let input = Input::at_data(Buf::Send);
    let stage = Stage { leaders: &leaders, me: rank, count, ce, enc, input, ready: &[], segs, out, base: 0 };
    stage.build(&mut plan);
    let bytes = stage.scratch_bytes();
    plan.with_scratch(bytes)
}

/// What the stage between the leaders does with the folded segments.
#[derive(Clone, Copy, PartialEq)]
enum Out {
    /// An all-reduce: every owner's encoded result to every leader, each storing it decoded.
    All,
    /// A reduce-scatter: the owner stores its folded segment exactly at this byte offset of
    /// the receive buffer; no result crosses back.
    Owner(usize),
    /// A reduce: every owner's encoded result to the leader of this index only, which stores
    /// them decoded.
    Root(usize),
}

/// Where a leader's input (its host's sum, or its send buffer) is: the data's byte `o` at byte
/// `o - from + at` of `buf`.
#[derive(Clone, Copy)]
struct Input {
    buf: Buf,
    at: usize,
    from: usize,
}

impl Input {
    /// The input at the data's own offsets in `buf`.
    fn at_data(buf: Buf) -> Input {
        Input { buf, at: 0, from: 0 }
    }

    /// The input's bytes `(o, l)` of the data.
    fn region(&self, o: usize, l: usize) -> Region {
        Region { buf: self.buf, ..Region::recv(o - self.from + self.at, l) }
    }
}

/// The encoded stage between the leaders, from one leader's side.
struct Stage<'a> {
    /// The leaders' ranks, in host order.
    leaders: &'a [usize],
    /// This leader's index in `leaders`.
    me: usize,
    /// Elements.
    count: usize,
    /// Elements per chunk.
    ce: usize,
    enc: Encoding,
    /// Where this leader's input is (its send buffer, or the host's sum).
    input: Input,
    /// Per chunk of the `ce`-element grid from the input's start (`input.from`), the step
    /// finishing the host's sum.
    ready: &'a [usize],
    /// Per leader, its segment `(first element, elements)` of the input.
    segs: Vec<(usize, usize)>,
    /// What becomes of the folded segments.
    out: Out,
    /// Where this stage's scratch starts (bytes).
    base: usize,
}

impl Stage<'_> {
    /// Byte ranges `(offset, length)` of segment `p`'s chunks.
    fn pieces(&self, p: usize) -> Vec<(usize, usize)> {
        let (first, len) = self.segs[p];
        chunks(len, self.ce).map(|(o, l)| ((first + o) * 4, l * 4)).collect()
    }

    /// Encoded bytes of a whole chunk (a slot), rounded up to 8.
    fn wire(&self) -> usize {
        self.enc.size(self.ce.min(self.count)).next_multiple_of(8)
    }

    /// Scratch: the accumulators, then slots for outgoing pieces (per destination), incoming
    /// pieces and results (per source), and this leader's results.
    fn area(&self, which: usize, peer: usize, c: usize, len: usize) -> Region {
        let h = self.leaders.len();
        let acc = SLOTS * self.ce.min(self.count) * 4;
        let per = SLOTS * self.wire();
        let base = match which {
            0 => 0,
            1 => acc + peer * per,
            2 => acc + (h + peer) * per,
            3 => acc + (2 * h + peer) * per,
            _ => acc + 3 * h * per,
        };
        let unit = if which == 0 { self.ce.min(self.count) * 4 } else { self.wire() };
        // Results keep a place each until every leader has them (their sends queue behind all
        // the pieces to the same peer, so a reused slot could wait for itself).
        let slot = if which == 4 { c } else { c % SLOTS };
        Region::scratch(self.base + base + slot * unit, len)
    }

    fn scratch_bytes(&self) -> usize {
        self.area(4, 0, 0, 0).off + self.pieces(self.me).len() * self.wire()
    }

    /// Steps of the host sum overlapping the bytes `(o, l)` (none when the input is the send
    /// buffer).
    fn ready_for(&self, o: usize, l: usize) -> Vec<usize> {
        if self.ready.is_empty() {
            return vec![];
        }
        let (cb, o) = (self.ce * 4, o - self.input.from);
        (o / cb..=(o + l - 1) / cb).map(|c| self.ready[c]).collect()
    }

    /// Whether this leader stores the decoded results of every segment (an all-reduce, or the
    /// root of a reduce).
    fn stores(&self) -> bool {
        self.out == Out::All || self.out == Out::Root(self.me)
    }

    /// Adds this leader's steps; returns the steps that write the receive buffer, with their
    /// regions.
    fn build(&self, plan: &mut Plan) -> Vec<(Region, usize)> {
        let mut writers = Vec::new();
        let encoded_for = self.send_pieces(plan);
        self.fold_own(plan, &mut writers);
        self.receive_results(plan, &encoded_for, &mut writers);
        writers
    }

    /// Outgoing pieces: each encoded once and sent to its owner; returns the encode steps per
    /// owner (a received result overwrites those bytes only after they were encoded).
    fn send_pieces(&self, plan: &mut Plan) -> Vec<Vec<usize>> {
        let (h, me, enc) = (self.leaders.len(), self.me, self.enc);
        let mut encoded_for: Vec<Vec<usize>> = vec![Vec::new(); h];
        for k in 1..h {
            let p = (me + k) % h;
            let mut sent: Vec<usize> = Vec::new();
            for (c, (o, l)) in self.pieces(p).into_iter().enumerate() {
                let slot = self.area(1, p, c, enc.size(l / 4));
                let mut deps = self.ready_for(o, l);
                deps.extend(c.checked_sub(SLOTS).map(|d| sent[d]));
                let e = plan.push(Step::Encode { src: self.input.region(o, l), dst: slot, enc }, deps);
                encoded_for[p].push(e);
                sent.push(plan.push(Step::Send { peer: self.leaders[p], src: slot }, vec![e]));
            }
        }
        encoded_for
    }

    /// This leader's segment: the pieces folded in host order, finished, encoded once, sent
    /// to every leader that stores it; its writers of the receive buffer go to `writers`.
    fn fold_own(&self, plan: &mut Plan, writers: &mut Vec<(Region, usize)>) {
        let (h, me, enc) = (self.leaders.len(), self.me, self.enc);
        let mine = self.pieces(me);
        let mut folded_from: Vec<Vec<usize>> = vec![Vec::new(); h];
        let mut results: Vec<usize> = Vec::new();
        for (c, &(o, l)) in mine.iter().enumerate() {
            let acc = self.area(0, 0, c, l);
            let wl = enc.size(l / 4);
            let mut prev: Vec<usize> = c.checked_sub(SLOTS).map(|d| results[d]).into_iter().collect();
            for (q, from) in folded_from.iter_mut().enumerate() {
                let mut deps = prev.clone();
                let step = if q == me {
                    deps.extend(self.ready_for(o, l));
                    Step::Decode { src: self.input.region(o, l), dst: acc, enc: Encoding::Exact, add: q > 0 }
                } else {
                    let slot = self.area(2, q, c, wl);
                    let free = c.checked_sub(SLOTS).map(|d| from[d]).into_iter().collect();
                    let r = plan.push(Step::Recv { peer: self.leaders[q], dst: slot, action: Action::Store }, free);
                    deps.push(r);
                    Step::Decode { src: slot, dst: acc, enc, add: q > 0 }
                };
                let f = plan.push(step, deps);
                from.push(f);
                prev = vec![f];
            }
            let fin = plan.push(Step::Finish { dst: acc }, prev);
            if let Out::Owner(at) = self.out {
                let out = Region::recv(at + o - self.segs[me].0 * 4, l);
                let d = plan.push(Step::Decode { src: acc, dst: out, enc: Encoding::Exact, add: false }, vec![fin]);
                results.push(d);
                writers.push((out, d));
                continue;
            }
            let res = self.area(4, 0, c, wl);
            let e = plan.push(Step::Encode { src: acc, dst: res, enc }, vec![fin]);
            results.push(e);
            if self.stores() {
                let out = Region::recv(o, l);
                let d = plan.push(Step::Decode { src: res, dst: out, enc, add: false }, vec![e]);
                writers.push((out, d));
            }
            // The encoded result to every other leader that stores it (per peer, after the
            // pieces sent to it).
            for k in 1..h {
                let q = (me + k) % h;
                if self.out == Out::All || self.out == Out::Root(q) {
                    plan.push(Step::Send { peer: self.leaders[q], src: res }, vec![e]);
                }
            }
        }
    }

    /// The other leaders' results, decoded in place of the bytes this leader sent them.
    fn receive_results(&self, plan: &mut Plan, encoded_for: &[Vec<usize>], writers: &mut Vec<(Region, usize)>) {
        let (h, me, enc) = (self.leaders.len(), self.me, self.enc);
        for k in (1..h).filter(|_| self.stores()) {
            let q = (me + h - k) % h;
            let mut decoded: Vec<usize> = Vec::new();
            for (c, (o, l)) in self.pieces(q).into_iter().enumerate() {
                let slot = self.area(3, q, c, enc.size(l / 4));
                let free = c.checked_sub(SLOTS).map(|d| decoded[d]).into_iter().collect();
                let r = plan.push(Step::Recv { peer: self.leaders[q], dst: slot, action: Action::Store }, free);
                let out = Region::recv(o, l);
                let d = plan.push(Step::Decode { src: slot, dst: out, enc, add: false }, vec![r, encoded_for[q][c]]);
                decoded.push(d);
                writers.push((out, d));
            }
        }
    }
}

#[cfg(test)]
mod tests;
