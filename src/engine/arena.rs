//! The arena all-reduce: every rank of a crowded host (more ranks than CPUs, or as
//! `OXCCL_ARENA` says) copies its input into the host arena
//! (`crate::transport::shm::arena`), reduces its own slice of the vector straight out of all
//! ranks' copies, and copies the others' reduced slices out, with two barriers per piece of at
//! most [`SLOT`] bytes per rank. The schedule is a window plan,
//! [`window::arena_all_reduce`] (validated and simulated in `crate::algo::window`); this module
//! executes it (`plan.rs`: a copy is a `memcpy`, a fold [`crate::reduce::fold_ptrs`] into its
//! first destination then copies, a barrier the arena's own) and keeps everything around it: the
//! probe, the stamps and their comparison after the first barrier, the peers' shared buffers
//! (`PeerMaps`), the lane notices, the half the next call starts on, and the plans kept for
//! the next call of the same shape (building the plan in every call made 1-16 KiB calls on 4
//! ranks over 2 CPUs 14-23 % slower).
//!
//! Why: with more ranks than CPUs the all-reduce is bound by the CPU time of its copies and by
//! the scheduler hand-offs at each synchronisation. Per rank and per byte, the direct schedule
//! over pair rings (reduce-scatter and all-gather straight to the owners) copies each byte
//! into a ring and out again in both halves (~6.75 passes over the message at 4 ranks); here
//! a rank copies its input in (2 passes), reads its slice of every rank's copy (1), writes its
//! result twice (its own buffer and its slot, 2/n) and copies the other slices out
//! (2 (n-1)/n): ~4.75 passes at 4 ranks, with two barriers per piece instead of a hand-off per
//! chunk and peer. Each slice is reduced once, by one rank, as the left fold in rank order
//! (the fixed order of `OXCCL_DETERMINISTIC`), so every rank gets bit-identical results.
//! Buffers in shareable host memory (`hostmem`) are read where they lie: a shared input is not
//! copied in, a shared output not into the slot, and a closing barrier keeps every rank until
//! nobody reads its buffers.
//!
//! **Reuse of the slots.** Pieces alternate between the arena's two halves (the plan's areas 0
//! and 1). A rank writes half h for piece k + 2 only after it passed the first barrier of
//! piece k + 1, which every rank reaches only after it copied piece k's results out of half h.
//!
//! **Mismatched calls.** Each rank writes its call's stamp in its line before its first
//! arrival; after the first barrier every rank compares all stamps with its own, so all of
//! them report a mismatch (different counts, types, operators) before a byte is used. A rank
//! waiting at a barrier also looks, every 2 ms, at the links of the ranks that have not
//! arrived: a peer that sent ring bytes (another operation's signature) or posted on the lane
//! (a small all-reduce) runs another call; a closed link is a failed peer
//! (whose reason, if it has one, comes on the control channel, [`crate::control`]).
//! The call writes a lane notice to every peer for the engine's side of that check, and takes
//! it back just before its last arrival (a peer that passed the last barrier may start its
//! next call while this rank still copies out).

use super::lane::{stamp_signature, Clock, PlanlessCtx, Waiter};
use crate::algo::window::{self, WindowStep};
use crate::error::{Error, ErrorKind, Result};
use crate::mismatch::{Desc, SIG_LEN};
use crate::transport::shm::arena::{Arena, Descriptor, DESCRIPTOR_LEN};
use crate::transport::shm::hostmem::{self, BufDesc, PeerMaps};
use crate::transport::shm::lane::Stamp;
use crate::transport::Link;
use crate::types::{DataType, ReduceOp};
use plan::{exec, Bufs, Kept};
use std::time::Duration;

mod plan;

/// Bytes per rank of one piece (one slot of the arena). The arena maps `2 * SLOT` bytes per
/// rank. Measured on 4 ranks over 2 CPUs (docs/PERFORMANCE.md): 128-256 KiB pieces beat 1 MiB
/// at 1 MiB to 128 MiB (a piece's working set stays in the cores' caches) and 4 MiB pieces
/// lost ~40 %.
pub const SLOT: usize = 256 << 10;
/// Fewest ranks this path takes on a crowded host ([`crate::algo::select::ARENA_MIN_RANKS`],
/// where the reason is).
pub const MIN_RANKS: usize = crate::algo::select::ARENA_MIN_RANKS;

