//! Hardening (issue [K]): no signal kills a C host, handles are never reused, group/destroy
//! ordering and concurrent use are refused, strangers cannot stall a job.

mod common;

use common::cprog::build_c;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs a C test program with extra environment variables; asserts it exits 0 (not by a
/// signal) within `limit`, and returns its stderr.
fn run_c_env(exe: &std::path::Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> String {
    let mut c = Command::new(exe);
    c.args(args)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .env("OXCCL_TIMEOUT_MS", "60000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let res = common::wait_all(vec![c.spawn().expect("run C test")], limit);
    common::assert_all_ok(&res);
    res.into_iter().next().map(|r| r.1).unwrap_or_default()
}

#[test]
fn c_host_with_default_sigpipe_survives_its_peers_death() {
    let exe = build_c("sigpipe");
    for transport in ["tcp", "shm"] {
        // Several rounds: the kill lands at a different point of the transfer each time.
        for (round, n) in ["2", "3", "2"].into_iter().enumerate() {
            let err = run_c_env(&exe, &[n], &[("OXCCL_TRANSPORT", transport)], Duration::from_secs(120));
            assert!(err.contains("with the dead rank failed after"), "{transport} round {round}: {err}");
        }
    }
}

/// Environment variable that makes this test binary a child of
/// [`library_socket_writes_never_raise_sigpipe`]: `control` or `library`.
const SIGPIPE_CHILD: &str = "OXCCL_TEST_SIGPIPE_CHILD";

/// A connected loopback socket whose peer reset the connection and whose pending error was
/// already read: every later write fails with EPIPE, which raises SIGPIPE unless the write
/// says MSG_NOSIGNAL.
fn broken_socket() -> std::net::TcpStream {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.write_all(b"unread").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    drop(b); // closed with unread bytes: the kernel answers with a reset
    std::thread::sleep(Duration::from_millis(50));
    let mut buf = [0u8; 8];
    let r = a.read(&mut buf);
    assert!(r.is_err(), "reading after the reset should fail (consuming the error), got {r:?}");
    a
}

/// The child's body: `control` makes a plain writev(2) on a broken socket (the process must
/// die of SIGPIPE, which shows the setup provokes it); `library` drives every socket-writing
/// path of the library into the same state (each must return an error).
fn sigpipe_child(mode: &str) -> ! {
    use oxccl::transport::Link;
    // SAFETY: restores the default action, as a C host has it; no handler is installed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let big = vec![5u8; 64 << 10];
    if mode == "control" {
        use std::os::fd::AsRawFd;
        let s = broken_socket();
        let iov = [libc::iovec { iov_base: big.as_ptr() as *mut libc::c_void, iov_len: big.len() }];
        // SAFETY: one valid iovec over `big`, which outlives the call.
        unsafe { libc::writev(s.as_raw_fd(), iov.as_ptr(), 1) };
        std::process::exit(3); // not reached when SIGPIPE kills the process
    }
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send_vectored(&[&big[..10], &big[..]]).is_err(), "vectored send (writev path)");
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send_vectored(&[&big[..10], &big[..100]]).is_err(), "small vectored send");
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send(&big).is_err(), "send");
    let abort = oxccl::control::frame::Frame::Abort { code: 6, reason: "frame".into() };
    let mut sealer = oxccl::control::seal::Sealer::new([0; 32]);
    assert!(oxccl::control::send_frame(&broken_socket(), &mut sealer, &abort).is_err(), "control frame");
    let mut s = broken_socket();
    assert!(oxccl::bootstrap::wire::write_frame(&mut s, &big).is_err(), "bootstrap frame");
    std::process::exit(0);
}

