//! The libfabric transport (`OXCCL_NET=ofi`) between stand-in hosts: network namespaces made
//! by `scripts/netns-hosts.sh`, each rank in its host's namespace with its own mount namespace
//! and a private `/dev/shm` (so nothing shared-memory crosses hosts), 2 hosts × 2 ranks. Ranks
//! on one host use shared memory, ranks on different hosts libfabric's `tcp;ofi_rxm` provider
//! (checked in the INFO lines, and libfabric's own log at `FI_LOG_LEVEL=info`). Every
//! collective and send/recv is checked against the f64 reference of tests/harness (also on
//! IPv6-only hosts); a rank killed with SIGKILL mid-collective makes every survivor fail within
//! 2 s, a stopped one makes them time out. Two ranks over loopback check the settings (forced,
//! auto, a bad provider) and mismatch detection over an ofi link.
//!
//! Without root, iproute2 or libfabric (`libfabric1` with its `tcp` provider) the tests print
//! `SKIPPED: ...` and pass.

#[path = "../src/bin/oxccl-perf/colls.rs"]
#[allow(dead_code)]
mod colls;
mod common;
#[path = "../src/bin/oxccl-perf/data.rs"]
#[allow(dead_code)]
mod data;
mod harness;

use common::netns::Hosts;
use oxccl::{Communicator, DataType, ReduceOp, UniqueId};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODE: &str = "OFI_CHILD";

/// A rank: joins by unique id and runs every collective (`cases`), or all-reduces in a loop
/// until the first error (`kill`: the victim kills itself 1 ms into its 6th call, or stops
/// itself before it under `OFI_FAULT=stop`).
#[test]
fn child_ofi() {
    let Ok(mode) = std::env::var(MODE) else { return };
    let rank: usize = std::env::var("OFI_RANK").unwrap().parse().unwrap();
    let n: usize = std::env::var("OFI_NRANKS").unwrap().parse().unwrap();
    let id = match std::env::var("OFI_ID_FILE") {
        Ok(path) => {
            let id = UniqueId::new().expect("unique id");
            std::fs::write(format!("{path}.tmp"), id.to_hex()).unwrap();
            std::fs::rename(format!("{path}.tmp"), &path).unwrap();
            id
        }
        Err(_) => UniqueId::from_hex(&std::env::var("OFI_UID").unwrap()).unwrap(),
    };
    let comm = Communicator::init_rank(n, &id, rank).expect("init_rank");
    if mode == "kill" {
        return kill_loop(&comm, rank, n);
    }
    let mut cases = harness::matrix(n, harness::Level::Thin, &[]);
    let mut seed = 20_000;
    // A large count per collective and algorithm: many messages per link, several chunks.
    for e in colls::COLLECTIVES.iter() {
        let count = if (e.counts)(n, n).param != n { 150_001 } else { 600_007 };
        for algo in harness::algorithms(e).into_iter().chain([None]) {
            seed += 1;
            let op = e.has_op.then_some(ReduceOp::Sum);
            let root = if e.has_root { n - 1 } else { 0 };
            let (dtype, chunk, in_place) = (DataType::Float32, None, false);
            cases.push(harness::Case { coll: e, dtype, op, count, root, in_place, algo, chunk, seed });
        }
    }
    harness::run_all_or_panic(&comm, &cases);
}

fn kill_loop(comm: &Communicator, rank: usize, n: usize) {
    const ELEMS: usize = 1 << 18;
    let victim: usize = std::env::var("OFI_VICTIM").unwrap().parse().unwrap();
    let send: Vec<f32> = (0..ELEMS).map(|i| (i % 7) as f32 + rank as f32).collect();
    let mut recv = vec![0f32; ELEMS];
    if let Ok(ms) = std::env::var("OFI_OP_TIMEOUT_MS") {
        // Links (and libfabric endpoints) are made under the long timeout, by a first call;
        // the fault then meets the short one.
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).expect("first all-reduce");
        comm.set_timeout(Duration::from_millis(ms.parse().unwrap()));
    }
    let mut last_ok = Instant::now();
    let start = Instant::now();
    for it in 0.. {
        if start.elapsed() > Duration::from_secs(60) {
            panic!("rank {rank}: all-reduces kept succeeding for 60 s after a rank was killed");
        }
        if rank == victim && it == 5 {
            if std::env::var("OFI_FAULT").as_deref() == Ok("stop") {
                // SAFETY: raise(3) with a valid signal number.
                unsafe { libc::raise(libc::SIGSTOP) };
            } else {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(1));
                    // SAFETY: kill(2) on our own pid; no memory is involved.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                });
            }
        }
        match comm.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            Ok(()) => {
                let want = |i: usize| (n * (i % 7) + n * (n - 1) / 2) as f32;
                assert!(recv.iter().enumerate().step_by(997).all(|(i, &v)| v == want(i)), "wrong all-reduce result");
                last_ok = Instant::now();
            }
            Err(e) => {
                eprintln!(
                    "RESULT kind={} ms={} call={it} msg={}",
                    e.code(),
                    last_ok.elapsed().as_millis(),
                    e.message()
                );
                return;
            }
        }
    }
}

