//! Hang diagnosis: every communicator keeps a small ring of its last operations (sequence
//! number, collective, count, type, peers, state, timestamps), and one of its last device
//! calls (`device_ops`: numbered on their own, done once enqueued), and writes them as JSON when asked,
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
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

/// Operations kept per communicator.
pub const RING: usize = 64;
/// Bytes of an operation's name kept (a longer group description is cut, marked with `...`).
const NAME_WORDS: usize = 8;
const NAME_BYTES: usize = NAME_WORDS * 8;
/// Peers kept per operation (the dump also gives how many there were).
const PEERS: usize = 8;
/// A slot's `seq` while its fields are being rewritten.
const WRITING: u64 = u64::MAX;
/// The `type` code of a group of several operations (no single type).
const GROUP_TYPE: u32 = u32::MAX;

/// One operation's entry, written without a lock by the one thread that runs the
/// communicator's call (the communicator's host or device guard, for the ring the entry is in,
/// makes it the only writer) and read by a dump,
/// from any thread, as a sequence lock: a reader keeps what it read only when `seq` was the
/// same operation's number before and after. Every field is
/// an atomic, so a read that overlaps a write is discarded, never undefined.
///
/// `seq` is 0 for a slot never written and [`WRITING`] while the fields change.
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    name: [AtomicU64; NAME_WORDS],
    name_len: AtomicU32,
    count: AtomicU64,
    dtype: AtomicU32,
    peers: [AtomicU32; PEERS],
    npeers: AtomicU32,
    start_ms: AtomicU64,
    /// Unix ms at the end, 0 while running (written by `finish`, outside the sequence window:
    /// a reader sees 0 or the time, both true of the entry it validated).
    end_ms: AtomicU64,
}

/// A validated copy of a [`Slot`].
struct Entry {
    seq: u64,
    op: String,
    count: u64,
    dtype: u32,
    peers: Vec<u32>,
    npeers: u32,
    start_ms: u64,
    end_ms: u64,
}

impl Slot {
    /// Writes operation `seq` (single writer).
    fn write(&self, seq: u64, op: &str, desc: &crate::mismatch::Desc, peers: &[usize], start_ms: u64) {
        self.seq.store(WRITING, Ordering::Relaxed);
        fence(Ordering::Release);
        let mut cut = op.len().min(NAME_BYTES);
        while !op.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut bytes = [0u8; NAME_BYTES];
        bytes[..cut].copy_from_slice(&op.as_bytes()[..cut]);
        for (w, b) in self.name.iter().zip(bytes.chunks_exact(8)) {
            w.store(u64::from_le_bytes(b.try_into().expect("8 bytes")), Ordering::Relaxed);
        }
        // The high bit marks a cut name.
        self.name_len.store(cut as u32 | (u32::from(cut < op.len()) << 31), Ordering::Relaxed);
        self.count.store(desc.count, Ordering::Relaxed);
        let dtype = if desc.tag == crate::mismatch::GROUP_TAG { GROUP_TYPE } else { u32::from(desc.dtype) };
        self.dtype.store(dtype, Ordering::Relaxed);
        for (w, &p) in self.peers.iter().zip(peers) {
            w.store(p as u32, Ordering::Relaxed);
        }
        self.npeers.store(peers.len().min(u32::MAX as usize) as u32, Ordering::Relaxed);
        self.start_ms.store(start_ms, Ordering::Relaxed);
        self.end_ms.store(0, Ordering::Relaxed);
        self.seq.store(seq, Ordering::Release);
    }

