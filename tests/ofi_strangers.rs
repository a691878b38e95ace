//! A stranger on the fabric: a process with no secret opens its own libfabric endpoint
//! (`oxccl::transport::ofi::Probe`), learns the ranks' endpoint addresses (public facts: for
//! `tcp;ofi_rxm` an IP address and port, here from `ofi::endpoints()`), and sends them tagged
//! messages while they run checked all-reduces over `OXCCL_NET=ofi` on loopback (shared memory
//! off): first guessed tags (every prefix it can guess with sequence numbers from 0, messages
//! full of 1000.0 and empty ones), then a flood of 20,000 8 KiB messages with random tags.
//! Every result must stay exact, no rank may fail, every stranger message must be drained
//! (counted), and each rank's RSS after the flood must be within 10% of its RSS before it.

mod common;

use oxccl::transport::ofi;
use oxccl::{Communicator, ReduceOp, UniqueId};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

/// One checked all-reduce of `n` doubles; `Err` names the first wrong element.
fn checked(comm: &Communicator, rank: usize, ranks: usize, n: usize, round: usize) -> Result<(), String> {
    let send: Vec<f64> = (0..n).map(|i| ((i * 7 + round) % 1001) as f64 + rank as f64).collect();
    let mut recv = vec![0f64; n];
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum).map_err(|e| format!("code={} {}", e.code(), e.message()))?;
    let extra = (ranks * (ranks - 1) / 2) as f64;
    for (i, &v) in recv.iter().enumerate() {
        let want = ((i * 7 + round) % 1001) as f64 * ranks as f64 + extra;
        if v != want {
            return Err(format!("wrong result at {i} in round {round}: {v} instead of {want}"));
        }
    }
    Ok(())
}

/// A rank: publishes its endpoint address, runs checked all-reduces (1 MiB and 8 KiB) until
/// the stranger is done, waits until its endpoint has drained what the stranger said it sent,
/// and reports RSS before and after.
#[test]
fn child_victim() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let dir = PathBuf::from(std::env::var("STRANGER_DIR").unwrap());
    let run = || -> Result<String, String> {
        let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).map_err(|e| e.message().to_string())?, rank)
            .map_err(|e| e.message().to_string())?;
        let mut round = 0;
        for _ in 0..3 {
            checked(&comm, rank, n, 1 << 17, round)?;
            checked(&comm, rank, n, 1 << 10, round)?;
            round += 1;
        }
        let eps = ofi::endpoints();
        let ep = eps.first().ok_or("no libfabric endpoint in this process")?;
        std::fs::write(dir.join(format!("addr.{rank}")), hex(&ep.address)).map_err(|e| e.to_string())?;
        // Phase 1: guessed tags while all-reducing; then wait until all were drained.
        let drained_after = |file: &str, round: &mut usize| -> Result<u64, String> {
            let f = dir.join(file);
            let t = Instant::now();
            loop {
                if t.elapsed() > Duration::from_secs(120) {
                    return Err(format!("no {file} from the stranger within 120 s"));
                }
                checked(&comm, rank, n, 1 << 17, *round)?;
                checked(&comm, rank, n, 1 << 10, *round)?;
                *round += 1;
                // Every rank stops after the same round: rank 0 decides, the others learn it.
                let seen = [if rank == 0 && f.exists() && *round >= 10 { 1.0f64 } else { 0.0 }];
                let mut stop = [0f64];
                comm.all_reduce(&seen, &mut stop, ReduceOp::Sum).map_err(|e| e.message().to_string())?;
                if stop[0] > 0.0 {
                    break;
                }
            }
            let sent: u64 = std::fs::read_to_string(&f).map_err(|e| e.to_string())?.trim().parse().unwrap_or(0);
            let t = Instant::now();
            while ofi::endpoints()[0].discarded < sent && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(sent)
        };
        let guessed = drained_after("guessed", &mut round)?;
        let guessed_drained = ofi::endpoints()[0].discarded;
        // Phase 2: the flood, measured from here.
        let before = common::rss_kb();
        std::fs::write(dir.join(format!("ready.{rank}")), "1").map_err(|e| e.to_string())?;
        let sent = drained_after("done", &mut round)?;
        let discarded = ofi::endpoints()[0].discarded;
        checked(&comm, rank, n, 1 << 17, round)?;
        let after = common::rss_kb();
        Ok(format!(
            "rounds {round} guessed {guessed_drained} of {guessed} discarded {discarded} of {sent} rss_before {before} rss_after {after}"
        ))
    };
    match run() {
        Ok(s) => eprintln!("RESULT ok {s}"),
        Err(e) => eprintln!("RESULT err {e}"),
    }
}

