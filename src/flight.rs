//! Hang diagnosis: every communicator keeps a small ring of its last operations (sequence
//! number, collective, count, type, peers, state, timestamps) and writes it as JSON when asked,
//! so that the dumps of all ranks can be merged into a verdict (`oxccl-dump merge`, see
//! docs/RELIABILITY.md) such as "ranks 0-2 wait in all_reduce #1234 for rank 3, whose last op
//! is #1233".
//!
//! A dump is written to `OXCCL_DUMP=<dir>` (NCCL_ twin `NCCL_DUMP`), one file per rank
//! (`oxccl-<tag>-rank<r>.json`, replaced by each new dump), when an operation fails (timeout
//! included) or the communicator is aborted, and, with `OXCCL_DUMP_SIGNAL=1`, on `SIGUSR1`. The
//! signal handler is installed only then (it would replace the host's own), and does nothing
//! but set a flag that a helper thread polls every 100 ms; the thread writes the dumps.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// Operations kept per communicator.
pub const RING: usize = 64;

/// One recorded operation.
#[derive(Clone, Debug)]
struct Entry {
    seq: u64,
    op: String,
    count: u64,
    dtype: &'static str,
    peers: Vec<usize>,
    /// `None` while running; `Some(None)` done; `Some(Some(err))` failed.
    end: Option<(u64, Option<String>)>,
    start_ms: u64,
}

struct Inner {
    rank: usize,
    nranks: usize,
    tag: String,
    next: u64,
    /// Entry of operation `seq` at index `(seq - 1) % RING` (overwritten in place once full).
    ring: Vec<Entry>,
}

impl Inner {
    fn at(&mut self, seq: u64) -> Option<&mut Entry> {
        let i = (seq.wrapping_sub(1) % RING as u64) as usize;
        self.ring.get_mut(i).filter(|e| e.seq == seq)
    }
}

/// A communicator's flight recorder.
pub(crate) struct Recorder(Arc<Shared>);

/// The ring, and the last operation that completed without error: a success is recorded
/// without taking the lock (two stores), and written into its entry at the next look at the
/// ring ([`settle`]).
struct Shared {
    ring: Mutex<Inner>,
    done_seq: AtomicU64,
    done_ms: AtomicU64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        let mut g = lock(&self.ring);
        let seq = self.done_seq.load(Ordering::Acquire);
        if let Some(e) = g.at(seq).filter(|e| e.end.is_none()) {
            e.end = Some((self.done_ms.load(Ordering::Relaxed), None));
        }
        g
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// [`now_ms`] from the kernel's coarse clock (updated every tick, 1-10 ms): the timestamps of
/// the operations, read twice per call, for which a tick is precise enough (a hang shows in
/// seconds) and a precise read costs a tenth of a small all-reduce.
fn coarse_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a live, writable timespec; CLOCK_REALTIME_COARSE is always available on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } != 0 {
        return now_ms();
    }
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Every live recorder (for the signal-driven dump).
fn live() -> &'static Mutex<Vec<Weak<Shared>>> {
    static L: OnceLock<Mutex<Vec<Weak<Shared>>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(Vec::new()))
}

/// The dump directory (`OXCCL_DUMP`), read once.
fn dump_dir() -> Option<&'static str> {
    static D: OnceLock<Option<String>> = OnceLock::new();
    D.get_or_init(|| crate::config::env("DUMP").filter(|d| !d.trim().is_empty())).as_deref()
}

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::Relaxed);
}

/// Installs the SIGUSR1 handler and its helper thread once, when `OXCCL_DUMP_SIGNAL=1`.
fn arm_signal() {
    static ARMED: OnceLock<()> = OnceLock::new();
    ARMED.get_or_init(|| {
        if crate::config::env("DUMP_SIGNAL").is_none_or(|v| v.trim() != "1") {
            return;
        }
        let spawned = std::thread::Builder::new().name("oxccl-dump".into()).spawn(|| loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if SIGNALLED.swap(false, Ordering::Relaxed) {
                let all: Vec<_> = lock(live()).iter().filter_map(Weak::upgrade).collect();
                for r in all {
                    Recorder(r).dump("SIGUSR1");
                }
            }
        });
        if spawned.is_ok() {
            // SAFETY: the handler only stores to an atomic (async-signal-safe); installed once.
            unsafe { libc::signal(libc::SIGUSR1, on_sigusr1 as extern "C" fn(libc::c_int) as libc::sighandler_t) };
        }
    });
}

