//! How the engine waits when nothing moves: spin, then yield the core, then sleep.
//!
//! The policy depends on whether the ranks of this host outnumber the CPUs they may use
//! (oversubscription). That count is the host's (the cgroup's cpuset and CPU quota, or the
//! online CPUs), **not this process's affinity mask**: a launcher that pins each rank to its own
//! CPU (`mpirun --bind-to core`, `oxccl-perf --bind cpu`) leaves every rank a one-CPU mask,
//! which says nothing about how many CPUs the ranks share. Reading the mask made two pinned
//! ranks on a two-CPU host look oversubscribed, so they slept in poll(2) after a few
//! microseconds of spinning; once one side slept, every message paid a wake-up (~35 µs instead
//! of ~0.5 µs), and the two ranks stayed in that mode for the rest of the run (the bimodal
//! latency of issue 21).
//!
//! - Not oversubscribed: spin without a system call for [`PURE_SPIN`], then call
//!   `sched_yield` on each idle round (it returns at once when nothing else wants the core, and
//!   lets another tenant run when something does) until `OXCCL_SPIN_US` (default 50 µs), then
//!   sleep in poll(2) until a peer's wake-up.
//! - Oversubscribed: yield on every idle round from the start (the peer this rank waits for
//!   may be waiting for this very core, as Open MPI's `mpi_yield_when_idle` does), for
//!   `OXCCL_SPIN_US` (default [`OVERSUB_SPIN_US`]), then sleep.
//!
//! In both cases the time before sleeping adapts ([`budget`]): it halves after each wait that
//! outlasted it and is restored by any shorter wait, so that ranks waiting on a peer busy with
//! a large chunk stop spinning (on a loaded host a spinning rank takes CPU from the ranks that
//! have work), while small messages keep spinning.

use std::time::Duration;

/// How long the engine spins without yielding the core, at the start of a wait, when the
/// ranks have a CPU each.
pub const PURE_SPIN: Duration = Duration::from_micros(5);

/// Default spin-then-yield time with a CPU per rank (µs).
pub const SPIN_US: u64 = 50;

/// Default yield time before sleeping when ranks outnumber CPUs (µs): long enough for a small
/// message's round trips through the scheduler (25-40 µs per 8 B all-reduce on 4 ranks and 2
/// loaded CPUs), short enough that a rank waiting for a peer's large copy goes to sleep and
/// leaves the CPU to it (yielding does not take a rank off the run queue).
pub const OVERSUB_SPIN_US: u64 = 50;

/// The engine's waiting policy for one communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spin {
    /// Spin without system calls while idle for less than this.
    pub pure: Duration,
    /// Yield the core on each idle round until idle for this long, then sleep.
    pub total: Duration,
}

impl Spin {
    /// The policy for `ranks_here` ranks on a host whose ranks may use `cpus` CPUs, with
    /// `spin_us` from `OXCCL_SPIN_US` when set.
    pub fn for_load(ranks_here: usize, cpus: usize, spin_us: Option<u64>) -> Spin {
        if ranks_here > cpus.max(1) {
            let total = Duration::from_micros(spin_us.unwrap_or(OVERSUB_SPIN_US));
            Spin { pure: Duration::ZERO, total }
        } else {
            let total = Duration::from_micros(spin_us.unwrap_or(SPIN_US));
            Spin { pure: PURE_SPIN.min(total), total }
        }
    }

    /// Whether idle rounds yield the core from the start.
    pub fn yields_at_once(&self) -> bool {
        self.pure.is_zero()
    }
}

thread_local! {
    /// This thread's current spin budget in µs ([`budget`]); `u64::MAX` until the first wait.
    static BUDGET_US: std::cell::Cell<u64> = const { std::cell::Cell::new(u64::MAX) };
}

