//! What network strangers cost and learn: silent connections flooding the bootstrap root and a
//! rank's data listener (under a low descriptor limit), a stranger probing the root for a
//! proof, and a relay tampering with the rendezvous. Ranks are copies of this test binary
//! (see tests/common); the tests of this file run one at a time, since one of them counts
//! this process's threads and descriptors.

mod common;

use std::io::{BufRead, Read};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn count_dir(d: &str) -> usize {
    std::fs::read_dir(d).map(|d| d.count()).unwrap_or(0)
}

/// A rank: optionally under a descriptor limit of 64 (`LOW_FD_RANK`) or late (`LATE_RANK`,
/// 1.5 s); initialises, all-reduces and checks the sum against the one computed here.
#[test]
fn rank_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    if std::env::var("STRANGERS_CASE").is_err() {
        return;
    }
    let is = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok()) == Some(rank);
    if is("LOW_FD_RANK") {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: valid rlimit structs for the calls; this child lowers only its own limit.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
            r.rlim_cur = 64;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        }
    }
    if is("LATE_RANK") {
        std::thread::sleep(Duration::from_millis(1500));
    }
    let comm = oxccl::Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).unwrap();
    let send: Vec<f64> = (0..4096).map(|i| (rank * 7 + i % 13) as f64).collect();
    let mut recv = vec![0.0; send.len()];
    comm.all_reduce(&send, &mut recv, oxccl::ReduceOp::Sum).unwrap();
    for (i, v) in recv.iter().enumerate() {
        let want: f64 = (0..n).map(|r| (r * 7 + i % 13) as f64).sum();
        assert_eq!(*v, want, "element {i}");
    }
}