    /// A consistent copy, or `None` when the slot is empty or being rewritten.
    fn read(&self) -> Option<Entry> {
        for _ in 0..100 {
            let seq = self.seq.load(Ordering::Acquire);
            if seq == 0 {
                return None;
            }
            if seq == WRITING {
                std::thread::yield_now();
                continue;
            }
            let mut bytes = [0u8; NAME_BYTES];
            for (w, b) in self.name.iter().zip(bytes.chunks_exact_mut(8)) {
                b.copy_from_slice(&w.load(Ordering::Relaxed).to_le_bytes());
            }
            let len = self.name_len.load(Ordering::Relaxed);
            let npeers = self.npeers.load(Ordering::Relaxed);
            let peers = self.peers.iter().take(npeers as usize).map(|p| p.load(Ordering::Relaxed)).collect();
            let (count, dtype) = (self.count.load(Ordering::Relaxed), self.dtype.load(Ordering::Relaxed));
            let (start_ms, end_ms) = (self.start_ms.load(Ordering::Relaxed), self.end_ms.load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) != seq {
                continue;
            }
            let n = ((len & !(1 << 31)) as usize).min(NAME_BYTES);
            let mut op = String::from_utf8_lossy(&bytes[..n]).into_owned();
            if len >> 31 != 0 {
                op.push_str("...");
            }
            return Some(Entry { seq, op, count, dtype, peers, npeers, start_ms, end_ms });
        }
        None
    }
}

/// A communicator's flight recorder.
pub(crate) struct Recorder(Arc<Shared>);

/// The communicator's two rings: its host calls, and its device calls (whose host work, if
/// any, shows in the host ring when the device layer's proxy thread runs it). Each ring has
/// one writer at a time: the holder of the communicator's host guard, or of its device guard.
struct Shared {
    rank: usize,
    nranks: usize,
    tag: String,
    host: Ring,
    device: Ring,
}

/// One ring of operations (written without locks, see [`Slot`]) and the failures' messages
/// (rare: a lock).
struct Ring {
    /// The last sequence number handed out (written by the one thread running a call).
    next: AtomicU64,
    /// Entry of operation `seq` at index `(seq - 1) % RING` (overwritten once the ring is full).
    slots: Vec<Slot>,
    /// The last operation that completed without error.
    done_seq: AtomicU64,
    /// The failed operations among the last [`RING`]: sequence number and error.
    failed: Mutex<Vec<(u64, String)>>,
}

impl Ring {
    fn new() -> Ring {
        Ring {
            next: AtomicU64::new(0),
            slots: (0..RING).map(|_| Slot::default()).collect(),
            done_seq: AtomicU64::new(0),
            failed: Mutex::new(Vec::new()),
        }
    }

    /// See [`Recorder::start`].
    #[inline(always)]
    fn start(&self, op: &str, desc: &crate::mismatch::Desc, peers: &[usize]) -> u64 {
        let seq = self.next.load(Ordering::Relaxed) + 1;
        self.next.store(seq, Ordering::Relaxed);
        self.slot(seq).write(seq, op, desc, peers, coarse_ms());
        seq
    }

    /// The slot of operation `seq` (numbers start at 1).
    fn slot(&self, seq: u64) -> &Slot {
        &self.slots[(seq.wrapping_sub(1) % RING as u64) as usize]
    }

    /// Records the end of operation `seq`; whether it failed.
    #[inline(always)]
    fn finish(&self, seq: u64, r: &crate::error::Result<()>) -> bool {
        let slot = self.slot(seq);
        if slot.seq.load(Ordering::Relaxed) == seq {
            slot.end_ms.store(coarse_ms(), Ordering::Relaxed);
        }
        match r {
            Ok(()) => {
                self.done_seq.store(seq, Ordering::Release);
                false
            }
            Err(e) => {
                let mut f = lock(&self.failed);
                let oldest = seq.saturating_sub(RING as u64);
                f.retain(|&(s, _)| s > oldest);
                f.push((seq, e.message().to_string()));
                true
            }
        }
    }