#[test]
fn library_socket_writes_never_raise_sigpipe() {
    if let Ok(mode) = std::env::var(SIGPIPE_CHILD) {
        sigpipe_child(&mode);
    }
    let exe = std::env::current_exe().unwrap();
    let run = |mode: &str| {
        Command::new(&exe)
            .args(["library_socket_writes_never_raise_sigpipe", "--exact", "--nocapture", "--test-threads=1"])
            .env(SIGPIPE_CHILD, mode)
            .output()
            .expect("run child")
    };
    use std::os::unix::process::ExitStatusExt;
    let control = run("control");
    assert_eq!(
        control.status.signal(),
        Some(libc::SIGPIPE),
        "the control writev did not die of SIGPIPE ({:?}): the test's setup is broken",
        control.status
    );
    let lib = run("library");
    assert!(
        lib.status.success(),
        "a library write raised a signal or failed: {:?}\n{}",
        lib.status,
        String::from_utf8_lossy(&lib.stderr)
    );
}

#[test]
fn c_handles_never_reused_destroy_in_group_and_two_threads_refused() {
    let exe = build_c("misuse");
    run_c_env(&exe, &["2"], &[], Duration::from_secs(120));
}

/// 20 silent connections on every listener of a 4-rank job (its data ports and its root)
/// while it initialises: init still completes within a few seconds (each stranger used to
/// hold up a rank's accept for up to 10 s, one after the other).
#[test]
fn a_flood_of_silent_connections_does_not_delay_init() {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let before: std::collections::HashSet<u16> = common::listening_ports(std::process::id()).into_iter().collect();
    let id = oxccl::UniqueId::new().expect("unique id");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = std::time::Instant::now();
    let (flooded, comms) = std::thread::scope(|s| {
        let flooder = s.spawn(|| {
            let mut flooded = std::collections::HashSet::new();
            let mut strangers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for port in common::listening_ports(std::process::id()) {
                    if before.contains(&port) || !flooded.insert(port) {
                        continue;
                    }
                    for _ in 0..20 {
                        if let Ok(c) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                            strangers.push(c); // connected, and never says a word
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            (flooded, strangers)
        });
        let ranks: Vec<_> = (0..4)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    if r == 3 {
                        // Ranks 0-2 wait at the root meanwhile: their data ports are flooded
                        // before anyone accepts on them.
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    let t = std::time::Instant::now();
                    let c = oxccl::Communicator::init_rank(4, id, r);
                    (c, t.elapsed())
                })
            })
            .collect();
        let comms: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (flooded, strangers) = flooder.join().unwrap();
        drop(strangers);
        (flooded, comms)
    });
    let took = start.elapsed();
    assert!(flooded.len() >= 4, "the flood reached only {} listeners (root and ranks 0-2 expected)", flooded.len());
    let mut ok = Vec::new();
    for (r, (c, t)) in comms.into_iter().enumerate() {
        let c = c.unwrap_or_else(|e| panic!("rank {r} failed to initialise under the flood: {e}"));
        eprintln!("rank {r}: init took {t:?}");
        ok.push(c);
    }
    // 0.5 s of the late rank plus the work; the old one-at-a-time accept needed 10 s or more.
    assert!(took < Duration::from_secs(5), "init under a flood took {took:?}");
    // The communicators work: an all-reduce over the 4 ranks.
    std::thread::scope(|s| {
        for c in &ok {
            s.spawn(move || {
                let send = vec![c.rank() as f64 + 1.0; 1000];
                let mut recv = vec![0.0; 1000];
                c.all_reduce(&send, &mut recv, oxccl::ReduceOp::Sum).unwrap();
                assert!(recv.iter().all(|&v| v == 10.0));
            });
        }
    });
}

/// Two ranks' bootstrap in this process (threads), over loopback.
fn two_bootstraps() -> (oxccl::bootstrap::Bootstrap, oxccl::bootstrap::Bootstrap) {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("id");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    std::thread::scope(|s| {
        let h0 = s.spawn(|| oxccl::bootstrap::rendezvous(&id, 2, 0, deadline, false).expect("rank 0"));
        let h1 = s.spawn(|| oxccl::bootstrap::rendezvous(&id, 2, 1, deadline, false).expect("rank 1"));
        (h0.join().unwrap(), h1.join().unwrap())
    })
}

