//! Multi-host correctness over network namespaces: `scripts/netns-hosts.sh` makes stand-in
//! hosts (one network namespace each, veth pairs to a bridge), ranks are copies of this test
//! binary started with `ip netns exec`, two per host, and every collective (all algorithms, in
//! and out of place, roots, counts from 0 to a few MB) is checked against the f64 reference of
//! tests/harness. Both the unique-id init (rank 0 calls `UniqueId::new` inside its namespace
//! and the id is handed to the others) and the launcher environment (torchrun's `MASTER_ADDR`
//! = rank 0's namespace address) are covered. Ranks on one host must use shared memory and
//! ranks on different hosts TCP, which the test checks in their INFO logs.
//!
//! Without root or iproute2 the tests print `SKIPPED: ...` (visible in the run's output) and pass.

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

/// Variable naming the init path of a rank process (`uid` or `env`).
const MODE: &str = "MH_CHILD";

/// The cases every layout runs: the thin matrix (every collective, algorithm, root and
/// placement at small counts) plus a large count per collective and algorithm, big enough to
/// cross several pipeline chunks and socket stripes.
fn cases(n: usize) -> Vec<harness::Case> {
    let mut cases = harness::matrix(n, harness::Level::Thin, &[]);
    let mut seed = 10_000;
    for e in colls::COLLECTIVES.iter() {
        let count = if (e.counts)(n, n).param != n { 60_013 } else { 300_007 };
        let algos: Vec<_> = harness::algorithms(e);
        for algo in algos.into_iter().chain([None]) {
            for in_place in [false, true] {
                seed += 1;
                let op = e.has_op.then_some(ReduceOp::Sum);
                let root = if e.has_root { n - 1 } else { 0 };
                let (dtype, chunk) = (DataType::Float32, None);
                cases.push(harness::Case { coll: e, dtype, op, count, root, in_place, algo, chunk, seed });
            }
        }
    }
    cases
}

/// A rank: joins by unique id or from the launcher environment, checks the host table and the
/// ring order, runs the cases.
#[test]
fn child_multihost() {
    let Ok(mode) = std::env::var(MODE) else { return };
    let comm = if mode == "env" {
        Communicator::from_env().expect("init from the launcher environment")
    } else {
        let rank: usize = std::env::var("MH_RANK").unwrap().parse().unwrap();
        let n: usize = std::env::var("MH_NRANKS").unwrap().parse().unwrap();
        let id = match std::env::var("MH_ID_FILE") {
            Ok(path) => {
                // ncclGetUniqueId inside this namespace; the test hands the id to the others.
                let id = UniqueId::new().expect("unique id");
                std::fs::write(format!("{path}.tmp"), id.to_hex()).unwrap();
                std::fs::rename(format!("{path}.tmp"), &path).unwrap();
                id
            }
            Err(_) => UniqueId::from_hex(&std::env::var("MH_UID").unwrap()).unwrap(),
        };
        Communicator::init_rank(n, &id, rank).expect("init_rank")
    };
    let place: Vec<usize> = std::env::var("MH_PLACE").unwrap().split(',').map(|h| h.parse().unwrap()).collect();
    let (rank, n) = (comm.rank(), comm.size());
    for p in 0..n {
        let same = comm.hosts()[p] == comm.hosts()[rank];
        assert_eq!(same, place[p] == place[rank], "rank {rank}: host table {:?}", comm.hosts());
    }
    // The ring visits each host's ranks together: one inter-host hop per host.
    let order = comm.ring_order();
    let hosts = place.iter().max().unwrap() + 1;
    let hops = (0..n).filter(|&i| place[order[i]] != place[order[(i + 1) % n]]).count();
    assert_eq!(hops, if hosts > 1 { hosts } else { 0 }, "ring order {order:?} for placement {place:?}");
    let cases = cases(n);
    harness::run_all_or_panic(&comm, &cases);
}

/// Starts rank `rank` in the namespace of host `place[rank]` with `env`.
fn spawn(h: &Hosts, rank: usize, place: &[usize], env: &[(&str, String)]) -> Child {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &h.ns(place[rank])])
        .arg(std::env::current_exe().unwrap())
        .args(["child_multihost", "--exact", "--nocapture", "--test-threads=1"])
        .env("MH_PLACE", place.iter().map(|h| h.to_string()).collect::<Vec<_>>().join(","))
        .env("OXCCL_SOCKET_IFNAME", "oxv0")
        .env("OXCCL_TIMEOUT_MS", "30000")
        .env("OXCCL_DEBUG", "INFO")
        .env_remove("OXCCL_HOSTID")
        .env_remove("OXCCL_TRANSPORT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawn a rank in its namespace")
}

/// Checks that every rank talked to same-host peers over shared memory and to the others over
/// TCP (from the INFO lines of transport selection).
fn check_transports(outs: &[(bool, String)], place: &[usize], socks: usize, threads: usize) {
    let driver =
        if threads == 0 { "driven by the engine thread".to_string() } else { format!("{threads} helper thread(s)") };
    for (r, (_, out)) in outs.iter().enumerate() {
        for p in (0..outs.len()).filter(|&p| p != r) {
            let shm = out.contains(&format!("rank {r}: rank {p} via shared memory"));
            let tcp = out.contains(&format!("rank {r}: rank {p} via TCP, {socks} socket(s), {driver}"));
            if place[r] == place[p] {
                assert!(shm && !tcp, "rank {r} -> {p} (same host) must use shared memory:\n{out}");
            } else {
                assert!(
                    tcp && !shm,
                    "rank {r} -> {p} (other host) must use TCP with {socks} socket(s), {driver}:\n{out}"
                );
            }
        }
    }
}