    /// The ring's entries as JSON objects, oldest first, each on a line of its own.
    fn to_json(&self, s: &mut String) {
        let mut order: Vec<Entry> = self.slots.iter().filter_map(Slot::read).collect();
        order.sort_by_key(|e| e.seq);
        let done = self.done_seq.load(Ordering::Acquire);
        let failed = lock(&self.failed).clone();
        for (i, e) in order.into_iter().enumerate() {
            let error = failed.iter().find(|(s, _)| *s == e.seq).map(|(_, m)| m.as_str());
            // Calls run one at a time, in order: an operation after the last success that did
            // not fail is the one running (or the one that was running when the call stopped).
            let state = match error {
                Some(_) => "failed",
                None if e.seq <= done => "done",
                None => "running",
            };
            let dtype = match e.dtype {
                GROUP_TYPE => "-", // a group of several operations has no single type
                d => crate::types::DataType::from_raw(d as i32).map_or("?", |d| d.name()),
            };
            let peers: Vec<String> = e.peers.iter().map(|p| p.to_string()).collect();
            let more = if e.npeers as usize > e.peers.len() {
                format!(",\"peers_total\":{}", e.npeers)
            } else {
                String::new()
            };
            let _ = write!(
                s,
                "{}\n{{\"seq\":{},\"op\":{},\"count\":{},\"type\":{},\"peers\":[{}]{more},\"state\":\"{state}\",\"start_ms\":{},\"end_ms\":{},\"error\":{}}}",
                if i > 0 { "," } else { "" },
                e.seq,
                quote(&e.op),
                e.count,
                quote(dtype),
                peers.join(","),
                e.start_ms,
                if e.end_ms == 0 || state == "running" { "null".into() } else { e.end_ms.to_string() },
                error.map_or("null".into(), quote)
            );
        }
    }
}

use crate::sync::lock;

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

/// The dump directory (`OXCCL_DUMP` of the process's settings).
fn dump_dir() -> Option<&'static str> {
    crate::config::process().dump.as_deref()
}

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::Relaxed);
}

/// Installs the SIGUSR1 handler and its helper thread once, when `OXCCL_DUMP_SIGNAL=1`.
fn arm_signal() {
    static ARMED: OnceLock<()> = OnceLock::new();
    ARMED.get_or_init(|| {
        if !crate::config::process().dump_signal {
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
        let inner = Arc::new(Shared { rank, nranks, tag, host: Ring::new(), device: Ring::new() });
        let mut l = lock(live());
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(&inner));
        drop(l);
        arm_signal();
        Recorder(inner)
    }

    /// Records the start of a host operation; returns its sequence number. Called only by the
    /// thread that holds the communicator's call (one writer at a time); no lock, no
    /// read-modify-write: a small all-reduce is a few hundred nanoseconds, and a lock here
    /// cost a fifth of it.
    pub(crate) fn start(&self, op: &str, desc: &crate::mismatch::Desc, peers: &[usize]) -> u64 {
        self.0.host.start(op, desc, peers)
    }

    /// Records the end of host operation `seq`; a failure also writes a dump (when configured).
    pub(crate) fn finish(&self, seq: u64, r: &crate::error::Result<()>) {
        if self.0.host.finish(seq, r) {
            self.dump("failure");
        }
    }

    /// [`Recorder::start`] for a device call (its own ring and numbering; one writer at a
    /// time: the holder of the communicator's device guard).
    pub(crate) fn start_device(&self, op: &str, desc: &crate::mismatch::Desc, peers: &[usize]) -> u64 {
        self.0.device.start(op, desc, peers)
    }

    /// [`Recorder::finish`] for a device call: done once enqueued, or failed.
    pub(crate) fn finish_device(&self, seq: u64, r: &crate::error::Result<()>) {
        if self.0.device.finish(seq, r) {
            self.dump("failure");
        }
    }

    /// The rings as JSON: `ops` (host calls) and `device_ops` (device calls), each oldest first.
    pub(crate) fn to_json(&self, why: &str) -> String {
        let sh = &self.0;
        let mut s = String::new();
        let _ = write!(
            s,
            "{{\"rank\":{},\"nranks\":{},\"comm\":{},\"pid\":{},\"host\":{},\"why\":{},\"now_ms\":{},\"ops\":[",
            sh.rank,
            sh.nranks,
            quote(&sh.tag),
            std::process::id(),
            quote(&crate::bootstrap::hostname()),
            quote(why),
            now_ms()
        );
        sh.host.to_json(&mut s);
        s.push_str("\n],\"device_ops\":[");
        sh.device.to_json(&mut s);
        s.push_str("\n]}\n");
        s
    }

    /// Writes the ring to `OXCCL_DUMP` (when set); `why` says what triggered it.
    pub(crate) fn dump(&self, why: &str) {
        let Some(dir) = dump_dir() else { return };
        let (rank, tag) = (self.0.rank, &self.0.tag);
        let path = std::path::Path::new(dir).join(format!("oxccl-{tag}-rank{rank}.json"));
        match write_private(&path, self.to_json(why).as_bytes()) {
            Ok(()) => crate::warn!("rank {rank}: wrote its last operations to {} ({why})", path.display()),
            Err(e) => crate::warn!("rank {rank}: could not write {}: {e}", path.display()),
        }
    }
}

/// Writes `bytes` to `path` for this user only: the directory is made mode 0700 when missing,
/// the data goes to a new temporary file of an unpredictable name in it (created with
/// `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600, so a planted file or symlink is never written
/// through), which then replaces `path` (a symlink there is replaced, not followed).
pub fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let mut r = [0u8; 8];
    crate::net::random_bytes(&mut r).map_err(|e| std::io::Error::other(e.to_string()))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", r.iter().map(|b| format!("{b:02x}")).collect::<String>()));
    write_via(&tmp, path, bytes)
}