/// Whether libfabric offers `tcp;ofi_rxm` here (`fi_info` of libfabric-bin is not needed:
/// the library answers through oxccl's own probe).
fn have_tcp_provider() -> bool {
    match oxccl::transport::ofi::providers(Some("tcp;ofi_rxm")) {
        Ok(p) if p.iter().any(|p| p == "tcp;ofi_rxm") => true,
        Ok(p) => {
            common::skipped(&format!("libfabric offers no tcp;ofi_rxm provider here (only {p:?})"));
            false
        }
        Err(why) => {
            common::skipped(&why);
            false
        }
    }
}

/// Starts rank `rank` on host `place[rank]`: in its network namespace, in a mount namespace of
/// its own (`ip netns exec` makes one) with a fresh tmpfs on /dev/shm.
fn spawn(h: &Hosts, rank: usize, place: &[usize], env: &[(&str, String)]) -> Child {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &h.ns(place[rank]), "sh", "-c"])
        .arg("mount -t tmpfs -o size=256m oxshm /dev/shm && exec \"$0\" \"$@\"")
        .arg(std::env::current_exe().unwrap())
        .args(["child_ofi", "--exact", "--nocapture", "--test-threads=1"])
        .env("OXCCL_SOCKET_IFNAME", "oxv0")
        .env("OXCCL_NET", "ofi")
        .env("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm")
        .env("FI_LOG_LEVEL", "info")
        .env("OXCCL_DEBUG", "INFO")
        .env_remove("OXCCL_HOSTID")
        .env_remove("OXCCL_TRANSPORT")
        .env_remove("FI_PROVIDER")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn a rank in its namespace")
}