impl Recorder {
    /// A recorder for `rank` of `nranks`; `tag` names the communicator identically on every
    /// rank (the merge groups dumps by it).
    pub(crate) fn new(rank: usize, nranks: usize, tag: String) -> Recorder {
        let inner = Arc::new(Shared {
            ring: Mutex::new(Inner { rank, nranks, tag, next: 0, ring: Vec::with_capacity(RING) }),
            done_seq: AtomicU64::new(0),
            done_ms: AtomicU64::new(0),
        });
        let mut l = lock(live());
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(&inner));
        drop(l);
        arm_signal();
        Recorder(inner)
    }

    /// Records the start of an operation; returns its sequence number.
    pub(crate) fn start(&self, op: &str, desc: &crate::mismatch::Desc, peers: &[usize]) -> u64 {
        let mut g = self.0.lock();
        g.next += 1;
        let seq = g.next;
        let dtype = if desc.tag == crate::mismatch::GROUP_TAG {
            "-" // a group of several operations has no single type
        } else {
            crate::types::DataType::from_raw(desc.dtype as i32).map_or("?", |d| d.name())
        };
        let start_ms = coarse_ms();
        if g.ring.len() < RING {
            let e = Entry { seq, op: op.into(), count: desc.count, dtype, peers: peers.into(), end: None, start_ms };
            g.ring.push(e);
        } else {
            // The oldest entry is overwritten in place, its buffers reused: no allocation.
            let i = ((seq - 1) % RING as u64) as usize;
            let e = &mut g.ring[i];
            e.seq = seq;
            e.op.clear();
            e.op.push_str(op);
            e.count = desc.count;
            e.dtype = dtype;
            e.peers.clear();
            e.peers.extend_from_slice(peers);
            e.end = None;
            e.start_ms = start_ms;
        }
        seq
    }

    /// Records the end of operation `seq`; a failure also writes a dump (when configured).
    pub(crate) fn finish(&self, seq: u64, r: &crate::error::Result<()>) {
        if r.is_ok() {
            self.0.done_ms.store(coarse_ms(), Ordering::Relaxed);
            self.0.done_seq.store(seq, Ordering::Release);
            return;
        }
        {
            let mut g = self.0.lock();
            if let Some(e) = g.at(seq) {
                e.end = Some((coarse_ms(), r.as_ref().err().map(|e| e.message().to_string())));
            }
        }
        self.dump("failure");
    }

    /// The ring as JSON.
    pub(crate) fn to_json(&self, why: &str) -> String {
        let g = self.0.lock();
        let mut s = String::new();
        let _ = write!(
            s,
            "{{\"rank\":{},\"nranks\":{},\"comm\":{},\"pid\":{},\"host\":{},\"why\":{},\"now_ms\":{},\"ops\":[",
            g.rank,
            g.nranks,
            quote(&g.tag),
            std::process::id(),
            quote(&crate::bootstrap::hostname()),
            quote(why),
            now_ms()
        );
        let mut order: Vec<&Entry> = g.ring.iter().collect();
        order.sort_by_key(|e| e.seq);
        for (i, e) in order.into_iter().enumerate() {
            let state = match &e.end {
                None => "running",
                Some((_, None)) => "done",
                Some((_, Some(_))) => "failed",
            };
            let peers: Vec<String> = e.peers.iter().map(|p| p.to_string()).collect();
            let _ = write!(
                s,
                "{}\n{{\"seq\":{},\"op\":{},\"count\":{},\"type\":{},\"peers\":[{}],\"state\":\"{state}\",\"start_ms\":{},\"end_ms\":{},\"error\":{}}}",
                if i > 0 { "," } else { "" },
                e.seq,
                quote(&e.op),
                e.count,
                quote(e.dtype),
                peers.join(","),
                e.start_ms,
                e.end.as_ref().map_or("null".into(), |(t, _)| t.to_string()),
                e.end.as_ref().and_then(|(_, m)| m.as_deref()).map_or("null".into(), quote)
            );
        }
        s.push_str("\n]}\n");
        s
    }

    /// Writes the ring to `OXCCL_DUMP` (when set); `why` says what triggered it.
    pub(crate) fn dump(&self, why: &str) {
        let Some(dir) = dump_dir() else { return };
        let (rank, tag) = {
            let g = self.0.lock();
            (g.rank, g.tag.clone())
        };
        let path = std::path::Path::new(dir).join(format!("oxccl-{tag}-rank{rank}.json"));
        let tmp = path.with_extension("json.tmp");
        let r = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&tmp, self.to_json(why)))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match r {
            Ok(()) => crate::warn!("rank {rank}: wrote its last operations to {} ({why})", path.display()),
            Err(e) => crate::warn!("rank {rank}: could not write {}: {e}", path.display()),
        }
    }
}

/// A JSON string literal.
fn quote(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_operations_with_their_state() {
        let r = Recorder::new(1, 4, "t".into());
        let d = crate::mismatch::Desc::single(
            crate::algo::Collective::AllReduce,
            7,
            crate::types::DataType::Float32,
            crate::types::ReduceOp::Sum,
        );
        for _ in 0..RING + 3 {
            let s = r.start("all_reduce", &d, &[0, 2]);
            r.finish(s, &Ok(()));
        }
        let s = r.start("all_reduce", &d, &[0, 2]);
        let j = r.to_json("test");
        assert_eq!(s, RING as u64 + 4);
        assert_eq!(j.matches("\"seq\":").count(), RING, "{j}");
        assert!(!j.contains("\"seq\":4,"), "the oldest were dropped: {j}");
        assert!(j.contains(&format!("\"seq\":{s},\"op\":\"all_reduce\",\"count\":7,\"type\":\"float\",\"peers\":[0,2],\"state\":\"running\"")), "{j}");
        assert!(j.contains("\"rank\":1,\"nranks\":4,\"comm\":\"t\""), "{j}");
        assert_eq!(quote("a\"b\\\n"), "\"a\\\"b\\\\\\u000a\"");
        let g = r.start("group(send, recv)", &crate::mismatch::Desc::group(2), &[3]);
        assert!(
            r.to_json("test").contains(&format!(
                "\"seq\":{g},\"op\":\"group(send, recv)\",\"count\":0,\"type\":\"-\",\"peers\":[3],"
            )),
            "a reused entry keeps none of the old one's op or peers"
        );
    }
}
