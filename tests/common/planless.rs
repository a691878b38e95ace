//! Helpers shared by the tests of the plan-less shared-memory all-reduces (tests/lane.rs, the
//! small-message lane; tests/arena.rs, the host arena): the ranks' environment, joining as a
//! child rank, the bit-identity digest over awkward float inputs, and the kill-a-rank harness.

use oxccl::{Communicator, DataType, ReduceOp};
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

/// Loopback, a 20 s timeout and shared memory, then `pairs`.
pub fn shm_env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_TRANSPORT", "shm".to_string()),
    ];
    v.extend(pairs.iter().map(|&(k, val)| (k, val.to_string())));
    v
}

/// The communicator of a child rank (`None` in the parent test process).
pub fn join() -> Option<Communicator> {
    let (rank, n, id) = super::child_role()?;
    Some(Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init"))
}

/// FNV-1a of `bytes` folded into `h`.
fn fold(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Float inputs that make operand order visible: signed zeros, NaNs, infinities.
fn awkward(rank: usize, i: usize) -> f64 {
    match (rank + i) % 6 {
        0 => 0.0,
        1 => -0.0,
        2 => f64::NAN,
        3 => f64::INFINITY,
        4 => -1.5,
        _ => (rank * 7 + i) as f64,
    }
}

/// All-reduces `count` awkward elements of every float type with every operator and prints
/// `DIGEST <hash of all results>`: ranks whose results are bit-identical print the same line
/// ([`assert_same_digests`]).
pub fn print_awkward_digest(comm: &Communicator, count: usize) {
    let rank = comm.rank();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in DataType::ALL.into_iter().filter(|t| t.is_float()) {
        for op in ReduceOp::ALL {
            let vals: Vec<f64> = (0..count).map(|i| awkward(rank, i)).collect();
            let mut send = vec![0u8; count * t.size()];
            oxccl::reduce::from_f64(t, &vals, &mut send);
            let mut recv = vec![0u8; send.len()];
            // SAFETY: both buffers hold `count` elements and do not overlap.
            unsafe { comm.all_reduce_raw(send.as_ptr(), recv.as_mut_ptr(), count, t, op) }.expect("awkward");
            h = fold(h, &recv);
        }
    }
    eprintln!("DIGEST {h:016x}");
}

/// Checks the logs of `n` ranks that ran a matrix child: each printed `marker` (the path's INFO
/// line), `DONE rank=r n=n`, and the same digest as every other rank.
pub fn assert_same_digests(res: &[(bool, String)], n: usize, marker: &str, what: &str) {
    super::assert_all_ok(res);
    let mut digests = Vec::new();
    for (r, (_, log)) in res.iter().enumerate() {
        assert!(log.contains(marker), "{what}: rank {r} did not take the path ({marker:?}):\n{log}");
        assert!(log.contains(&format!("DONE rank={r} n={n}")), "rank {r}:\n{log}");
        digests.push(log.lines().find_map(|l| l.strip_prefix("DIGEST ")).expect("digest").to_string());
    }
    assert!(digests.iter().all(|d| *d == digests[0]), "{what}: results differ between ranks: {digests:?}");
}

/// A child rank's body: all-reduces `count` f32 in a loop (after writing `ready-<rank>` in
/// `OXCCL_TEST_READY`) until a call fails, then prints `RESULT kind=<kind> ms=<since start>`
/// and exits 1.
pub fn all_reduce_until_failure(comm: &Communicator, count: usize) {
    all_reduce_until_failure_in(comm, count, false)
}

/// [`all_reduce_until_failure`] with both buffers in shareable host memory when `shared`
/// (`oxccl::SharedBuffer`, which the host arena reads where it lies).
pub fn all_reduce_until_failure_in(comm: &Communicator, count: usize, shared: bool) {
    let rank = comm.rank();
    let mut heap = (vec![rank as f32; count], vec![0f32; count]);
    let mem = shared.then(|| {
        let b = [0, 1].map(|_| oxccl::SharedBuffer::new(count * 4).expect("shareable memory"));
        for i in 0..count {
            // SAFETY: the buffer holds `count` floats (page-aligned).
            unsafe { b[0].as_ptr().cast::<f32>().add(i).write(rank as f32) };
        }
        b
    });
    let (send, recv) = match &mem {
        Some(b) => (b[0].as_ptr().cast_const(), b[1].as_ptr()),
        None => (heap.0.as_ptr().cast::<u8>(), heap.1.as_mut_ptr().cast::<u8>()),
    };
    if let Ok(d) = std::env::var("OXCCL_TEST_READY") {
        std::fs::write(PathBuf::from(d).join(format!("ready-{rank}")), b"").unwrap();
    }
    let start = Instant::now();
    loop {
        // SAFETY: both buffers hold `count` floats, do not overlap and live through the loop.
        if let Err(e) = unsafe { comm.all_reduce_raw(send, recv, count, oxccl::DataType::Float32, ReduceOp::Sum) } {
            eprintln!("RESULT kind={:?} ms={}", e.kind(), start.elapsed().as_millis());
            std::process::exit(1);
        }
        assert!(start.elapsed() < Duration::from_secs(60), "rank {rank}: never failed");
    }
}

/// Starts `n` ranks running `child` ([`all_reduce_until_failure`]) with `env`, kills the last
/// with SIGKILL once all are in the loop, and checks that the survivors fail with a remote
/// error within 2 s (the ranks' timeout is 20 s).
pub fn kill_one_and_expect_remote_errors(child: &str, n: usize, env: &[(&'static str, String)], tag: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut e = env.to_vec();
    e.push(("OXCCL_TEST_READY", dir.to_str().unwrap().to_string()));
    let mut ranks: Vec<Child> = super::spawn_ranks(child, n, &e);
    let start = Instant::now();
    while (0..n).any(|r| !dir.join(format!("ready-{r}")).exists()) {
        if start.elapsed() > Duration::from_secs(60) || ranks.iter_mut().any(|c| c.try_wait().unwrap().is_some()) {
            for c in &mut ranks {
                let _ = c.kill();
            }
            panic!("ranks did not all start: {:?}", super::wait_all(ranks, Duration::from_secs(5)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
    ranks[n - 1].kill().unwrap();
    let killed = Instant::now();
    let res = super::wait_all(ranks, Duration::from_secs(30));
    let took = killed.elapsed();
    for (r, (ok, log)) in res.iter().enumerate().take(n - 1) {
        assert!(!ok, "rank {r} should have failed:\n{log}");
        assert!(log.contains("RESULT kind=Remote"), "rank {r} should fail with a remote error:\n{log}");
    }
    assert!(took < Duration::from_secs(2), "survivors took {took:?} to fail (timeout 20 s)");
    let _ = std::fs::remove_dir_all(&dir);
}