/// Starts `n` ranks on `place` (rank 0 makes the unique id in its namespace).
fn start(h: &Hosts, tag: &str, place: &[usize], env: &[(&str, String)]) -> Vec<Child> {
    let n = place.len();
    let file = std::env::temp_dir().join(format!("oxccl-ofi-{}-{tag}.id", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let base = |r: usize| -> Vec<(&str, String)> {
        let mut e = vec![("OFI_RANK", r.to_string()), ("OFI_NRANKS", n.to_string())];
        e.extend(env.iter().cloned());
        e
    };
    let mut env0 = base(0);
    env0.push(("OFI_ID_FILE", file.display().to_string()));
    let mut children = vec![spawn(h, 0, place, &env0)];
    let hex = common::unique_id_from(&file, &mut children);
    for r in 1..n {
        let mut e = base(r);
        e.push(("OFI_UID", hex.clone()));
        children.push(spawn(h, r, place, &e));
    }
    children
}

/// 2 hosts × 2 ranks over `OXCCL_NET=ofi`: every collective correct; links between hosts
/// through libfabric, within a host through shared memory; libfabric logged its provider.
#[test]
fn two_hosts_two_ranks_each_over_ofi() {
    if std::env::var(MODE).is_ok() || !have_tcp_provider() {
        return;
    }
    let Some(h) = Hosts::up("ofi test", "oxf", "a", 221, 2, false) else { return };
    run_cases(&h, "a", &[]);
}

/// The same on IPv6-only hosts: the endpoints bind the bootstrap's IPv6 address; and with
/// `OXCCL_NSOCKS=2`, which libfabric links take no extra sockets from (a TCP-only setting).
#[test]
fn two_hosts_two_ranks_each_over_ofi_ipv6_only() {
    if std::env::var(MODE).is_ok() || !have_tcp_provider() {
        return;
    }
    let Some(h) = Hosts::up("ofi test", "oxf", "6", 223, 2, true) else { return };
    run_cases(&h, "6", &[("OXCCL_NSOCKS", "2".into())]);
}

fn run_cases(h: &Hosts, tag: &str, env: &[(&str, String)]) {
    let place = [0, 0, 1, 1];
    let t = Instant::now();
    let mut env = env.to_vec();
    env.push((MODE, "cases".into()));
    let outs = common::wait_all(start(h, tag, &place, &env), Duration::from_secs(240));
    common::assert_all_ok(&outs);
    for (r, (_, out)) in outs.iter().enumerate() {
        for p in (0..place.len()).filter(|&p| p != r) {
            let ofi = out.contains(&format!("rank {r}: rank {p} via OFI (tcp;ofi_rxm)"));
            let shm = out.contains(&format!("rank {r}: rank {p} via shared memory"));
            if place[r] == place[p] {
                assert!(shm && !ofi, "rank {r} -> {p} (same host) must use shared memory:\n{out}");
            } else {
                assert!(ofi && !shm, "rank {r} -> {p} (other host) must use OFI (tcp;ofi_rxm):\n{out}");
            }
        }
        assert!(!out.contains("could not bind"), "rank {r}: the endpoint must bind the bootstrap's address:\n{out}");
        assert!(
            out.contains("libfabric:") && out.contains("registering provider: tcp") && out.contains("::ofi_rxm:"),
            "rank {r}: libfabric's own log (FI_LOG_LEVEL=info) must show the provider at work:\n{out}"
        );
    }
    eprintln!("2 hosts x 2 ranks over ofi ({tag}): {:.2?}", t.elapsed());
}

/// kill -9 of a rank mid all-reduce (one victim per host): every survivor fails with
/// ncclRemoteError within 2 s of its last success, naming itself and a peer.
#[test]
fn sigkill_over_ofi_fails_every_survivor_within_2s() {
    if std::env::var(MODE).is_ok() || !have_tcp_provider() {
        return;
    }
    let Some(h) = Hosts::up("ofi test", "oxf", "k", 222, 2, false) else { return };
    for victim in [1, 2] {
        let env = [("OXCCL_TIMEOUT_MS", "20000".to_string())];
        for (r, line, field) in fault(&h, "kill", victim, &env) {
            assert_eq!(field("kind="), "6", "victim {victim}: rank {r} should see ncclRemoteError: {line}");
            let ms: u64 = field("ms=").parse().unwrap();
            assert!(ms < 2000, "victim {victim}: rank {r} took {ms} ms to fail: {line}");
            assert!(line.contains(&format!("rank {r}")) && line.contains("peer rank"), "{line}");
        }
    }
}

/// SIGSTOP of a rank (its progress thread stops too): survivors fail with ncclTimeout (or
/// ncclRemoteError from a neighbour that timed out) within the timeout + 1 s, and at least one
/// timeout names the silent rank, as over TCP.
#[test]
fn sigstop_over_ofi_times_out_survivors_within_timeout_plus_1s() {
    if std::env::var(MODE).is_ok() || !have_tcp_provider() {
        return;
    }
    let Some(h) = Hosts::up("ofi test", "oxf", "s", 224, 2, false) else { return };
    let (victim, timeout) = (2, 1500u64);
    let env = [("OFI_OP_TIMEOUT_MS", timeout.to_string()), ("OFI_FAULT", "stop".to_string())];
    let mut timeouts = 0;
    for (r, line, field) in fault(&h, "stop", victim, &env) {
        let (kind, ms): (u64, u64) = (field("kind=").parse().unwrap(), field("ms=").parse().unwrap());
        assert!(kind == 8 || kind == 6, "rank {r}: expected ncclTimeout or ncclRemoteError: {line}");
        assert!(ms < timeout + 1000, "rank {r} took {ms} ms to fail (timeout {timeout} ms): {line}");
        if kind == 8 {
            assert!(line.contains("OXCCL_TIMEOUT_MS"), "{line}");
            // A rank waiting on a neighbour that waits on the victim names the neighbour.
            timeouts += usize::from(line.contains(&format!("rank {victim} (")));
        }
    }
    assert!(timeouts >= 1, "no survivor's ncclTimeout named the stopped rank {victim}");
}

type Field = Box<dyn Fn(&str) -> String>;

/// Runs the fault loop on 2 hosts × 2 ranks with `victim`; returns each survivor's rank, its
/// `RESULT` line and a reader of the line's `key=` fields.
fn fault(h: &Hosts, tag: &str, victim: usize, env: &[(&str, String)]) -> Vec<(usize, String, Field)> {
    let place = [0, 0, 1, 1];
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.extend([(MODE, "kill".to_string()), ("OFI_VICTIM", victim.to_string())]);
    let mut children = start(h, &format!("{tag}{victim}"), &place, &env);
    let t = Instant::now();
    let mut done = [false; 4];
    done[victim] = true;
    while done.iter().any(|d| !d) && t.elapsed() < Duration::from_secs(60) {
        for (i, c) in children.iter_mut().enumerate() {
            if !done[i] && c.try_wait().ok().flatten().is_some() {
                done[i] = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in children.iter_mut() {
        let _ = c.kill();
    }
    let outs: Vec<String> = children
        .into_iter()
        .map(|c| c.wait_with_output().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default())
        .collect();
    let mut found = Vec::new();
    for (r, out) in outs.into_iter().enumerate().filter(|(r, _)| *r != victim) {
        let line = out
            .lines()
            .find(|l| l.starts_with("RESULT "))
            .unwrap_or_else(|| panic!("{tag}, victim {victim}: rank {r} reported no error:\n{out}"))
            .to_string();
        let l2 = line.clone();
        let field: Field =
            Box::new(move |k: &str| l2.split(k).nth(1).and_then(|s| s.split(' ').next()).unwrap_or("").to_string());
        found.push((r, line, field));
    }
    found
}

/// A rank of the loopback tests: init and one all-reduce (rank 1 one element short under
/// `OFI_MISMATCH`); prints `RESULT ok` or `RESULT err code=<ncclResult_t> <message>` and exits
/// successfully either way.
#[test]
fn child_ofi_loopback() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let run = || -> Result<(), oxccl::Error> {
        let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id)?, rank)?;
        let short = rank == 1 && std::env::var("OFI_MISMATCH").is_ok();
        let send = vec![rank as f64 + 1.0; if short { 99_999 } else { 100_000 }];
        let mut recv = vec![0f64; send.len()];
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        let want = (n * (n + 1) / 2) as f64;
        assert!(recv.iter().all(|&v| v == want), "wrong all-reduce result");
        Ok(())
    };
    match run() {
        Ok(()) => eprintln!("RESULT ok"),
        Err(e) => eprintln!("RESULT err code={} {}", e.code(), e.message()),
    }
}

fn loopback(env: &[(&str, &str)]) -> Vec<String> {
    let mut vars: Vec<(&str, String)> = vec![("OXCCL_TRANSPORT", "tcp".into()), ("OXCCL_DEBUG", "INFO".into())];
    vars.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
    let outs = common::run_ranks("child_ofi_loopback", 2, &vars, Duration::from_secs(60));
    common::assert_all_ok(&outs);
    outs.into_iter().map(|(_, o)| o).collect()
}

/// Two ranks of one host with shared memory off (`OXCCL_TRANSPORT=tcp`): `OXCCL_NET=ofi`
/// links them through libfabric; `auto` does not take a TCP provider (not a real fabric); a
/// provider that does not exist is an error naming the setting under `ofi`, and TCP under
/// `auto`.
#[test]
fn ofi_is_forced_auto_skips_tcp_providers_and_a_bad_provider_is_a_clear_error() {
    if std::env::var(common::CHILD_ENV).is_ok() || !have_tcp_provider() {
        return;
    }
    let tcp = [("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm")];
    for (r, out) in loopback(&[tcp[0], ("OXCCL_NET", "ofi")]).iter().enumerate() {
        assert!(out.contains("RESULT ok"), "{out}");
        assert!(out.contains(&format!("rank {r}: rank {} via OFI (tcp;ofi_rxm)", 1 - r)), "{out}");
    }
    for (r, out) in loopback(&[tcp[0], ("OXCCL_NET", "auto")]).iter().enumerate() {
        assert!(out.contains("RESULT ok"), "{out}");
        assert!(out.contains(&format!("rank {r}: rank {} via TCP", 1 - r)), "{out}");
    }
    for out in loopback(&[("OXCCL_OFI_PROVIDER", "no-such-provider"), ("NCCL_NET", "OFI")]) {
        assert!(
            out.contains("RESULT err")
                && out.contains("NCCL_NET=ofi, but the libfabric link to rank")
                && out.contains("fi_getinfo"),
            "{out}"
        );
    }
    for out in loopback(&[("OXCCL_OFI_PROVIDER", "no-such-provider"), ("OXCCL_NET", "auto")]) {
        assert!(out.contains("RESULT ok") && out.contains("via TCP"), "{out}");
    }
}

/// Mismatched calls over an ofi link fail on both ranks with ncclInvalidUsage naming the
/// counts, as over TCP (the signature exchange runs over the link's stream).
#[test]
fn mismatched_calls_over_ofi_fail_on_both_ranks() {
    if std::env::var(common::CHILD_ENV).is_ok() || !have_tcp_provider() {
        return;
    }
    let outs = loopback(&[("OXCCL_OFI_PROVIDER", "tcp;ofi_rxm"), ("OXCCL_NET", "ofi"), ("OFI_MISMATCH", "1")]);
    for (r, out) in outs.iter().enumerate() {
        assert!(out.contains(&format!("rank {r}: rank {} via OFI", 1 - r)), "{out}");
        assert!(out.contains("RESULT err code=5") && out.contains("99999") && out.contains("100000"), "{out}");
    }
}