/// How long the engine on this thread spins (and yields) before sleeping, now: the policy's
/// `total`, halved after each wait that outlasted it (spinning did not pay: the peer was busy
/// for longer, e.g. copying a large chunk, and a spinning rank only takes CPU from it on a
/// loaded host), and doubled (from at least 1 µs, up to `total`) after any wait shorter than
/// `total`, *sleep included*. The last rule keeps the budget from collapsing for small
/// messages: a wait that ended in a sleep and a wake-up (tens of µs) still counts as short, so
/// the budget climbs back until replies are caught while spinning again.
pub fn budget(p: &Spin) -> Duration {
    let us = BUDGET_US.with(|b| b.get());
    p.total.min(Duration::from_micros(us))
}

/// Records that the engine waited `idle` (spin, yield and sleep) before progress resumed.
pub fn waited(p: &Spin, idle: Duration) {
    BUDGET_US.with(|b| {
        let total = p.total.as_micros() as u64;
        let now = b.get().min(total);
        let next = if idle <= p.total { now.saturating_mul(2).clamp(1, total) } else { now / 2 };
        b.set(next);
    });
}

/// Waits within [`NUDGE_WINDOW`] that must find the partner on this CPU before [`colocated`]
/// moves the thread.
pub const NUDGE_AFTER: u32 = 64;
/// See [`NUDGE_AFTER`].
pub const NUDGE_WINDOW: Duration = Duration::from_millis(20);

thread_local! {
    /// Same-CPU waits seen since the instant, for [`colocated`].
    static STREAK: std::cell::Cell<(u32, Option<std::time::Instant>)> = const { std::cell::Cell::new((0, None)) };
}

/// Called by a wait that found its partner on this very CPU although the host has a CPU per
/// rank: two unbound ranks the scheduler stacked on one CPU, handing it over at every message.
/// The load balancer separates them only slowly when each sleeps half the time (and a wake-up
/// stays on the waker's CPU when the VM shows its CPUs as separate caches), so after
/// [`NUDGE_AFTER`] such waits within [`NUDGE_WINDOW`] the thread moves itself to another CPU
/// of its affinity mask and restores the mask at once: the user's placement rules are kept,
/// and the scheduler may balance again later. Returns whether it moved.
pub fn colocated() -> bool {
    let now = std::time::Instant::now();
    let (n, since) = STREAK.with(|s| s.get());
    let fresh = since.is_none_or(|t| now.duration_since(t) > NUDGE_WINDOW);
    let n = if fresh { 1 } else { n + 1 };
    STREAK.with(|s| s.set((n, if fresh { Some(now) } else { since })));
    if n < NUDGE_AFTER {
        return false;
    }
    STREAK.with(|s| s.set((0, None)));
    move_off_this_cpu()
}

/// Moves the calling thread to another CPU of its affinity mask, then restores the mask.
fn move_off_this_cpu() -> bool {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set; the kernel writes at most its size.
    let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `mask` is a live, writable set of `size` bytes; 0 names the calling thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut mask) } != 0 {
        return false;
    }
    // SAFETY: sched_getcpu has no preconditions.
    let here = unsafe { libc::sched_getcpu() };
    // SAFETY: `CPU_ISSET` only reads the set, for indices below its capacity.
    let Some(to) = (0..libc::CPU_SETSIZE as usize).find(|&c| c as i32 != here && unsafe { libc::CPU_ISSET(c, &mask) })
    else {
        return false;
    };
    // SAFETY: as above.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `to` comes from the mask, so it is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(to, &mut one) };
    // SAFETY: both sets are valid masks of `size` bytes; the first call migrates the thread,
    // the second gives it its own mask back.
    let moved = unsafe { libc::sched_setaffinity(0, size, &one) } == 0;
    // SAFETY: as above.
    unsafe { libc::sched_setaffinity(0, size, &mask) };
    moved
}

/// How many of the ranks whose hosts are `hosts` (one identity per rank) share rank `me`'s host.
pub fn ranks_here(hosts: &[String], me: usize) -> usize {
    hosts.iter().filter(|h| **h == hosts[me]).count()
}