/// Holds `STRANGER_COUNT` silent connections to `STRANGER_ADDR`, opening a new one whenever
/// one is closed, until killed; prints `ready` once the first round was tried.
#[test]
fn stranger_child() {
    let (Ok(addr), Ok(count)) = (std::env::var("STRANGER_ADDR"), std::env::var("STRANGER_COUNT")) else { return };
    let addr: SocketAddr = addr.parse().unwrap();
    let count: usize = count.parse().unwrap();
    let open = || TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok();
    // The first round from 30 threads at once (a connect waits while the backlog is full).
    let mut held: Vec<Option<TcpStream>> = std::thread::scope(|s| {
        let hs: Vec<_> =
            (0..30).map(|t| s.spawn(move || (t..count).step_by(30).map(|_| open()).collect::<Vec<_>>())).collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    println!("ready {}", held.iter().flatten().count());
    loop {
        std::thread::sleep(Duration::from_millis(50));
        for h in held.iter_mut() {
            let gone = h.as_ref().is_none_or(|s| {
                let _ = s.set_nonblocking(true);
                !matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            });
            if gone {
                *h = open();
            }
        }
    }
}

/// 300 silent connections (re-opened as the root drops them) on the bootstrap root while 4
/// ranks initialise and all-reduce: the job completes with the right sum, and the root's
/// process (this one) never holds more than 32 threads or 100 descriptors.
#[test]
fn the_root_stays_small_under_300_silent_strangers() {
    if common::child_role().is_some() || std::env::var("STRANGER_ADDR").is_ok() {
        return;
    }
    let _one = serial();
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("id");
    let (addr, _) = id.decode().unwrap();
    let mut flood = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["stranger_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("STRANGER_ADDR", addr.to_string())
        .env("STRANGER_COUNT", "300")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the strangers");
    let ready = std::io::BufReader::new(flood.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains("ready"))
        .expect("the strangers' process says when it is ready");
    eprintln!("strangers: {}", ready.trim());
    let stop = AtomicBool::new(false);
    let (threads, fds) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let results = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                threads.fetch_max(count_dir("/proc/self/task"), Ordering::Relaxed);
                // read_dir's own descriptor is counted too.
                fds.fetch_max(count_dir("/proc/self/fd"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let r = common::wait_all(
            common::spawn_ranks_with_id(&id, "rank_child", 4, &[("STRANGERS_CASE", "1".into())]),
            Duration::from_secs(60),
        );
        stop.store(true, Ordering::Relaxed);
        r
    });
    let _ = flood.kill();
    let _ = flood.wait();
    common::assert_all_ok(&results);
    let (threads, fds) = (threads.into_inner(), fds.into_inner());
    eprintln!("root process peak: {threads} threads, {fds} descriptors");
    assert!(threads <= 32, "the root's process reached {threads} threads");
    assert!(fds <= 100, "the root's process reached {fds} descriptors");
    assert!(fds >= 40, "the strangers never filled the root's handshake slots ({fds} descriptors at most)");
}

/// 8 ranks; rank 3 runs under a descriptor limit of 64 and gets 100 silent connections on its
/// data listener before any link to it is built (rank 7 arrives 1.5 s late): the job
/// completes with the right sum (accepting used to fail with EMFILE, and the handshake cap of
/// 1024 sat above the limit).
#[test]
fn a_rank_under_ulimit_64_survives_100_strangers_on_its_data_listener() {
    if common::child_role().is_some() || std::env::var("STRANGER_ADDR").is_ok() {
        return;
    }
    let _one = serial();
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("id");
    let env = [("STRANGERS_CASE", "1".to_string()), ("LOW_FD_RANK", "3".into()), ("LATE_RANK", "7".into())];
    let children = common::spawn_ranks_with_id(&id, "rank_child", 8, &env);
    let pid = children[3].id();
    let t = Instant::now();
    let port = loop {
        if let Some(&p) = common::listening_ports(pid).first() {
            break p;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "rank 3 never listened");
        std::thread::sleep(Duration::from_millis(5));
    };
    let strangers: Vec<TcpStream> = (0..100)
        .filter_map(|_| {
            TcpStream::connect_timeout(&(std::net::Ipv4Addr::LOCALHOST, port).into(), Duration::from_secs(1)).ok()
        })
        .collect();
    assert!(t.elapsed() < Duration::from_millis(1400), "the strangers came after the late rank");
    eprintln!("{} strangers on rank 3's data listener (port {port})", strangers.len());
    let results = common::wait_all(children, Duration::from_secs(60));
    drop(strangers);
    common::assert_all_ok(&results);
}

/// A stranger that connects to the root gets a challenge and nothing else: neither the old
/// handshake (its own challenge, answered with a proof before) nor a hello proven with a wrong
/// secret gets one byte back, and the root still serves the real rank afterwards.
#[test]
fn a_stranger_at_the_root_learns_no_proof() {
    use oxccl::bootstrap::{root, wire};
    if common::child_role().is_some() || std::env::var("STRANGER_ADDR").is_ok() {
        return;
    }
    let _one = serial();
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("id");
    let (addr, secret) = id.decode().unwrap();
    let mut wrong = secret;
    wrong[3] ^= 0x40;
    let probe = |answer: &dyn Fn(&[u8]) -> Vec<u8>| {
        let mut s = TcpStream::connect(addr).unwrap();
        let nonce = wire::read_frame(&mut s, 64, Instant::now() + Duration::from_secs(5)).unwrap();
        assert_eq!(nonce.len(), 16);
        wire::write_frame(&mut s, &answer(&nonce)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut after = Vec::new();
        let _ = s.read_to_end(&mut after);
        after
    };
    assert_eq!(probe(&|_| vec![4u8; 16]), b"", "the old handshake's own challenge got an answer");
    let got = probe(&|n| root::hello_message(&wrong, n, &[4; 16], 1, 0, "127.0.0.1:9", "h"));
    assert_eq!(got, b"", "a hello with a wrong secret got an answer");
    let deadline = Instant::now() + Duration::from_secs(20);
    let b = oxccl::bootstrap::rendezvous(&id, 1, 0, deadline, false).expect("the real rank joins");
    assert_eq!(b.peers.len(), 1);
}

/// A relay between a rank and the root that changes one byte of the table (the address the
/// rank would connect to) or of the hello (the address the root would hand out): the rank
/// refuses the table, the root refuses the hello.
#[test]
fn a_relay_cannot_change_the_table_or_the_hello() {
    use oxccl::bootstrap::wire;
    if common::child_role().is_some() || std::env::var("STRANGER_ADDR").is_ok() {
        return;
    }
    let _one = serial();
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    for tamper_hello in [false, true] {
        let id = oxccl::UniqueId::new().expect("id");
        let (root_addr, secret) = id.decode().unwrap();
        let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let via = oxccl::UniqueId::for_address(&relay.local_addr().unwrap().to_string(), secret).unwrap();
        let mitm = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            let (mut rank, _) = relay.accept().unwrap();
            let mut root = TcpStream::connect(root_addr).unwrap();
            let nonce = wire::read_frame(&mut root, 64, deadline).unwrap();
            wire::write_frame(&mut rank, &nonce).unwrap();
            let mut hello = wire::read_frame(&mut rank, 1 << 16, deadline).unwrap();
            if tamper_hello {
                let n = hello.len();
                hello[n - 1] ^= 1; // the last byte of the host id
            }
            wire::write_frame(&mut root, &hello).unwrap();
            let Ok(mut reply) = wire::read_frame(&mut root, 1 << 16, deadline) else {
                return false; // the root refused the hello and closed the connection
            };
            let n = reply.len();
            reply[n - 1] ^= 1; // the table's last byte: this rank's host id
            wire::write_frame(&mut rank, &reply).unwrap();
            true
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let e = oxccl::bootstrap::rendezvous(&via, 1, 0, deadline, false).err().expect("tampering is caught");
        let relayed = mitm.join().unwrap();
        assert_eq!(relayed, !tamper_hello, "the root answers a genuine hello only");
        if !tamper_hello {
            assert!(e.message().contains("failed authentication"), "{e}");
        }
        eprintln!("tampered {}: {e}", if tamper_hello { "hello" } else { "table" });
        if tamper_hello {
            // The root dropped the tampered hello and still serves the real rank (and ends).
            oxccl::bootstrap::rendezvous(&id, 1, 0, deadline, false).expect("the real rank joins");
        }
    }
}
