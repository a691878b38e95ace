//! The compressed all-reduce: `f32` data crosses between hosts in a narrower wire encoding
//! ([`Encoding`]), quantised once each way (docs/COMPRESSION.md).
//!
//! Ranks are grouped by host ([`super::hier::host_groups`]); the lowest rank of each host is its
//! *leader*. Per leader, pipelined in chunks:
//!
//! 1. **within the host, exact**: the host's other ranks send their buffers to the leader,
//!    which folds them after its own in rank order (as [`super::hier`] does), not into its
//!    receive buffer but sub-piece by sub-piece ([`SUB`] elements) into [`FOLD_SLOTS`] small
//!    slots, as step 2 reads its input: chunk `c` of every other segment, then its own chunk
//!    `c`, then chunk `c + 1` (the others send in that order). Each slot is reused while it is
//!    still in cache, and the host's sum is never written to memory;
//! 2. **between hosts, encoded**: the leaders' data is cut into one segment per leader. Each
//!    leader encodes its piece of every other segment once ([`Step::Encode`], one sub-piece at
//!    a time at its place in the chunk's message: sub-pieces start at multiples of the codecs'
//!    block, so the bytes are those of the whole chunk) and sends it to the segment's owner;
//!    the owner folds all pieces in host order into an `f32` accumulator ([`Step::Decode`]
//!    with `add`, its own piece exact), finishes the operator (`Avg` divides by the
//!    communicator's rank count), encodes the result once and sends those bytes to every other
//!    leader; every leader, the owner included, stores the *decoded* result. So each value is
//!    quantised twice whatever the number of hosts, the fold's order does not depend on
//!    arrival order, and every leader holds the same bits;
//! 3. **within the host**: the leader forwards every encoded result (its own as encoded, the
//!    other leaders' as received) to the host's others, which decode them into their receive
//!    buffers: the same bytes through the same decoder, so the same bits as the leader's.
//!
//! [`reduce_scatter`]: block `p` is folded exactly on each host by that host's *agent* of `p`,
//! which encodes it once and sends it to `p`; `p` folds the hosts' sums and stores its fold
//! without encoding it again (one rank per host: step 2 alone). [`reduce`]: steps 1 and 2 with
//! the root leading its host, the owners sending their encoded results to the root only.
//!
//! Scratch: [`SLOTS`] chunks in flight per peer for the pieces going out and coming in and for
//! the accumulators (a slot's next user waits for the step that last read it), plus this
//! leader's encoded results (its segment in the wire encoding: `enc.size(count / hosts)` bytes),
//! plus the all-reduce fold's [`FOLD_SLOTS`] sub-pieces; a rank that is not its host's leader
//! keeps [`SLOTS`] encoded chunks of the forwarded results.

use super::{chunks, partition, Action, Buf, Encoding, Plan, Region, Step};

/// Chunk (bytes of `f32` input) where the settings fix none. With [`SLOTS`] slots per peer it
/// keeps `SLOTS × enc.size(chunk)` encoded bytes in flight to each peer (about 1 MiB for fp8 and
/// int8: 8 ms of a 1 Gbit/s link), enough for the wire to keep busy while a loaded CPU runs
/// something else; 256 KiB chunks measured 10–15% slower at 64 MiB on a 1 Gbit/s link
/// (docs/PERFORMANCE.md).
pub const COMPRESS_CHUNK: usize = 1 << 20;
/// Scratch slots per peer and purpose.
pub const SLOTS: usize = 4;
/// Elements of a sub-piece where a leader folds its host's inputs as the stage between hosts
/// reads them (a multiple of the codecs' block, so a chunk's sub-pieces encoded end to end are
/// the chunk's encoding, bytes for bytes): 128 KiB of `f32`.
pub const SUB: usize = 128 * crate::reduce::codec::BLOCK;
/// Sub-piece slots of that fold, reused in turn: few enough to stay in a core's cache, so the
/// fold writes no line that must first be read from memory.
pub const FOLD_SLOTS: usize = 4;

/// Rank `rank`'s compressed all-reduce of `count` `f32` elements, `groups[r]` being rank r's
/// host index, in chunks of at most `chunk_bytes` bytes, the inter-host stage in `enc`.
pub fn all_reduce(rank: usize, groups: &[usize], count: usize, chunk_bytes: usize, enc: Encoding) -> Plan {
    all_reduce_in(rank, groups, count, chunk_bytes, enc, SUB)
}

