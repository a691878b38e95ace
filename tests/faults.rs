//! Fault injection with real processes: a rank killed with SIGKILL in the middle of an
//! all-reduce (every rank position, 2..5 ranks), a rank stopped with SIGSTOP, and strangers
//! on the rendezvous port. Ranks are copies of this test binary (see tests/common).

mod common;

use oxccl::{Communicator, ReduceOp, UniqueId};
use std::process::Child;
use std::time::{Duration, Instant};

const ELEMS: usize = 1 << 18;

/// One rank: all-reduces 1 MiB in a loop; the victim (`FAULT_VICTIM`) kills (`FAULT_MODE=kill`,
/// from a second thread, 1 ms into its 6th call) or stops (`stop`, before its 6th call) itself.
/// Survivors print `RESULT kind=<ncclResult_t> ms=<since last success> call=<index> msg=<text>` on their
/// first error and exit successfully.
#[test]
fn fault_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let mode = std::env::var("FAULT_MODE").unwrap_or_default();
    let victim: usize = std::env::var("FAULT_VICTIM").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
    let send: Vec<f32> = (0..ELEMS).map(|i| (i % 7) as f32 + rank as f32).collect();
    let mut recv = vec![0f32; ELEMS];
    let mut last_ok = Instant::now();
    // No fault: 10 calls. A fault in this rank or another: until the first error (at most 60 s).
    let (iters, cap) = if mode.is_empty() { (10, Duration::MAX) } else { (usize::MAX, Duration::from_secs(60)) };
    let start = Instant::now();
    for it in 0..iters {
        if start.elapsed() > cap {
            break;
        }
        if rank == victim && it == 5 {
            match mode.as_str() {
                "kill" => {
                    std::thread::spawn(|| {
                        std::thread::sleep(Duration::from_millis(1));
                        // SAFETY: kill(2) on our own pid; no memory is involved.
                        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                    });
                }
                // SAFETY: raise(3) with a valid signal number.
                "stop" => unsafe {
                    libc::raise(libc::SIGSTOP);
                },
                _ => {}
            }
        }
        match comm.all_reduce(&send, &mut recv, ReduceOp::Sum) {
            Ok(()) => {
                // Independent reference: the sum over ranks of (i % 7) + r.
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
    if !mode.is_empty() && rank != victim {
        panic!("rank {rank}: all-reduces kept succeeding for 60 s despite fault `{mode}`");
    }
}

/// A survivor's report: (ncclResult_t, ms from its last success to the error, message).
fn report(stderr: &str) -> Option<(i32, u128, String)> {
    let line = stderr.lines().find(|l| l.starts_with("RESULT "))?;
    let kind = line.split("kind=").nth(1)?.split(' ').next()?.parse().ok()?;
    let ms = line.split("ms=").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((kind, ms, line.split("msg=").nth(1)?.to_string()))
}

/// Waits for every child except `victim`, then kills the victim; returns each child's stderr.
fn wait_survivors(mut children: Vec<Child>, victim: usize, limit: Duration) -> Vec<String> {
    let start = Instant::now();
    let mut done = vec![false; children.len()];
    done[victim] = true;
    while done.iter().any(|d| !d) && start.elapsed() < limit {
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
    children
        .into_iter()
        .map(|c| c.wait_with_output().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default())
        .collect()
}

fn env(mode: &str, victim: usize, timeout_ms: u64, transport: &str) -> Vec<(&'static str, String)> {
    vec![
        ("FAULT_MODE", mode.to_string()),
        ("FAULT_VICTIM", victim.to_string()),
        ("OXCCL_TIMEOUT_MS", timeout_ms.to_string()),
        ("OXCCL_TRANSPORT", transport.to_string()),
    ]
}

/// kill -9 of every rank position of 2..=`max` ranks over `transport`: every survivor fails
/// with ncclRemoteError within 2 s of its last success, naming itself and a peer.
fn sigkill_each_position(transport: &str, max: usize, extra: &[(&'static str, String)]) {
    let mut worst = 0;
    for n in 2..=max {
        for victim in 0..n {
            // A 20 s timeout: survivors must learn of the death from the closed links, not from it.
            let mut vars = env("kill", victim, 20_000, transport);
            vars.extend_from_slice(extra);
            let outs = wait_survivors(common::spawn_ranks("fault_child", n, &vars), victim, Duration::from_secs(30));
            let at = format!("{transport}, n={n} victim={victim}");
            for (r, out) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
                let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("{at}: rank {r} reported no error:\n{out}"));
                assert_eq!(
                    kind, 6,
                    "{at}: rank {r} should see ncclRemoteError, got {kind}: {msg}\nevery rank's report: {outs:?}"
                );
                assert!(ms < 2000, "{at}: rank {r} took {ms} ms to fail: {msg}");
                worst = worst.max(ms);
                assert!(
                    msg.contains(&format!("rank {r}")) && msg.contains("peer rank"),
                    "{at}: message must name both ranks: {msg}"
                );
            }
        }
    }
    println!("{transport}: slowest survivor failed {worst} ms after its last success");
}

#[test]
fn sigkill_of_each_rank_position_fails_every_survivor_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    sigkill_each_position("tcp", 5, &[]);
}

#[test]
fn sigkill_over_shared_memory_fails_every_survivor_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    sigkill_each_position("shm", 4, &[]);
}

/// As above with single copy forced on (`OXCCL_CMA=1`): large sends are posted for the peer to
/// copy, so a survivor may be waiting for a dead peer's copy. It also covers a fresh
/// communicator's first call, whose first post may come before the peer's link end exists.
#[test]
fn sigkill_over_shared_memory_with_single_copy_fails_every_survivor_within_2s() {
    if common::child_role().is_some() {
        return;
    }
    sigkill_each_position("shm", 3, &[("OXCCL_CMA", "1".to_string())]);
}

/// SIGSTOP of rank 1 of 3 over `transport`: survivors fail with ncclTimeout (or
/// ncclRemoteError from a neighbour that timed out) within the timeout + 1 s, and at least one
/// names the silent rank.
fn sigstop_times_out(transport: &str) {
    let (n, victim, timeout) = (3, 1, 1500u128);
    let outs = wait_survivors(
        common::spawn_ranks("fault_child", n, &env("stop", victim, timeout as u64, transport)),
        victim,
        Duration::from_secs(20),
    );
    let mut timeouts = 0;
    for (r, out) in outs.iter().enumerate().filter(|(r, _)| *r != victim) {
        let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("{transport}: rank {r} reported no error:\n{out}"));
        assert!(
            kind == 8 || kind == 6,
            "{transport}: rank {r}: expected ncclTimeout (or ncclRemoteError from a timed-out neighbour), got {kind}: {msg}"
        );
        assert!(ms < timeout + 1000, "{transport}: rank {r} took {ms} ms to fail (timeout {timeout} ms): {msg}");
        if kind == 8 {
            timeouts += 1;
            assert!(
                ms >= timeout - 50,
                "{transport}: rank {r} timed out after {ms} ms, before the {timeout} ms timeout"
            );
            assert!(
                msg.contains("OXCCL_TIMEOUT_MS") && msg.contains(&format!("rank {victim} (")),
                "{transport}: timeout must name the silent peer: {msg}"
            );
        }
    }
    assert!(timeouts >= 1, "{transport}: no survivor reported ncclTimeout: {outs:?}");
}