/// Smallest all-reduce (bytes) on two ranks that first asks whether every buffer is shareable
/// ([`crate::algo::select::ARENA_PROBE_MIN`], where the reason is).
pub const PROBE_MIN: usize = crate::algo::select::ARENA_PROBE_MIN;

/// Idle rounds before the clock is read.
const CLOCKLESS_ROUNDS: u32 = 64;
/// Longest single sleep on the arena's bell.
const NAP: Duration = Duration::from_millis(20);

/// A communicator's arena and where its barriers stand, kept from call to call.
pub struct State {
    arena: Arena,
    /// The last barrier this rank arrived at.
    gen: u32,
    /// The half the next piece uses.
    half: usize,
    /// The others' shared buffers mapped here.
    peers: PeerMaps,
    /// Each rank's process id as it wrote it in the arena at set-up, read once after the first
    /// barrier (a later write there changes nothing): a peer's buffer is mapped only from the
    /// process of the rank that names it.
    members: Vec<u32>,
    /// Per rank, the address of its input in this process when shared (reused memory).
    send_at: Vec<Option<usize>>,
    /// Per rank, the address of its output in this process when shared.
    recv_at: Vec<Option<usize>>,
    /// Whether the log said that shared buffers are read in place.
    told: bool,
    /// The last plan run from each half, for the next call of its shape.
    plans: [Option<Kept>; 2],
}

/// All-reduce of `count` elements from `send` into `recv` through the host arena, kept in
/// `state` (made by the first call). Returns whether it ran: with `probe` (two ranks that
/// would otherwise take the pair ring, [`PROBE_MIN`]) it runs only when every rank's send and
/// receive buffers are shared (`hostmem`); otherwise every rank returns `Ok(false)` after the
/// first barrier, having touched no buffer, and runs the call on its plan.
///
/// # Safety
/// `send` must be readable and `recv` writable for `count * dtype.size()` bytes during the call
/// (they may be equal).
#[allow(clippy::too_many_arguments)]
pub unsafe fn all_reduce(
    mut ctx: PlanlessCtx<'_>,
    state: &mut Option<State>,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    probe: bool,
) -> Result<bool> {
    let desc = Desc::single(crate::algo::Collective::AllReduce, count, dtype, op);
    let len = count.saturating_mul(dtype.size());
    let stamp = Stamp {
        tag: desc.tag,
        dtype: desc.dtype,
        op: desc.op,
        len: len.min(u32::MAX as usize) as u32,
        count: count as u64,
    };
    for l in ctx.links.iter_mut().flatten() {
        if let Some(shm) = l.shm() {
            shm.lane().announce(&stamp);
        }
    }
    // SAFETY: the caller's contract.
    let r = unsafe { run(&mut ctx, state, &stamp, send, recv, count, dtype, op, probe) };
    if !matches!(r, Ok(true)) {
        withdraw(ctx.links);
    }
    r
}

/// Takes back the lane notices of the call.
fn withdraw(links: &mut [Option<Box<dyn Link>>]) {
    for l in links.iter_mut().flatten() {
        if let Some(shm) = l.shm() {
            shm.lane().withdraw();
        }
    }
}

/// The body of [`all_reduce`]: sets the arena up on the first call, then runs the call
/// ([`call`]) with the peers' mappings it looks up kept until it ends.
///
/// # Safety
/// As [`all_reduce`].
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    ctx: &mut PlanlessCtx<'_>,
    state: &mut Option<State>,
    stamp: &Stamp,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    probe: bool,
) -> Result<bool> {
    if state.is_none() {
        *state = Some(first_state(ctx, stamp, probe)?);
    }
    let mut st = state.take().expect("arena set up");
    st.peers.begin(ctx.nranks);
    // SAFETY: forwarded from this function's contract.
    let r = unsafe { call(ctx, &mut st, stamp, send, recv, count, dtype, op, probe) };
    st.peers.end();
    *state = Some(st);
    r
}

/// A communicator's arena state, set up by its first call (which logs which calls take it).
fn first_state(ctx: &mut PlanlessCtx<'_>, stamp: &Stamp, probe: bool) -> Result<State> {
    let (rank, n) = (ctx.rank, ctx.nranks);
    let arena = setup(ctx, stamp)?;
    if probe {
        crate::info!(
            "rank {rank}: host arena set up for all-reduces of buffers in shareable host memory ({n} ranks, from {PROBE_MIN} B)"
        );
    } else {
        crate::info!("rank {rank}: all-reduces take the host arena ({n} ranks, {SLOT} B per rank and piece)");
    }
    Ok(State {
        arena,
        gen: 0,
        half: 0,
        peers: PeerMaps::default(),
        members: Vec::new(),
        send_at: Vec::new(),
        recv_at: Vec::new(),
        told: false,
        plans: [None, None],
    })
}