/// [`all_reduce`] with the leaders folding in sub-pieces of `sub` elements (a multiple of the
/// codecs' block; the result's bits do not depend on it).
fn all_reduce_in(rank: usize, groups: &[usize], count: usize, chunk_bytes: usize, enc: Encoding, sub: usize) -> Plan {
    debug_assert!(sub > 0 && sub % crate::reduce::codec::BLOCK == 0);
    let mut plan = Plan::default();
    if count == 0 {
        return plan;
    }
    let n = groups.len();
    let host = groups[rank];
    let local: Vec<usize> = (0..n).filter(|&r| groups[r] == host).collect();
    let leader = local[0];
    let ce = (chunk_bytes / 4).max(1);
    let members = &local[1..];
    let leaders: Vec<usize> = (0..n).filter(|&r| groups[..r].iter().all(|&g| g != groups[r])).collect();
    let segs = partition(count, leaders.len());
    let input = Input::at_data(Buf::Send);
    let stage = Stage {
        leaders: &leaders,
        me: host,
        count,
        ce,
        enc,
        input,
        ready: &[],
        fold: members,
        sub,
        segs,
        out: Out::All,
        base: 0,
    };
    if rank != leader {
        // 1. This rank's input to the leader, in the order the leader's stage reads it.
        let mut sent = Vec::new();
        for (o, l) in stage.reads() {
            let src = Region { buf: Buf::Send, ..Region::recv(o, l) };
            sent.push((o, l, plan.push(Step::Send { peer: leader, src }, vec![])));
        }
        // 3. The encoded results the leader forwards, decoded here (after this rank's input
        //    of the same bytes went out: in place they are the same bytes).
        let wire = stage.wire();
        let mut decoded: Vec<usize> = Vec::new();
        for (c, (o, l)) in stage.forwards().into_iter().enumerate() {
            let slot = Region::scratch((c % SLOTS) * wire, enc.size(l / 4));
            let free = c.checked_sub(SLOTS).map(|d| decoded[d]).into_iter().collect();
            let r = plan.push(Step::Recv { peer: leader, dst: slot, action: Action::Store }, free);
            let mut deps = vec![r];
            deps.extend(sent.iter().filter(|&&(so, sl, _)| so < o + l && o < so + sl).map(|&(_, _, i)| i));
            decoded.push(plan.push(Step::Decode { src: slot, dst: Region::recv(o, l), enc, add: false }, deps));
        }
        return plan.with_scratch(SLOTS * wire);
    }
    // 1 and 2. The host's other ranks folded sub-piece by sub-piece as the stage between the
    // leaders reads them; 3. every encoded result forwarded to them as well.
    stage.build(&mut plan);
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
        let stage = Stage {
            leaders: &leaders,
            me: host,
            count,
            ce,
            enc,
            input: *input,
            ready,
            fold: &[],
            sub: SUB,
            segs,
            out,
            base: scratch,
        };
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
    let stage = Stage {
        leaders: &leaders,
        me: host,
        count,
        ce,
        enc,
        input,
        ready: &ready,
        fold: &[],
        sub: SUB,
        segs,
        out: Out::Root(home),
        base,
    };
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
    let stage = Stage {
        leaders: &leaders,
        me: rank,
        count,
        ce,
        enc,
        input,
        ready: &[],
        fold: &[],
        sub: SUB,
        segs,
        out,
        base: 0,
    };
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
    /// The host's other ranks, whose inputs this leader folds after its own (the input, then
    /// its send buffer) in rank order, sub-piece by sub-piece into [`FOLD_SLOTS`] slots as the
    /// stage reads them ([`Stage::reads`] is the order they send in); empty: the input is read
    /// as it is.
    fold: &'a [usize],
    /// Elements of the fold's sub-pieces (a multiple of the codecs' block).
    sub: usize,
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

    /// Where the fold's slots start (bytes from the stage's scratch, after the results).
    fn fold_base(&self) -> usize {
        self.area(4, 0, 0, 0).off - self.base + self.pieces(self.me).len() * self.wire()
    }

    fn scratch_bytes(&self) -> usize {
        let fold = if self.fold.is_empty() { 0 } else { FOLD_SLOTS * self.sub().min(self.count) * 4 };
        self.base + self.fold_base() + fold
    }

    /// Elements of the sub-pieces the input is read in: `self.sub` when folding, else whole
    /// chunks.
    fn sub(&self) -> usize {
        if self.fold.is_empty() {
            self.ce
        } else {
            self.sub.min(self.ce)
        }
    }

    /// Byte ranges of the sub-pieces of the chunk at bytes `(o, l)`, each starting a multiple
    /// of `self.sub` elements (so of the codecs' block) from the chunk's start.
    fn subs(&self, o: usize, l: usize) -> Vec<(usize, usize)> {
        chunks(l / 4, self.sub()).map(|(a, b)| (o + a * 4, b * 4)).collect()
    }

    /// The order the leaders' steps go through the chunks: chunk `c` of every segment, the
    /// segments after this leader's first and its own last, then chunk `c + 1`. Yields
    /// `(segment, chunk index, bytes)`.
    fn order(&self) -> Vec<(usize, usize, (usize, usize))> {
        let h = self.leaders.len();
        let per: Vec<(usize, Vec<(usize, usize)>)> =
            (1..=h).map(|k| (self.me + k) % h).map(|p| (p, self.pieces(p))).collect();
        let most = per.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        (0..most).flat_map(|c| per.iter().filter_map(move |(p, v)| v.get(c).map(|&x| (*p, c, x)))).collect()
    }

    /// The input's byte ranges in the order this leader reads them: what each of the host's
    /// other ranks sends it, in that order.
    fn reads(&self) -> Vec<(usize, usize)> {
        self.order().into_iter().flat_map(|(_, _, (o, l))| self.subs(o, l)).collect()
    }

    /// Whether this leader forwards the encoded results to the host's other ranks (an
    /// all-reduce folding them), which decode them themselves.
    fn forwarding(&self) -> bool {
        self.out == Out::All && !self.fold.is_empty()
    }

    /// The byte ranges of the results this leader forwards to the host's other ranks, in
    /// order: its own segment's, then the other leaders' in the order they are received.
    fn forwards(&self) -> Vec<(usize, usize)> {
        let h = self.leaders.len();
        let mut v = self.pieces(self.me);
        v.extend((1..h).flat_map(|k| self.pieces((self.me + h - k) % h)));
        v
    }

    /// The input's bytes `(o, l)` (one sub-piece) ready to read: the region holding them and
    /// the steps to wait for. When folding, the host's inputs are folded into the next fold
    /// slot, after `readers[g - FOLD_SLOTS]` (the last reader of that slot) is done; the
    /// caller pushes the step reading the region onto `readers`.
    fn take(&self, plan: &mut Plan, readers: &[usize], o: usize, l: usize) -> (Region, Vec<usize>) {
        if self.fold.is_empty() {
            return (self.input.region(o, l), self.ready_for(o, l));
        }
        let g = readers.len();
        let dst = Region::scratch(self.base + self.fold_base() + (g % FOLD_SLOTS) * self.sub().min(self.count) * 4, l);
        let mut deps: Vec<usize> = g.checked_sub(FOLD_SLOTS).map(|d| readers[d]).into_iter().collect();
        let mut with = Region { buf: Buf::Send, ..Region::recv(o, l) };
        for &m in self.fold {
            let r = plan.push(Step::Recv { peer: m, dst, action: Action::Reduce { with } }, deps);
            deps = vec![r];
            with = dst;
        }
        (dst, deps)
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

    /// Adds this leader's steps, chunk by chunk in [`Stage::order`]. Per peer the messages keep
    /// one order: every piece, then every result.
    fn build(&self, plan: &mut Plan) {
        let h = self.leaders.len();
        let mut t = Track {
            readers: Vec::new(),
            sent: vec![Vec::new(); h],
            from: vec![Vec::new(); h],
            results: Vec::new(),
            encoded: Vec::new(),
        };
        for (p, c, (o, l)) in self.order() {
            if p == self.me {
                self.fold_own(plan, &mut t, c, o, l);
            } else {
                self.send_piece(plan, &mut t, p, c, o, l);
            }
        }
        // The encoded results to every other leader that stores them (per peer, after the
        // pieces sent to it).
        for &(res, e) in &t.encoded {
            for k in 1..h {
                let q = (self.me + k) % h;
                if self.out == Out::All || self.out == Out::Root(q) {
                    plan.push(Step::Send { peer: self.leaders[q], src: res }, vec![e]);
                }
            }
        }
        self.receive_results(plan, &mut t);
    }

    /// Chunk `c` (bytes `(o, l)`) of segment `p`: encoded once (sub-piece by sub-piece, each at
    /// its place in the slot) and sent to its owner.
    fn send_piece(&self, plan: &mut Plan, t: &mut Track, p: usize, c: usize, o: usize, l: usize) {
        let enc = self.enc;
        let slot = self.area(1, p, c, enc.size(l / 4));
        let free = c.checked_sub(SLOTS).map(|d| t.sent[p][d]);
        let mut encodes = Vec::new();
        for (so, sl) in self.subs(o, l) {
            let (src, mut deps) = self.take(plan, &t.readers, so, sl);
            deps.extend(free);
            let dst = slot.sub(enc.size((so - o) / 4), enc.size(sl / 4));
            let e = plan.push(Step::Encode { src, dst, enc }, deps);
            t.readers.push(e);
            encodes.push(e);
        }
        t.sent[p].push(plan.push(Step::Send { peer: self.leaders[p], src: slot }, encodes));
    }

    /// Chunk `c` (bytes `(o, l)`) of this leader's segment: the pieces folded in host order,
    /// finished, encoded once (sent to the other leaders at the end of [`Stage::build`], and
    /// forwarded to the host's other ranks when [`Stage::forwarding`]).
    fn fold_own(&self, plan: &mut Plan, t: &mut Track, c: usize, o: usize, l: usize) {
        let (h, me, enc) = (self.leaders.len(), self.me, self.enc);
        let acc = self.area(0, 0, c, l);
        let wl = enc.size(l / 4);
        let mut prev: Vec<usize> = c.checked_sub(SLOTS).map(|d| t.results[d]).into_iter().collect();
        for q in 0..h {
            if q == me {
                let mut next = Vec::new();
                for (so, sl) in self.subs(o, l) {
                    let (src, mut deps) = self.take(plan, &t.readers, so, sl);
                    deps.extend(prev.iter().copied());
                    let dst = acc.sub(so - o, sl);
                    let d = plan.push(Step::Decode { src, dst, enc: Encoding::Exact, add: q > 0 }, deps);
                    t.readers.push(d);
                    next.push(d);
                }
                prev = next;
                continue;
            }
            let slot = self.area(2, q, c, wl);
            let free = c.checked_sub(SLOTS).map(|d| t.from[q][d]).into_iter().collect();
            let r = plan.push(Step::Recv { peer: self.leaders[q], dst: slot, action: Action::Store }, free);
            let mut deps = prev.clone();
            deps.push(r);
            let f = plan.push(Step::Decode { src: slot, dst: acc, enc, add: q > 0 }, deps);
            t.from[q].push(f);
            prev = vec![f];
        }
        let fin = plan.push(Step::Finish { dst: acc }, prev);
        if let Out::Owner(at) = self.out {
            let out = Region::recv(at + o - self.segs[me].0 * 4, l);
            t.results.push(plan.push(Step::Decode { src: acc, dst: out, enc: Encoding::Exact, add: false }, vec![fin]));
            return;
        }
        let res = self.area(4, 0, c, wl);
        let e = plan.push(Step::Encode { src: acc, dst: res, enc }, vec![fin]);
        t.results.push(e);
        t.encoded.push((res, e));
        for &m in self.fold.iter().filter(|_| self.forwarding()) {
            plan.push(Step::Send { peer: m, src: res }, vec![e]);
        }
        if self.stores() {
            plan.push(Step::Decode { src: res, dst: Region::recv(o, l), enc, add: false }, vec![e]);
        }
    }

    /// The other leaders' results, decoded in place of the bytes this leader sent them (after
    /// the piece's send, which follows every read of those input bytes), and forwarded as
    /// received to the host's other ranks when [`Stage::forwarding`].
    fn receive_results(&self, plan: &mut Plan, t: &mut Track) {
        let (h, me, enc) = (self.leaders.len(), self.me, self.enc);
        for k in (1..h).filter(|_| self.stores()) {
            let q = (me + h - k) % h;
            // Per chunk, the steps reading its slot.
            let mut readers: Vec<Vec<usize>> = Vec::new();
            for (c, (o, l)) in self.pieces(q).into_iter().enumerate() {
                let slot = self.area(3, q, c, enc.size(l / 4));
                let free = c.checked_sub(SLOTS).map(|d| readers[d].clone()).unwrap_or_default();
                let r = plan.push(Step::Recv { peer: self.leaders[q], dst: slot, action: Action::Store }, free);
                let out = Region::recv(o, l);
                let d = plan.push(Step::Decode { src: slot, dst: out, enc, add: false }, vec![r, t.sent[q][c]]);
                let mut read = vec![d];
                for &m in self.fold.iter().filter(|_| self.forwarding()) {
                    read.push(plan.push(Step::Send { peer: m, src: slot }, vec![r]));
                }
                readers.push(read);
            }
        }
    }
}

/// What [`Stage::build`] keeps track of while it adds steps.
struct Track {
    /// Per sub-piece taken ([`Stage::take`]), in order, the step that read it.
    readers: Vec<usize>,
    /// Per leader, the sends of its segment's pieces, per chunk.
    sent: Vec<Vec<usize>>,
    /// Per leader, the decodes of the pieces it sent this one, per chunk (each frees its slot).
    from: Vec<Vec<usize>>,
    /// Per chunk of this leader's segment, the last step reading its accumulator.
    results: Vec<usize>,
    /// Per chunk of this leader's segment, its encoded result and the step encoding it.
    encoded: Vec<(Region, usize)>,
}

#[cfg(test)]
mod tests;