fn wait_file(p: &Path, children: &mut Vec<std::process::Child>) -> String {
    let t = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(p) {
            if !s.is_empty() {
                return s;
            }
        }
        if t.elapsed() > Duration::from_secs(60) {
            let outs = common::wait_all(std::mem::take(children), Duration::ZERO);
            panic!("no {} within 60 s:\n{outs:?}", p.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The messages of the guessing phase to one victim: every prefix it can guess (0..=64 and
/// 64 random ones) × sequence numbers 0..32, full of 1000.0 (1 KiB, and 1 MiB for sequence
/// 0); then 100 empty messages with tags 0..100.
fn guesses() -> Vec<(u64, Vec<u8>)> {
    let thousand: Vec<u8> = (0..128).flat_map(|_| 1000f64.to_ne_bytes()).collect();
    let big: Vec<u8> = (0..131_072).flat_map(|_| 1000f64.to_ne_bytes()).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut prefixes: Vec<u64> = (0..=64).collect();
    for _ in 0..64 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        prefixes.push((x >> 33) & 0x7fff_ffff);
    }
    let mut v = Vec::new();
    for p in prefixes {
        for seq in 0..32u64 {
            v.push(((p << 32) | seq, if seq == 0 { big.clone() } else { thousand.clone() }));
        }
    }
    v.extend((0..100u64).map(|t| (t, Vec::new())));
    v
}

#[test]
fn a_stranger_changes_no_result_fails_no_rank_and_its_flood_costs_no_memory() {
    if std::env::var(common::CHILD_ENV).is_ok() {
        return;
    }
    let mut probe = match ofi::Probe::open("tcp;ofi_rxm", "127.0.0.1") {
        Ok(p) => p,
        Err(e) => return common::skipped(&format!("no tcp;ofi_rxm endpoint on 127.0.0.1: {}", e.message())),
    };
    let dir = std::env::temp_dir().join(format!("oxccl-stranger-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let env = [
        ("OXCCL_NET", "ofi".to_string()),
        ("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm".into()),
        ("OXCCL_TRANSPORT", "tcp".into()),
        ("OXCCL_TIMEOUT_MS", "60000".into()),
        ("STRANGER_DIR", dir.display().to_string()),
    ];
    let mut children = common::spawn_ranks("child_victim", 2, &env);
    let addrs: Vec<Vec<u8>> =
        (0..2).map(|r| unhex(wait_file(&dir.join(format!("addr.{r}")), &mut children).trim())).collect();
    let t = Instant::now();
    let mut sent = 0u64;
    for a in &addrs {
        sent += probe.send_all(a, &mut guesses().into_iter()).expect("guesses") as u64;
    }
    let guessed = sent / 2;
    std::fs::write(dir.join("guessed"), guessed.to_string()).unwrap();
    for r in 0..2 {
        wait_file(&dir.join(format!("ready.{r}")), &mut children);
    }
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let chunk = vec![0x5au8; 8192];
    for a in &addrs {
        let mut flood = (0..20_000).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0x7fff_ffff_ffff_ffff, chunk.clone())
        });
        sent += probe.send_all(a, &mut flood).expect("flood") as u64;
    }
    eprintln!("stranger: {sent} messages to 2 ranks in {:.1?}", t.elapsed());
    std::fs::write(dir.join("done"), (sent / 2).to_string()).unwrap();
    let outs = common::wait_all(children, Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(&dir);
    for (r, (_, out)) in outs.iter().enumerate() {
        let line = out.lines().find(|l| l.starts_with("RESULT")).unwrap_or_else(|| panic!("rank {r}:\n{out}"));
        eprintln!("rank {r}: {line}");
        assert!(line.starts_with("RESULT ok"), "rank {r}:\n{out}");
        let field =
            |k: &str| -> u64 { line.split(k).nth(1).and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap() };
        assert_eq!(field("guessed "), guessed, "rank {r} drained every guessed message");
        assert_eq!(field("discarded "), sent / 2, "rank {r} drained every message");
        let (before, after) = (field("rss_before "), field("rss_after "));
        assert!(after * 10 <= before * 11, "rank {r}: RSS grew from {before} to {after} KiB under the flood");
    }
}