/// One call on the arena of `st`: this rank's stamp and shared buffers, the plan's steps up to
/// the first barrier, the barrier and the stamps' comparison, then (unless a probe finds a
/// buffer not shared) the peers' shared buffers located and the rest of the plan.
///
/// # Safety
/// As [`all_reduce`].
#[allow(clippy::too_many_arguments)]
unsafe fn call(
    ctx: &mut PlanlessCtx<'_>,
    st: &mut State,
    stamp: &Stamp,
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    probe: bool,
) -> Result<bool> {
    let (rank, n, es) = (ctx.rank, ctx.nranks, dtype.size());
    let len = count * es;
    // Buffers in shareable host memory are read by the others where they lie.
    let share = |p: *const u8| if ctx.share { hostmem::find(p, len) } else { None };
    let (my_send, my_recv) = (share(send), share(recv.cast_const()));
    st.arena.set_stamp(rank, &stamp.encode(0));
    st.arena.set_bufs(rank, &my_send.unwrap_or_default(), &my_recv.unwrap_or_default());
    if count == 0 {
        // An empty call: no plan, no barrier (`hostmem` shares no empty buffer, so no rank
        // has a closing barrier either).
        return Ok(true);
    }
    let h0 = st.half;
    st.half ^= window::arena_pieces(count, es, st.arena.slot()) & 1;
    // Where the others' inputs and results lie in this process (shared buffers), by rank;
    // filled after the first barrier.
    let mut bufs =
        Bufs { rank, send, recv, send_at: std::mem::take(&mut st.send_at), recv_at: std::mem::take(&mut st.recv_at) };
    bufs.send_at.clear();
    bufs.send_at.resize(n, None);
    bufs.recv_at.clear();
    bufs.recv_at.resize(n, None);
    let own = (my_send.is_some(), my_recv.is_some());
    let head = head_plan(st, rank, n, count, es, own, h0)?;
    let mut srcs = Vec::with_capacity(n);
    if probe {
        // No copy: the call goes on only when every input is shared, and then there is none.
        // The notices go before the probe's barrier: past it, the peer may run the call on
        // its plan, and must not take this notice for another call.
        withdraw(ctx.links);
    } else {
        for step in &head.plan.ops[..head.first] {
            // SAFETY: the call's plan before its first barrier (`exec`'s contract).
            unsafe { exec(&st.arena, &bufs, step, dtype, op, &mut srcs)? };
        }
    }
    barrier(ctx, st, stamp)?;
    compare(ctx, &st.arena, stamp)?;
    if probe && !(0..n).all(|q| matches!(st.arena.bufs(q), (s, r) if s.is_some() && r.is_some())) {
        return Ok(false);
    }
    locate_peers(st, &mut bufs, n, len)?;
    let kept = whole_plan(st, &bufs, head, own, count, es, h0)?;
    // SAFETY: forwarded from this function's contract; past the plan's first barrier.
    unsafe { after_first_barrier(ctx, st, &bufs, &kept, stamp, (dtype, op), &mut srcs, probe)? };
    st.plans[h0] = Some(kept);
    st.send_at = bufs.send_at;
    st.recv_at = bufs.recv_at;
    Ok(true)
}

/// The plan up to the first barrier. Until then the peers' buffers are unknown; what runs
/// before it depends only on this rank's sharing and the first piece
/// (`window::arena_all_reduce`): the plan kept from a call of this shape, else that of the
/// first piece alone.
fn head_plan(
    st: &mut State,
    rank: usize,
    n: usize,
    count: usize,
    es: usize,
    own: (bool, bool),
    h0: usize,
) -> Result<Kept> {
    if let Some(p) = st.plans[h0].take().filter(|p| p.head_fits(count, es, rank, own)) {
        return Ok(p);
    }
    let slot = st.arena.slot();
    let mut alone = vec![(false, false); n];
    alone[rank] = own;
    Kept::build(rank, count.min(slot / es), es, slot, alone, h0)
}