/// A control channel is never taken for a data link: its proofs use other labels, so a wait
/// for rank 0's data link sets rank 0's control connection aside (and times out), and the
/// blocking data accept refuses it by name.
#[test]
fn a_control_connection_is_not_accepted_as_a_data_link() {
    use oxccl::bootstrap::{accept, authenticate_incoming, connect_peer_for, Purpose};
    let (b0, b1) = two_bootstraps();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    std::thread::scope(|s| {
        let c = s.spawn(|| connect_peer_for(&b0, 1, Purpose::Control, deadline).map(|_| ()));
        let (mut want, mut extra) = (vec![0], accept::Extra::new());
        let t = std::time::Instant::now() + Duration::from_millis(1500);
        let e = accept::accept_for(&b1, &mut Default::default(), Purpose::Data, &mut want, &mut extra, t, &|| false)
            .expect_err("no data link was opened");
        assert_eq!(e.kind(), oxccl::ErrorKind::Timeout, "{e}");
        assert!(extra.contains_key(&(Purpose::Control, 0)), "the control connection is kept for its own wait");
        c.join().unwrap().expect("the control handshake itself succeeds");
        let c = s.spawn(|| connect_peer_for(&b0, 1, Purpose::Control, deadline).map(|_| ()));
        b1.listener.set_nonblocking(false).unwrap();
        let (mut conn, _) = b1.listener.accept().unwrap();
        conn.set_nonblocking(false).unwrap();
        let e = authenticate_incoming(&b1, &mut conn, deadline).expect_err("a control connection is no data link");
        assert!(e.message().contains("Control connection where a data link was expected"), "{e}");
        assert!(c.join().unwrap().is_err(), "the connector gets no acknowledgement");
    });
}

/// A rank waiting for a peer that never connects, with a silent stranger on its port, times out
/// at its deadline (not the stranger's) and blames the missing rank.
#[test]
fn accept_timeout_names_the_missing_rank() {
    let (_b0, b1) = two_bootstraps();
    let _stranger = std::net::TcpStream::connect(b1.listener.local_addr().unwrap()).unwrap();
    let t = std::time::Instant::now();
    let mut want = vec![0];
    let e = oxccl::bootstrap::accept::accept_ranks(
        &b1,
        &mut Default::default(),
        &mut want,
        &mut Default::default(),
        t + Duration::from_millis(400),
        &|| false,
    )
    .expect_err("nobody connects");
    let took = t.elapsed();
    assert_eq!(e.kind(), oxccl::ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("rank 1: ranks [0] did not connect"), "{e}");
    assert!(took < Duration::from_secs(2), "the deadline was 0.4 s, the wait {took:?}");
}

/// A listener that answers the challenge without the secret is refused by the connecting rank
/// before it sends any data (mutual authentication of data connections).
#[test]
fn a_data_listener_that_cannot_prove_the_secret_is_refused() {
    use oxccl::bootstrap::wire;
    let (mut b0, _b1) = two_bootstraps();
    let rogue = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    b0.peers[1].addr = rogue.local_addr().unwrap(); // rank 0 is pointed at an impostor
    let imp = std::thread::spawn(move || {
        let (mut s, _) = rogue.accept().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        wire::write_frame(&mut s, &[9u8; 16]).unwrap();
        let answer = wire::read_frame(&mut s, 256, deadline).unwrap();
        wire::write_frame(&mut s, &[0u8; 32]).unwrap(); // a proof it cannot compute
        answer.len()
    });
    let e = oxccl::bootstrap::connect_peer(&b0, 1, std::time::Instant::now() + Duration::from_secs(10))
        .expect_err("the impostor must be refused");
    assert!(e.message().contains("could not prove"), "{e}");
    assert_eq!(imp.join().unwrap(), 16 + 32 + 4, "the connector's answer: nonce, proof, rank");
}