/// Whether `ranks_here` ranks outnumber the CPUs this host lets them use ([`host_cpus`]): the
/// host is crowded, and the same answer on every rank of it.
pub fn crowded(ranks_here: usize) -> bool {
    ranks_here > host_cpus()
}

/// CPUs the ranks of this host may use together, read once: the cgroup's effective cpuset
/// (else the online CPUs), at least this process's affinity mask, at most the cgroup's CPU
/// quota rounded up.
pub fn host_cpus() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(count_host_cpus)
}

/// [`host_cpus`], not cached (the affinity mask read is the calling thread's).
fn count_host_cpus() -> usize {
    let cg = cgroup_dir();
    let set = cg
        .as_deref()
        .and_then(|d| std::fs::read_to_string(format!("{d}/cpuset.cpus.effective")).ok())
        .and_then(|s| count_cpu_list(&s))
        .unwrap_or_else(online_cpus);
    let quota = cg.as_deref().and_then(quota_cpus);
    let n = set.max(affinity_cpus());
    quota.map_or(n, |q| n.min(q)).max(1)
}

/// The unified (v2) cgroup directory of this process, if mounted at /sys/fs/cgroup.
fn cgroup_dir() -> Option<String> {
    let s = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = s.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(format!("/sys/fs/cgroup{}", path.trim_end_matches('/')))
}

/// The smallest CPU quota (`cpu.max`, rounded up) of `dir` and its ancestors up to the root.
fn quota_cpus(dir: &str) -> Option<usize> {
    let mut best: Option<usize> = None;
    let mut d = dir.to_string();
    loop {
        if let Some(q) = std::fs::read_to_string(format!("{d}/cpu.max")).ok().and_then(|s| parse_cpu_max(&s)) {
            best = Some(best.map_or(q, |b| b.min(q)));
        }
        match d.rfind('/') {
            Some(i) if d[..i].len() >= "/sys/fs/cgroup".len() => d.truncate(i),
            _ => return best,
        }
    }
}

/// `"200000 100000"` → 2 CPUs; `"max 100000"` (no limit) → `None`.
fn parse_cpu_max(s: &str) -> Option<usize> {
    let mut it = s.split_whitespace();
    let quota: u64 = it.next()?.parse().ok()?;
    let period: u64 = it.next()?.parse().ok().filter(|&p| p > 0)?;
    Some(quota.div_ceil(period).max(1) as usize)
}

/// Counts the CPUs in a list such as `"0-3,8,10-11"`; `None` when it does not parse or is empty.
pub fn count_cpu_list(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

fn online_cpus() -> usize {
    // SAFETY: sysconf only reads system configuration.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        1
    }
}