/// Fills `bufs` with where the peers' shared buffers of `len` bytes lie in this process
/// (mapped from the process of the rank that names them), after the first barrier.
fn locate_peers(st: &mut State, bufs: &mut Bufs, n: usize, len: usize) -> Result<()> {
    let rank = bufs.rank;
    if st.members.is_empty() {
        st.members = (0..n).map(|q| st.arena.pid(q)).collect();
    }
    for q in (0..n).filter(|&q| q != rank) {
        let (s, r) = st.arena.bufs(q);
        let owner = [st.members[q]];
        let mut at = |d: BufDesc| -> Result<Option<usize>> {
            if !d.is_some() {
                return Ok(None);
            }
            let p =
                st.peers.resolve(&d, len, &owner).map_err(|e| e.context(format!("rank {rank}: rank {q}'s buffer")))?;
            Ok(Some(p as usize))
        };
        bufs.send_at[q] = at(s)?;
        bufs.recv_at[q] = at(r)?;
    }
    Ok(())
}

/// The whole call's plan once every rank's sharing is known: `head` when it fits, else one
/// built for this call (whose steps before the first barrier are `head`'s).
fn whole_plan(
    st: &mut State,
    bufs: &Bufs,
    head: Kept,
    own: (bool, bool),
    count: usize,
    es: usize,
    h0: usize,
) -> Result<Kept> {
    let (rank, n, slot) = (bufs.rank, bufs.send_at.len(), st.arena.slot());
    let shares = |q: usize| if q == rank { own } else { (bufs.send_at[q].is_some(), bufs.recv_at[q].is_some()) };
    let kept = if head.fits(count, es, (0..n).map(shares)) {
        head
    } else {
        let full = Kept::build(rank, count, es, slot, (0..n).map(shares).collect(), h0)?;
        debug_assert_eq!(full.plan.ops[..full.first], head.plan.ops[..head.first], "the ops before the barrier");
        full
    };
    if cfg!(debug_assertions) {
        let fresh = window::arena_all_reduce(rank, n, count, es, slot, &(0..n).map(shares).collect::<Vec<_>>(), h0);
        debug_assert_eq!(kept.plan, fresh, "the kept plan is this call's");
    }
    if (0..n).any(|q| shares(q) != (false, false)) && !st.told {
        st.told = true;
        crate::info!("rank {rank}: host arena: buffers in shareable host memory are read where they lie");
    }
    Ok(kept)
}

/// Runs `kept`'s steps after its first barrier, arriving at each later barrier.
///
/// # Safety
/// As [`all_reduce`], with every rank past the plan's first barrier.
#[allow(clippy::too_many_arguments)]
unsafe fn after_first_barrier(
    ctx: &mut PlanlessCtx<'_>,
    st: &mut State,
    bufs: &Bufs,
    kept: &Kept,
    stamp: &Stamp,
    (dtype, op): (DataType, ReduceOp),
    srcs: &mut Vec<*const u8>,
    probe: bool,
) -> Result<()> {
    for (i, step) in kept.plan.ops.iter().enumerate().skip(kept.first + 1) {
        if !matches!(step, WindowStep::Barrier) {
            // SAFETY: the call's plan, past the barriers before `step` (`exec`'s contract).
            unsafe { exec(&st.arena, bufs, step, dtype, op, srcs)? };
            continue;
        }
        // The notices go before the last arrival: once every rank passed that barrier, a
        // peer may start its next call while this rank still copies out (or, after the
        // closing barrier, leaves), and must not take this call's notice for that one's.
        if i == kept.last && !probe {
            withdraw(ctx.links);
        }
        barrier(ctx, st, stamp)?;
    }
    Ok(())
}