/// Runs `n` ranks' rendezvous on `id` as threads; `claims[i]` is (nranks, rank) of thread `i`.
/// Returns each thread's outcome and how long it took.
fn rendezvous_all(
    id: &oxccl::UniqueId,
    claims: &[(usize, usize)],
) -> Vec<(oxccl::Result<oxccl::bootstrap::Bootstrap>, Duration)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        let hs: Vec<_> = claims
            .iter()
            .map(|&(n, r)| {
                s.spawn(move || {
                    let t = std::time::Instant::now();
                    (oxccl::bootstrap::rendezvous(id, n, r, deadline, false), t.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Asserts every outcome failed within 2 s with a message containing `reason`.
fn all_fail_fast(out: &[(oxccl::Result<oxccl::bootstrap::Bootstrap>, Duration)], reason: &str) {
    for (i, (r, took)) in out.iter().enumerate() {
        let e = r.as_ref().err().unwrap_or_else(|| panic!("thread {i} joined a rendezvous that cannot succeed"));
        assert!(e.message().contains(reason), "thread {i}: {e}");
        assert!(*took < Duration::from_secs(2), "thread {i} took {took:?} to fail: {e}");
        eprintln!("thread {i}: failed after {took:?}: {e}");
    }
}

/// nranks disagreement and a duplicate rank: the root tells every rank why, at once (the
/// timeout is 60 s).
#[test]
fn init_refusals_reach_every_rank_within_2s() {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().unwrap();
    // Ranks 0 and 1 of 3 arrive first; then a rank that says nranks=4.
    let late = std::thread::spawn({
        move || {
            std::thread::sleep(Duration::from_millis(300));
            rendezvous_all(&id, &[(4, 2)])
        }
    });
    let mut out = rendezvous_all(&id, &[(3, 0), (3, 1)]);
    out.extend(late.join().unwrap());
    all_fail_fast(&out, "says nranks=4");

    let id = oxccl::UniqueId::new().unwrap();
    let late = std::thread::spawn({
        move || {
            std::thread::sleep(Duration::from_millis(300));
            rendezvous_all(&id, &[(3, 1)])
        }
    });
    let mut out = rendezvous_all(&id, &[(3, 0), (3, 1)]);
    out.extend(late.join().unwrap());
    all_fail_fast(&out, "rank 1 joined twice");
}

/// A rank that said hello and then died (its connection closed) fails everyone's init within
/// 2 s, naming it: rank 0 is waiting when it leaves, rank 1 arrives afterwards.
#[test]
fn a_rank_leaving_before_all_joined_fails_every_rank_within_2s() {
    use oxccl::bootstrap::{root, wire};
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().unwrap();
    let (addr, secret) = id.decode().unwrap();
    let quitter = std::thread::spawn(move || {
        // Rank 2 of 3 says a proper hello, then its process "dies" (the socket closes).
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let nonce = wire::read_frame(&mut s, 64, deadline).unwrap();
        let hello = root::hello_message(&secret, &nonce, &[4u8; 16], 3, 2, "127.0.0.1:9", "quitter");
        wire::write_frame(&mut s, &hello).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(800));
        rendezvous_all(&id, &[(3, 1)])
    });
    let mut out = rendezvous_all(&id, &[(3, 0)]);
    quitter.join().unwrap();
    out.extend(late.join().unwrap());
    all_fail_fast(&out, "rank 2 (127.0.0.1:9) left before all 3 ranks joined");
}

/// An id made by ncclGetUniqueId names a root that was listening already: when that port
/// refuses connections the root is gone, and init fails within about a second, not at the
/// deadline (60 s here).
#[test]
fn a_gone_root_fails_init_at_once() {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().unwrap();
    assert!(id.root_listening());
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut bytes = id.bytes;
    bytes[6..8].copy_from_slice(&closed.to_be_bytes()); // nothing listens there any more
    let gone = oxccl::UniqueId { bytes };
    let out = rendezvous_all(&gone, &[(2, 1)]);
    let (r, took) = &out[0];
    let e = r.as_ref().err().expect("no root there");
    assert!(e.message().contains("refused the connection"), "{e}");
    assert!(*took < Duration::from_secs(5), "took {took:?}");
    eprintln!("gone root: failed after {took:?}: {e}");
}

/// A process holding the rendezvous port without the secret cannot prove it: the rank refuses
/// its table (naming the address) however well-formed, so it cannot redirect the rank's peers.
#[test]
fn a_rank_refuses_a_root_that_cannot_prove_the_secret() {
    use oxccl::bootstrap::wire;
    let rogue = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = rogue.local_addr().unwrap();
    let imp = std::thread::spawn(move || {
        let (mut s, _) = rogue.accept().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        wire::write_frame(&mut s, &[1u8; 16]).unwrap();
        let hello = wire::read_frame(&mut s, 1 << 16, deadline).unwrap();
        // A well-formed table of 2 ranks pointing at the impostor, behind a MAC it cannot make.
        let mut w = wire::Writer::default();
        w.bytes(&[0u8; 32]).bytes(&[0]).u32(2).str("127.0.0.1:9").str("h").str("127.0.0.1:9").str("h");
        wire::write_frame(&mut s, &w.0).unwrap();
        hello.len()
    });
    let id = oxccl::UniqueId::for_address(&addr.to_string(), [7u8; 16]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let e = oxccl::bootstrap::rendezvous(&id, 2, 1, deadline, false).err().expect("an impostor root is refused");
    assert!(e.message().contains("could not prove") && e.message().contains(&addr.to_string()), "{e}");
    assert!(e.message().contains("failed authentication"), "{e}");
    assert!(imp.join().unwrap() > 32, "the rank proves itself first, with its hello");
}

/// One rank of [`dump_merge_names_a_stopped_rank`]: five all-reduces, then rank 2 stops itself
/// (SIGSTOP) and the others run a sixth, which times out and writes their dumps.
#[test]
fn dump_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    if std::env::var("DUMP_CASE").is_err() {
        return;
    }
    let comm = oxccl::Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).unwrap();
    let send = vec![1.0f32; 256];
    let mut recv = vec![0.0f32; 256];
    for _ in 0..5 {
        comm.all_reduce(&send, &mut recv, oxccl::ReduceOp::Sum).unwrap();
    }
    if rank == 2 {
        // SAFETY: stops this process until the test sends SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
        // The test sent SIGUSR1 before SIGCONT: the dump thread writes within 100 ms.
        std::thread::sleep(Duration::from_millis(1000));
        return;
    }
    let e = comm.all_reduce(&send, &mut recv, oxccl::ReduceOp::Sum).expect_err("rank 2 is stopped");
    assert_eq!(e.kind(), oxccl::ErrorKind::Timeout, "{e}");
}

/// Rank 2 of 3 stops (SIGSTOP) after 5 all-reduces; ranks 0-1 time out in the 6th and dump;
/// rank 2 dumps on SIGUSR1 (OXCCL_DUMP_SIGNAL=1). `oxccl-dump merge` blames rank 2.
#[test]
fn dump_merge_names_a_stopped_rank() {
    if common::child_role().is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("oxccl-dump-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let env = [
        ("DUMP_CASE", "1".to_string()),
        ("OXCCL_DUMP", dir.display().to_string()),
        ("OXCCL_DUMP_SIGNAL", "1".to_string()),
        ("OXCCL_TIMEOUT_MS", "1500".to_string()),
    ];
    let mut children = common::spawn_ranks("dump_child", 3, &env);
    let start = std::time::Instant::now();
    // Ranks 0 and 1 finish (timed out) while rank 2 is stopped.
    while children[..2].iter_mut().any(|c| c.try_wait().ok().flatten().is_none()) {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks 0-1 did not time out");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = children[2].id() as libc::pid_t;
    // SAFETY: signals to our own child process.
    unsafe {
        libc::kill(pid, libc::SIGUSR1);
        libc::kill(pid, libc::SIGCONT);
    }
    let res = common::wait_all(children, Duration::from_secs(30));
    common::assert_all_ok(&res);
    let files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path().display().to_string())
        .filter(|p| p.ends_with(".json"))
        .collect();
    assert_eq!(files.len(), 3, "one dump per rank: {files:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl-dump")).arg("merge").args(&files).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("ranks 0-1 wait in all_reduce #6 for rank 2, whose last op is #5 (done)"),
        "unexpected verdict:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