/// `hosts` namespaces × `per_host` ranks, unique-id init then launcher-environment init.
/// `interleaved`: rank `r` on host `r mod hosts` (the ring must reorder them), else on host
/// `r / per_host`.
/// `v6`: the hosts have IPv6 addresses only, so the rendezvous and every TCP link must use IPv6
/// (checked in the INFO logs).
fn run_layout(
    tag: &str,
    subnet: u8,
    hosts: usize,
    per_host: usize,
    interleaved: bool,
    v6: bool,
    extra: &[(&str, String)],
) {
    let Some(h) = Hosts::up("multi-host test", "oxm", tag, subnet, hosts, v6) else { return };
    let n = hosts * per_host;
    let place: Vec<usize> = (0..n).map(|r| if interleaved { r % hosts } else { r / per_host }).collect();
    let socks = extra.iter().find(|(k, _)| *k == "OXCCL_NSOCKS").map_or(1, |(_, v)| v.parse().unwrap());
    let threads = extra.iter().find(|(k, _)| *k == "OXCCL_NTHREADS").map_or(0, |(_, v)| v.parse().unwrap());
    let limit = Duration::from_secs(120);

    // 1. Unique id: rank 0 makes it in its namespace; the others get it once it exists.
    let t = Instant::now();
    let file = std::env::temp_dir().join(format!("oxccl-mh-{}-{tag}.id", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let base = |r: usize| -> Vec<(&str, String)> {
        let mut e = vec![(MODE, "uid".to_string()), ("MH_RANK", r.to_string()), ("MH_NRANKS", n.to_string())];
        e.extend(extra.iter().cloned());
        e
    };
    let mut env0 = base(0);
    env0.push(("MH_ID_FILE", file.display().to_string()));
    let mut children = vec![spawn(&h, 0, &place, &env0)];
    let hex = common::unique_id_from(&file, &mut children);
    for r in 1..n {
        let mut e = base(r);
        e.push(("MH_UID", hex.clone()));
        children.push(spawn(&h, r, &place, &e));
    }
    let outs = common::wait_all(children, limit);
    common::assert_all_ok(&outs);
    check_transports(&outs, &place, socks, threads);
    if v6 {
        // ncclGetUniqueId picked the namespace's only routable (IPv6) address, and every rank's
        // data listener (where its TCP links meet) is on IPv6 too.
        let root: std::net::Ipv6Addr = h.addr(0).parse().unwrap();
        let want = format!("bootstrap root listening on [{root}]");
        assert!(outs[0].1.contains(&want), "rank 0 must host the rendezvous on IPv6 ({want}):\n{}", outs[0].1);
        for (r, (_, out)) in outs.iter().enumerate() {
            let want = format!("data listener [{}]:", h.addr(place[r]).parse::<std::net::Ipv6Addr>().unwrap());
            assert!(out.contains(&want), "rank {r} must listen for data on IPv6 ({want}):\n{out}");
        }
    }
    eprintln!("{hosts} hosts x {per_host} ranks, unique id: {:.2?}", t.elapsed());

    // 2. torchrun's environment: MASTER_ADDR is rank 0's address in its namespace.
    let t = Instant::now();
    let port = 20_000 + std::process::id() % 20_000;
    let children: Vec<Child> = (0..n)
        .map(|r| {
            let mut e = vec![
                (MODE, "env".to_string()),
                ("RANK", r.to_string()),
                ("WORLD_SIZE", n.to_string()),
                ("LOCAL_RANK", place[..r].iter().filter(|&&x| x == place[r]).count().to_string()),
                ("MASTER_ADDR", h.addr(0)),
                ("MASTER_PORT", port.to_string()),
            ];
            e.extend(extra.iter().cloned());
            spawn(&h, r, &place, &e)
        })
        .collect();
    let outs = common::wait_all(children, limit);
    common::assert_all_ok(&outs);
    check_transports(&outs, &place, socks, threads);
    eprintln!("{hosts} hosts x {per_host} ranks, MASTER_ADDR: {:.2?}", t.elapsed());
}

#[test]
fn three_hosts_two_ranks_each_interleaved() {
    if std::env::var(MODE).is_ok() {
        return;
    }
    run_layout("a", 214, 3, 2, true, false, &[]);
}

#[test]
fn two_hosts_two_ranks_each() {
    if std::env::var(MODE).is_ok() {
        return;
    }
    run_layout("b", 215, 2, 2, false, false, &[]);
}

/// The same with four sockets per TCP peer and the smallest stripe, so that the large cases
/// rotate over every socket many times.
#[test]
fn two_hosts_two_ranks_each_four_sockets() {
    if std::env::var(MODE).is_ok() {
        return;
    }
    run_layout("c", 216, 2, 2, false, false, &[("OXCCL_NSOCKS", "4".into()), ("OXCCL_SOCKET_STRIPE", "65536".into())]);
}

/// The same with helper threads driving the sockets (`OXCCL_NTHREADS`): 4 sockets over 2
/// helpers per peer.
#[test]
fn two_hosts_two_ranks_each_four_sockets_two_helper_threads() {
    if std::env::var(MODE).is_ok() {
        return;
    }
    run_layout(
        "d",
        217,
        2,
        2,
        false,
        false,
        &[("OXCCL_NSOCKS", "4".into()), ("OXCCL_NTHREADS", "2".into()), ("OXCCL_SOCKET_STRIPE", "65536".into())],
    );
}

/// IPv6-only hosts: unique-id and `MASTER_ADDR` (an unbracketed IPv6 address, as torchrun
/// passes it) rendezvous, and TCP links between hosts, all over IPv6.
#[test]
fn two_hosts_two_ranks_each_ipv6_only() {
    if std::env::var(MODE).is_ok() {
        return;
    }
    run_layout("e", 218, 2, 2, false, true, &[]);
}