/// Arrives at the next barrier and waits until every rank reached it.
fn barrier(ctx: &mut PlanlessCtx<'_>, st: &mut State, stamp: &Stamp) -> Result<()> {
    st.gen = st.gen.wrapping_add(1);
    let g = st.gen;
    let arena = &st.arena;
    arena.arrive(ctx.rank, g);
    let mut from = 0;
    let mut rounds = 0u32;
    let mut clock: Option<Clock> = None;
    let yields = ctx.spin.yields_at_once();
    loop {
        match arena.missing(from, g) {
            None => break,
            Some(p) => from = p,
        }
        rounds += 1;
        if yields {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        if rounds < CLOCKLESS_ROUNDS {
            continue;
        }
        let w = ctx.waiter(g as usize, from);
        let links = &mut *ctx.links;
        let sleep = w.idle(&mut clock, &mut || look(&w, links, arena, from, g, stamp, &mut |_| {})).map_err(|e| {
            if e.kind() != ErrorKind::Timeout {
                return e.context(format!("rank {}: all_reduce (host arena)", ctx.rank));
            }
            let who = links.get(from).and_then(|l| l.as_ref()).map_or_else(|| format!("rank {from}"), |l| l.describe());
            Error::timeout(format!(
                "rank {}: all_reduce (host arena, barrier {g}): no arrival from {who} for {} ms (OXCCL_TIMEOUT_MS)",
                ctx.rank,
                ctx.timeout.as_millis()
            ))
        })?;
        if sleep {
            let left = clock.as_ref().map_or(NAP, |c| c.left(ctx.timeout));
            arena.sleep(g, left.min(NAP));
        }
    }
    ctx.waiter(g as usize, from).done(clock);
    Ok(())
}

/// The periodic look at the links of the ranks (from `from` on) that have not reached barrier
/// `g`: an error for a failed peer or one that runs another call.
///
/// A peer may reach `g` between the test and the look at its link, pass the barrier (this
/// rank has arrived), finish the call and start its next one: announce it on the lane (with
/// the sequence number this call's notice had, as arena calls post no lane message), send ring
/// bytes of an engine call, or exit and close the link. What the look finds is therefore
/// reported only if the peer has still not reached `g` afterwards: everything such a peer
/// writes after its arrival is seen after that arrival (its arrival is a sequentially
/// consistent store; what this rank reads of the link is an acquire). `between(p)` runs after
/// peer `p` was found missing and before its link is looked at (the window the tests fill with
/// the peer's arrival and next call; a no-op otherwise).
fn look(
    w: &Waiter<'_>,
    links: &mut [Option<Box<dyn Link>>],
    arena: &Arena,
    from: usize,
    g: u32,
    stamp: &Stamp,
    between: &mut dyn FnMut(usize),
) -> Result<()> {
    for p in (from..arena.nranks()).filter(|&p| p != w.rank && !arena.has_reached(p, g)) {
        let Some(link) = links.get_mut(p).and_then(|l| l.as_deref_mut()) else { continue };
        between(p);
        let found = look_at(&Waiter { peer: p, ..*w }, link, stamp);
        if found.is_err() && !arena.has_reached(p, g) {
            return found;
        }
    }
    Ok(())
}

/// One peer's link in [`look`]: an error for a failed peer or one that runs another call.
fn look_at(w: &Waiter<'_>, link: &mut dyn Link, stamp: &Stamp) -> Result<()> {
    let Some(shm) = link.shm() else { return Ok(()) };
    let mut head = [0u8; SIG_LEN];
    let n = shm.lane_check(&mut head)?;
    if n > 0 {
        return Err(w.foreign(stamp, &head[..n]));
    }
    match shm.lane_unexpected() {
        Some(theirs) => same_call(w.rank, stamp, w.peer, &theirs, true),
        None => Ok(()),
    }
}

/// An error unless `theirs` (rank `peer`'s call) is the call `mine` describes.
fn same_call(rank: usize, mine: &Stamp, peer: usize, theirs: &Stamp, check: bool) -> Result<()> {
    let strip = |s: &Stamp| stamp_signature(&Stamp { len: mine.len, ..*s }, 0);
    if check {
        return crate::mismatch::check(rank, &strip(mine), peer, &strip(theirs));
    }
    if (theirs.tag, theirs.dtype, theirs.op, theirs.count) != (mine.tag, mine.dtype, mine.op, mine.count) {
        return Err(Error::invalid_usage(format!(
            "collective mismatch: rank {rank} runs an all-reduce of {} elements, rank {peer} another call",
            mine.count
        )));
    }
    Ok(())
}

/// Compares every rank's stamp in the arena with this rank's call.
fn compare(ctx: &PlanlessCtx<'_>, arena: &Arena, stamp: &Stamp) -> Result<()> {
    for q in (0..ctx.nranks).filter(|&q| q != ctx.rank) {
        let Some((_, theirs)) = Stamp::decode(&arena.stamp(q)) else {
            return Err(Error::invalid_usage(format!(
                "collective mismatch: rank {q} reached rank {}'s all-reduce barrier without a call's stamp",
                ctx.rank
            )));
        };
        same_call(ctx.rank, stamp, q, &theirs, ctx.check)?;
    }
    Ok(())
}

/// Sets up the arena at the first call: the lowest rank creates it and sends its descriptor to
/// every other rank over the lane, each maps it and answers (two lane exchanges per pair).
fn setup(ctx: &mut PlanlessCtx<'_>, stamp: &Stamp) -> Result<Arena> {
    let (rank, n) = (ctx.rank, ctx.nranks);
    let with = |len: usize| Stamp { len: len as u32, ..*stamp };
    if rank == 0 {
        let made = Arena::create(n, SLOT);
        // A zero descriptor (pid 0) tells the others that creating it failed.
        let d = made.as_ref().map(|(_, d)| d.encode()).unwrap_or([0; DESCRIPTOR_LEN]);
        for q in 1..n {
            exchange(ctx, q, &with(DESCRIPTOR_LEN), &d, &mut [])?;
        }
        let (mut arena, _) = made?;
        arena.set_pid(rank);
        let mut failed = None;
        for q in 1..n {
            let mut verdict = [0u8; 1];
            let got = exchange(ctx, q, &with(0), &[], &mut verdict)?;
            if got.len != 1 || verdict[0] != 1 {
                failed = failed.or(Some(q));
            }
        }
        arena.close_fd();
        if let Some(q) = failed {
            return Err(Error::remote(format!("rank {q} could not map the host arena of rank 0 (see its error)")));
        }
        return Ok(arena);
    }
    let mut d = [0u8; DESCRIPTOR_LEN];
    let got = exchange(ctx, 0, &with(0), &[], &mut d)?;
    let desc = (got.len as usize == DESCRIPTOR_LEN).then(|| Descriptor::decode(&d)).flatten();
    let Some(desc) = desc.filter(|d| d.pid != 0) else {
        return Err(Error::remote("rank 0 could not create the host arena (see its error)"));
    };
    let opened = Arena::open(&desc, n);
    if let Ok(a) = &opened {
        a.set_pid(rank);
    }
    exchange(ctx, 0, &with(1), &[opened.is_ok() as u8], &mut [])?;
    opened.map_err(|e| e.context(format!("rank {rank}: mapping the host arena of rank 0")))
}

/// One lane exchange with `peer` during set-up; the peer's stamp must describe the same call.
fn exchange(ctx: &mut PlanlessCtx<'_>, peer: usize, stamp: &Stamp, mine: &[u8], theirs: &mut [u8]) -> Result<Stamp> {
    let w = ctx.waiter(0, peer);
    let rank = ctx.rank;
    let Some(link) = ctx.links.get_mut(peer).and_then(|l| l.as_deref_mut()) else {
        return Err(Error::internal(format!("rank {rank}: all_reduce: no link to rank {peer}")));
    };
    let got = match link.shm() {
        Some(shm) => w.lane(shm, stamp, mine, theirs)?,
        None => w.stream(link, stamp, mine, theirs)?,
    };
    same_call(rank, stamp, peer, &got, true)?;
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::super::lane::testing::{stamp_of, waiter};
    use super::*;
    use crate::transport::shm::ShmLink;
    use std::sync::atomic::AtomicBool;

    /// Rank 0 waits at barrier 2 of an all-reduce of 1 double; rank 1 is missing when rank 0
    /// tests it. `race`: in the window before rank 0 looks at the link, rank 1 arrives at
    /// barrier 2 and announces its next call (4096 int64 maxima), as a peer that passed the
    /// barrier and went on does. Otherwise rank 1 announces that call without arriving.
    fn look_across_the_window(race: bool) -> Result<()> {
        let (arena, _) = Arena::create(2, 4096).unwrap();
        arena.arrive(0, 2);
        arena.arrive(1, 1);
        let (a, mut b) = ShmLink::pair(1 << 16).unwrap();
        let mut links: Vec<Option<Box<dyn Link>>> = vec![None, Some(Box::new(a))];
        let abort = AtomicBool::new(false);
        let w = waiter(&abort, 2);
        let mine = stamp_of(1, DataType::Float64, ReduceOp::Max);
        let next = stamp_of(4096, DataType::Int64, ReduceOp::Max);
        look(&w, &mut links, &arena, 0, 2, &mine, &mut |p| {
            assert_eq!(p, 1);
            if race {
                arena.arrive(1, 2);
            }
            b.lane().announce(&next);
        })
    }

    #[test]
    fn a_peer_that_passed_the_barrier_and_went_on_is_no_mismatch() {
        look_across_the_window(true).expect("the next call of a peer that arrived is not this call's mismatch");
    }

    #[test]
    fn a_peer_that_announces_another_call_without_arriving_is_a_mismatch() {
        let e = look_across_the_window(false).expect_err("a peer in another call");
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.message().contains("collective mismatch") && e.message().contains("count=4096"), "{e}");
    }
}