/// Writes `bytes` to the new file `tmp` (never an existing one, never through a symlink),
/// then renames it to `path`.
fn write_via(tmp: &std::path::Path, path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)?;
    let r = f.write_all(bytes).and_then(|()| f.sync_data()).and_then(|()| std::fs::rename(tmp, path));
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
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

    /// Symlinks planted at the old predictable temporary name, at a temporary name (as if
    /// guessed) and at the dump's own name are never written through; the dump is mode 0600
    /// in a new directory of mode 0700.
    #[test]
    fn dumps_are_private_and_never_follow_a_planted_symlink() {
        use std::os::unix::fs::{symlink, PermissionsExt};
        let base = std::env::temp_dir().join(format!("oxccl-flight-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let victim = base.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let dir = base.join("dumps");
        let path = dir.join("oxccl-t-rank0.json");
        write_private(&path, b"{}").unwrap();
        let mode = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&path), 0o600);
        std::fs::remove_file(&path).unwrap();
        symlink(&victim, dir.join("oxccl-t-rank0.json.tmp")).unwrap();
        symlink(&victim, &path).unwrap();
        write_private(&path, b"{\"dump\":1}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(&path).unwrap().file_type().is_file(), "the symlink was replaced");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"dump\":1}");
        assert_eq!(mode(&path), 0o600);
        // A temporary name someone guessed and planted is refused (O_EXCL, O_NOFOLLOW).
        let guessed = dir.join(".oxccl-t-rank0.json.0123456789abcdef.tmp");
        symlink(&victim, &guessed).unwrap();
        assert!(write_via(&guessed, &path, b"x").is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"dump\":1}");
        // No temporary file is left behind (the dump and the two planted links remain).
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 3, "{left:?}");
        let _ = std::fs::remove_dir_all(&base);
    }

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

    #[test]
    fn long_names_many_peers_and_failures_are_kept() {
        let r = Recorder::new(0, 20, "t".into());
        let d = crate::mismatch::Desc::group(3);
        let long = "group(".to_string() + &"all_reduce, ".repeat(10) + ")";
        let peers: Vec<usize> = (1..20).collect();
        let s = r.start(&long, &d, &peers);
        r.finish(s, &Err(crate::error::Error::timeout("stuck \"here\"")));
        let ok = r.start("broadcast", &d, &[1]);
        r.finish(ok, &Ok(()));
        let j = r.to_json("test");
        let cut = &long[..NAME_BYTES];
        assert!(j.contains(&format!("\"seq\":{s},\"op\":\"{cut}...\",")), "{j}");
        assert!(j.contains("\"peers\":[1,2,3,4,5,6,7,8],\"peers_total\":19,\"state\":\"failed\""), "{j}");
        assert!(j.contains("\"error\":\"stuck \\\"here\\\"\""), "{j}");
        assert!(
            j.contains(&format!(
                "\"seq\":{ok},\"op\":\"broadcast\",\"count\":0,\"type\":\"-\",\"peers\":[1],\"state\":\"done\""
            )),
            "{j}"
        );
        assert!(!j.contains("\"end_ms\":null"), "both ended: {j}");
    }

    #[test]
    fn device_calls_have_their_own_ring_beside_the_host_calls() {
        let r = Recorder::new(0, 2, "t".into());
        let d = crate::mismatch::Desc::single(
            crate::algo::Collective::AllReduce,
            2,
            crate::types::DataType::Float32,
            crate::types::ReduceOp::Sum,
        );
        let h = r.start("all_reduce", &d, &[1]);
        let a = r.start_device("all_reduce", &d, &[1]);
        r.finish_device(a, &Ok(()));
        let b = r.start_device("group(broadcast, send)", &crate::mismatch::Desc::group(2), &[1]);
        r.finish_device(b, &Err(crate::error::Error::internal("enqueue failed")));
        let c = r.start_device("broadcast", &d, &[1]);
        assert_eq!((h, a, b, c), (1, 1, 2, 3), "each ring numbers its own operations");
        let j = r.to_json("test");
        let (host, device) = j.split_once("\"device_ops\":[").expect("a device_ops array");
        assert!(
            host.contains(
                "\"seq\":1,\"op\":\"all_reduce\",\"count\":2,\"type\":\"float\",\"peers\":[1],\"state\":\"running\""
            ),
            "{j}"
        );
        assert_eq!(host.matches("\"seq\":").count(), 1, "{j}");
        assert!(
            device.contains(
                "\"seq\":1,\"op\":\"all_reduce\",\"count\":2,\"type\":\"float\",\"peers\":[1],\"state\":\"done\""
            ),
            "{j}"
        );
        assert!(device.contains("\"seq\":2,\"op\":\"group(broadcast, send)\",\"count\":0,\"type\":\"-\",\"peers\":[1],\"state\":\"failed\""), "{j}");
        assert!(device.contains("\"error\":\"enqueue failed\""), "{j}");
        assert!(device.contains("\"seq\":3,\"op\":\"broadcast\""), "{j}");
        assert!(device.contains("\"state\":\"running\""), "{j}");
        assert!(j.trim_end().ends_with("]}"), "{j}");
    }

    #[test]
    fn a_dump_during_calls_sees_whole_entries_only() {
        // One thread records operations whose every field follows from the sequence number;
        // another dumps meanwhile: each entry it shows must be one operation's, never a mix.
        let r = std::sync::Arc::new(Recorder::new(0, 64, "t".into()));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let w = {
            let (r, stop) = (r.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) || n < 10_000 {
                    n += 1;
                    let k = (n % 7) as usize;
                    let d = crate::mismatch::Desc::single(
                        crate::algo::Collective::AllReduce,
                        n as usize * 3,
                        crate::types::DataType::Float32,
                        crate::types::ReduceOp::Sum,
                    );
                    let peers: Vec<usize> = (0..k).map(|i| i + k).collect();
                    let s = r.start(&format!("op{}", "x".repeat(k)), &d, &peers);
                    assert_eq!(s, n);
                    r.finish(s, &Ok(()));
                }
            })
        };
        while r.0.host.next.load(Ordering::Relaxed) < RING as u64 {
            std::thread::yield_now();
        }
        let mut seen = 0;
        for _ in 0..300 {
            let j = r.to_json("test");
            for line in j.lines().filter(|l| l.contains("\"seq\":")) {
                let num = |key: &str| -> u64 {
                    let v = line.split(&format!("\"{key}\":")).nth(1).expect("field");
                    v.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
                };
                let n = num("seq");
                let k = (n % 7) as usize;
                assert_eq!(num("count"), n * 3, "{line}");
                assert!(line.contains(&format!("\"op\":\"op{}\"", "x".repeat(k))), "{line}");
                let peers: Vec<String> = (0..k).map(|i| (i + k).to_string()).collect();
                assert!(line.contains(&format!("\"peers\":[{}]", peers.join(","))), "{line}");
                seen += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        w.join().unwrap();
        assert!(seen >= 300, "every dump shows entries: {seen}");
    }
}