#[test]
fn sigstop_of_a_rank_times_out_survivors_within_timeout_plus_1s() {
    if common::child_role().is_some() {
        return;
    }
    sigstop_times_out("tcp");
}

#[test]
fn sigstop_over_shared_memory_times_out_survivors_within_timeout_plus_1s() {
    if common::child_role().is_some() {
        return;
    }
    sigstop_times_out("shm");
}

/// Sends `bytes` to `addr` and keeps the connection open a moment.
fn stranger(addr: std::net::SocketAddr, bytes: Vec<u8>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            use std::io::Write;
            let _ = s.write_all(&bytes);
            std::thread::sleep(Duration::from_millis(300));
        }
    })
}

/// Garbage, an oversized frame length, and a hello proven with a wrong secret, sent to the
/// rendezvous port while ranks join: the root drops them and the communicator works.
#[test]
fn strangers_on_the_rendezvous_port_are_dropped() {
    if common::child_role().is_some() {
        return;
    }
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = UniqueId::new().expect("id");
    let (addr, secret) = id.decode().expect("decode");
    let mut wrong = secret;
    wrong[0] ^= 1;
    let mut noise = vec![0u8; 4096];
    oxccl::bootstrap::net::random_bytes(&mut noise).expect("random");
    let hello = {
        // A well-formed hello answering a nonce it never saw, with a wrong-secret proof.
        let w = oxccl::bootstrap::root::hello_message(&wrong, &[0; 16], &[1; 16], 2, 0, "127.0.0.1:1", "evil");
        let mut f = (w.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(&w);
        f
    };
    let threads =
        vec![stranger(addr, noise), stranger(addr, vec![0xff; 8]), stranger(addr, hello), stranger(addr, Vec::new())];
    let results = common::wait_all(common::spawn_ranks_with_id(&id, "fault_child", 2, &[]), Duration::from_secs(30));
    common::assert_all_ok(&results);
    for t in threads {
        t.join().expect("stranger thread");
    }
}

/// Garbage and a wrong-secret answer to the challenge on a rank's data listener are rejected;
/// the real peer is accepted afterwards on the same listener.
#[test]
fn strangers_on_a_data_port_are_rejected() {
    use oxccl::bootstrap::{self, auth, wire};
    if common::child_role().is_some() {
        return;
    }
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = UniqueId::new().expect("id");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (b0, b1) = std::thread::scope(|s| {
        let h0 = s.spawn(|| bootstrap::rendezvous(&id, 2, 0, deadline, false).expect("rank 0"));
        let h1 = s.spawn(|| bootstrap::rendezvous(&id, 2, 1, deadline, false).expect("rank 1"));
        (h0.join().unwrap(), h1.join().unwrap())
    });
    let addr = b1.listener.local_addr().expect("listener address");
    let garbage = stranger(addr, vec![0xab; 300]);
    let wrong_secret = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let nonce = wire::read_frame(&mut s, 64, Instant::now() + Duration::from_secs(5)).expect("challenge");
        let mine = [3u8; 16];
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&1u32.to_be_bytes());
        ctx[8..].copy_from_slice(&mine);
        let mut w = wire::Writer::default();
        w.bytes(&mine).bytes(&auth::prove(&[1; 16], b"oxccl-data-connect-2", &nonce, &ctx)).u32(0);
        wire::write_frame(&mut s, &w.0).expect("answer");
        std::thread::sleep(Duration::from_millis(300));
    });
    let mut rejected = Vec::new();
    let accepted = std::thread::scope(|s| {
        s.spawn(|| {
            // Strangers first: they are already queued on the listener when the real peer comes.
            std::thread::sleep(Duration::from_millis(200));
            bootstrap::connect_peer(&b0, 1, deadline).expect("rank 0 connects")
        });
        loop {
            let mut c = oxccl::transport::tcp::accept_until(&b1.listener, deadline, &|| false).expect("accept");
            match bootstrap::authenticate_incoming(&b1, &mut c, Instant::now() + Duration::from_secs(2)) {
                Ok(from) => break from,
                Err(e) => rejected.push(e.to_string()),
            }
        }
    });
    garbage.join().unwrap();
    wrong_secret.join().unwrap();
    assert_eq!(accepted, 0, "the real peer must be accepted");
    assert_eq!(rejected.len(), 2, "garbage and the wrong secret must both be rejected: {rejected:?}");
    assert!(rejected.iter().any(|e| e.contains("failed authentication")), "{rejected:?}");
}