fn affinity_cpus() -> usize {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set; the kernel writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live, writable `cpu_set_t` of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return 1;
    }
    // SAFETY: `CPU_COUNT` only reads the set.
    (unsafe { libc::CPU_COUNT(&set) }).max(1) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_here_counts_the_ranks_of_this_rank_s_host() {
        let hosts: Vec<String> = ["a", "b", "a", "c"].iter().map(|h| h.to_string()).collect();
        assert_eq!((ranks_here(&hosts, 0), ranks_here(&hosts, 2), ranks_here(&hosts, 1)), (2, 2, 1));
        assert!(!crowded(1), "one rank always has a CPU");
    }

    #[test]
    fn cpu_lists_and_quotas_parse() {
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("5"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("a-b"), None);
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000"), Some(2));
        assert_eq!(parse_cpu_max("50000 100000"), Some(1));
    }

    #[test]
    fn pinned_ranks_with_a_cpu_each_spin_and_oversubscribed_ones_yield() {
        // Two ranks on two CPUs (pinned or not): spin first, sleep only after the spin time.
        let p = Spin::for_load(2, 2, None);
        assert_eq!((p.pure, p.total), (PURE_SPIN, Duration::from_micros(SPIN_US)));
        assert!(!p.yields_at_once());
        // Four ranks on two CPUs: yield from the first idle round, and still wait before sleeping.
        let o = Spin::for_load(4, 2, None);
        assert!(o.yields_at_once() && o.total == Duration::from_micros(OVERSUB_SPIN_US));
        // OXCCL_SPIN_US sets the time before sleeping in both cases; 0 sleeps at once.
        assert_eq!(Spin::for_load(2, 2, Some(0)).total, Duration::ZERO);
        assert_eq!(Spin::for_load(2, 2, Some(0)).pure, Duration::ZERO);
        assert_eq!(Spin::for_load(3, 2, Some(7)).total, Duration::from_micros(7));
    }

    #[test]
    fn spin_budget_halves_after_long_waits_and_recovers_after_short_ones() {
        let p = Spin::for_load(2, 2, Some(64));
        let t = std::thread::spawn(move || {
            let mut seen = vec![budget(&p).as_micros()];
            // Waits of milliseconds (a peer copying large chunks): 64 -> 32 -> 16 -> 8.
            for _ in 0..3 {
                waited(&p, Duration::from_millis(3));
                seen.push(budget(&p).as_micros());
            }
            // Short waits (a sleep and a wake-up for a small message: 30 µs) double it back.
            for _ in 0..3 {
                waited(&p, Duration::from_micros(30));
                seen.push(budget(&p).as_micros());
            }
            // From nothing (after many long waits), the first short wait gives 1 µs.
            for _ in 0..10 {
                waited(&p, Duration::from_millis(3));
            }
            seen.push(budget(&p).as_micros());
            waited(&p, Duration::from_micros(30));
            seen.push(budget(&p).as_micros());
            seen
        });
        assert_eq!(t.join().unwrap(), vec![64, 32, 16, 8, 16, 32, 64, 0, 1]);
    }

    #[test]
    fn host_cpus_is_not_the_affinity_mask_of_a_pinned_thread() {
        let unpinned = count_host_cpus();
        assert!(unpinned >= 1);
        // A thread pinned to one CPU (as `--bind cpu` pins a rank) counts the same host CPUs.
        let pinned = std::thread::spawn(|| {
            // SAFETY: an all-zero `cpu_set_t` is a valid empty set.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is ours; the CPU index comes from a mask, so it is below CPU_SETSIZE.
            unsafe { libc::CPU_SET(first_allowed_cpu(), &mut set) };
            // SAFETY: `set` is a valid mask of the size passed; 0 names the calling thread.
            let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
            assert_eq!(rc, 0, "pinning the test thread");
            assert_eq!(affinity_cpus(), 1);
            count_host_cpus()
        })
        .join()
        .unwrap();
        assert_eq!(pinned, unpinned, "pinning must not change the host's CPU count");
        assert_eq!(Spin::for_load(2, pinned, None), Spin::for_load(2, unpinned, None));
    }

    #[test]
    fn stacked_waits_move_the_thread_and_keep_its_mask() {
        let t = std::thread::spawn(|| {
            let before = affinity_cpus();
            let moves: Vec<bool> = (0..NUDGE_AFTER).map(|_| colocated()).collect();
            (before, moves, affinity_cpus())
        });
        let (before, moves, after) = t.join().unwrap();
        // Only the last of NUDGE_AFTER quick same-CPU waits moves the thread, and only where
        // the mask holds another CPU; the mask is the same afterwards.
        assert!(moves[..moves.len() - 1].iter().all(|m| !m), "{moves:?}");
        assert_eq!(moves[moves.len() - 1], before > 1);
        assert_eq!(after, before);
    }

    fn first_allowed_cpu() -> usize {
        // SAFETY: as in `affinity_cpus`.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: as in `affinity_cpus`.
        assert_eq!(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
        // SAFETY: `CPU_ISSET` only reads the set, for indices below its capacity.
        (0..libc::CPU_SETSIZE as usize).find(|&c| unsafe { libc::CPU_ISSET(c, &set) }).expect("one allowed CPU")
    }
}