/// Runs `ip args...`, returning whether it succeeded.
fn ip(args: &[&str]) -> bool {
    std::process::Command::new("ip").args(args).stderr(std::process::Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Deletes the test's network namespaces (and with them the veth pair) when dropped.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.0 {
            ip(&["netns", "del", n]);
        }
    }
}

/// Two ranks in two network namespaces joined by a veth pair; the link is cut (set down)
/// while they all-reduce: both sides fail with ncclTimeout within timeout + 1 s.
#[test]
fn cut_link_between_network_namespaces_times_out_both_sides() {
    if common::child_role().is_some() {
        return;
    }
    let tag = format!("oxe{}", std::process::id() % 100_000);
    let (na, nb, va, vb) = (format!("{tag}a"), format!("{tag}b"), format!("{tag}va"), format!("{tag}vb"));
    let guard = Netns(vec![na.clone(), nb.clone()]);
    let sub = 1 + std::process::id() % 250;
    let (ipa, ipb) = (format!("10.231.{sub}.1"), format!("10.231.{sub}.2"));
    let ok = ip(&["netns", "add", &na])
        && ip(&["netns", "add", &nb])
        && ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])
        && ip(&["link", "set", &va, "netns", &na])
        && ip(&["link", "set", &vb, "netns", &nb])
        && ip(&["-n", &na, "addr", "add", &format!("{ipa}/24"), "dev", &va])
        && ip(&["-n", &nb, "addr", "add", &format!("{ipb}/24"), "dev", &vb])
        && ip(&["-n", &na, "link", "set", &va, "up"])
        && ip(&["-n", &nb, "link", "set", &vb, "up"])
        && ip(&["-n", &na, "link", "set", "lo", "up"])
        && ip(&["-n", &nb, "link", "set", "lo", "up"]);
    if !ok {
        common::skipped("cut_link_between_network_namespaces_times_out_both_sides: cannot create network namespaces (needs root and iproute2)");
        return;
    }
    let comm_id = format!("{ipa}:{}", 29000 + sub);
    let id = UniqueId::for_address(&comm_id, [3; 16]).expect("id");
    let exe = std::env::current_exe().expect("exe");
    let timeout = 2000u128;
    let children: Vec<Child> = [(0, &na, &va), (1, &nb, &vb)]
        .iter()
        .map(|(r, ns, dev)| {
            std::process::Command::new("ip")
                .args(["netns", "exec", ns.as_str()])
                .arg(&exe)
                .args(["fault_child", "--exact", "--nocapture", "--test-threads=1"])
                .env(common::CHILD_ENV, "1")
                .env("OXCCL_RANK", r.to_string())
                .env("OXCCL_NRANKS", "2")
                .env("OXCCL_UNIQUE_ID", id.to_hex())
                .env("OXCCL_COMM_ID", &comm_id)
                .env("OXCCL_SOCKET_IFNAME", dev.as_str())
                .env("OXCCL_TIMEOUT_MS", timeout.to_string())
                // No OXCCL_TRANSPORT: the host identity includes the network namespace, so the
                // two ranks count as two hosts and talk over TCP through the veth pair.
                .env("FAULT_MODE", "loop")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn rank in namespace")
        })
        .collect();
    // Let both ranks get well into their all-reduce loop before the cut (slow under load).
    std::thread::sleep(Duration::from_millis(5000));
    assert!(ip(&["-n", &na, "link", "set", &va, "down"]), "cutting the link failed");
    let outs = common::wait_all(children, Duration::from_secs(40));
    drop(guard);
    for (r, (_, out)) in outs.iter().enumerate() {
        let (kind, ms, msg) = report(out).unwrap_or_else(|| panic!("rank {r} reported no error:\n{out}"));
        assert_eq!(kind, 8, "rank {r}: expected ncclTimeout: {msg}");
        assert!(ms < timeout + 1000, "rank {r} took {ms} ms: {msg}");
        assert!(msg.contains(&format!("rank {}", 1 - r)), "rank {r}: the message must name the silent peer: {msg}");
    }
}
