//! In-process reliability tests: collective mismatch detection, abort from a second thread,
//! refusal after a failure, and a soak over in-memory links (fds and memory do not grow).

use oxccl::{Collectives, Communicator, DataType, ErrorKind, ReduceOp};
use std::time::{Duration, Instant};

/// Runs `f(comm)` on every rank of `n` in-memory communicators (one thread each) with a 10 s
/// timeout, returning each rank's result and how long it took.
fn on_ranks<F>(n: usize, f: F) -> Vec<(oxccl::Result<()>, Duration)>
where
    F: Fn(&Communicator) -> oxccl::Result<()> + Sync,
{
    on_comms(&mut Communicator::in_memory(n), f)
}

/// `n` communicators over TCP loopback, one per rank, joined by threads of this process.
fn tcp_comms(n: usize) -> Vec<Communicator> {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let id = oxccl::UniqueId::new().expect("id");
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n).map(|r| s.spawn(move || Communicator::init_rank(n, &id, r).expect("init"))).collect();
        hs.into_iter().map(|h| h.join().expect("init thread")).collect()
    })
}

/// Runs `f(comm)` on every communicator of `comms` (one thread each).
fn on_comms<F>(comms: &mut [Communicator], f: F) -> Vec<(oxccl::Result<()>, Duration)>
where
    F: Fn(&Communicator) -> oxccl::Result<()> + Sync,
{
    for c in comms.iter_mut() {
        c.set_timeout(Duration::from_secs(10));
    }
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || {
                    let t = Instant::now();
                    (f(c), t.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Every rank fails fast (well before the 10 s timeout); the ranks that share a link with the
/// mismatched side fail with ncclInvalidUsage, and at least one message names both calls.
fn assert_mismatch(results: &[(oxccl::Result<()>, Duration)], mine: &str, theirs: &str) {
    let mut usage = 0;
    for (r, (res, t)) in results.iter().enumerate() {
        let e = res.as_ref().expect_err(&format!("rank {r} succeeded despite a mismatch"));
        assert!(*t < Duration::from_secs(3), "rank {r} took {t:?}: {e}");
        assert!(matches!(e.kind(), ErrorKind::InvalidUsage | ErrorKind::Remote), "rank {r}: {e}");
        if e.kind() == ErrorKind::InvalidUsage {
            usage += 1;
            assert!(e.message().contains("collective mismatch"), "rank {r}: {e}");
        }
    }
    let named = results
        .iter()
        .filter_map(|(r, _)| r.as_ref().err())
        .any(|e| e.message().contains(mine) && e.message().contains(theirs));
    assert!(usage >= 2, "both sides of the mismatched link must report ncclInvalidUsage: {results:?}");
    assert!(named, "no message names both `{mine}` and `{theirs}`: {results:?}");
}

#[test]
fn all_reduce_against_broadcast_fails_every_rank() {
    let results = on_ranks(3, |c| {
        let send = vec![1f32; 1024];
        let mut recv = vec![0f32; 1024];
        c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
        if c.rank() == 2 {
            c.broadcast(&send, &mut recv, 0)
        } else {
            c.all_reduce(&send, &mut recv, ReduceOp::Sum)
        }
    });
    assert_mismatch(&results, "all_reduce(count=1024,float,sum)", "broadcast(count=1024,float,root=0)");
    let e = results[2].0.as_ref().unwrap_err();
    assert!(e.message().contains("as operation #2"), "the operation number must be named: {e}");
}

#[test]
fn count_type_and_op_mismatches_are_caught() {
    type Case = (usize, DataType, ReduceOp);
    let cases: [(Case, Case); 3] = [
        ((1024, DataType::Float32, ReduceOp::Sum), (512, DataType::Float32, ReduceOp::Sum)),
        ((256, DataType::Float32, ReduceOp::Sum), (256, DataType::Int32, ReduceOp::Sum)),
        ((256, DataType::Float32, ReduceOp::Sum), (256, DataType::Float32, ReduceOp::Max)),
    ];
    for (a, b) in cases {
        let results = on_ranks(2, |c| {
            let (count, dtype, op) = if c.rank() == 0 { a } else { b };
            let mut buf = vec![0u8; count * dtype.size()];
            // SAFETY: `buf` holds `count` elements of `dtype` and is used in place.
            unsafe { c.all_reduce_raw(buf.as_ptr(), buf.as_mut_ptr(), count, dtype, op) }
        });
        let show = |(n, t, o): Case| format!("all_reduce(count={n},{},{})", t.name(), o.name());
        assert_mismatch(&results, &show(a), &show(b));
    }
}

#[test]
fn after_a_failure_calls_are_refused_until_destroy() {
    let results = on_ranks(2, |c| {
        let mut buf = vec![1f64; 64 + c.rank()];
        let first = c.all_reduce_in_place(&mut buf, ReduceOp::Sum);
        assert!(first.is_err(), "mismatched counts must fail");
        assert!(c.async_error().is_some(), "the failure must be pending for ncclCommGetAsyncError");
        let again = c.all_reduce_in_place(&mut [1f64; 8], ReduceOp::Sum).expect_err("refused");
        assert!(again.message().contains("must be destroyed"), "{again}");
        Ok(())
    });
    assert!(results.iter().all(|(r, _)| r.is_ok()));
}

#[test]
fn abort_from_another_thread_unblocks_within_1s() {
    let mut comms = Communicator::in_memory(2);
    comms[0].set_timeout(Duration::from_secs(30));
    let c = &comms[0];
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut buf = vec![1f32; 4096];
            // Rank 1 never joins: this blocks until aborted.
            c.all_reduce_in_place(&mut buf, ReduceOp::Sum)
        });
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        c.abort();
        let r = h.join().expect("collective thread");
        let waited = t.elapsed();
        let e = r.expect_err("an aborted collective must fail");
        assert!(waited < Duration::from_secs(1), "abort took {waited:?} to unblock the collective");
        assert!(e.message().contains("aborted"), "{e}");
    });
    let e = comms[0].all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum).expect_err("refused after abort");
    assert!(e.message().contains("aborted"), "{e}");
    assert!(comms[0].async_error().is_some());
}

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Resident set size of this process in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

#[test]
fn soak_10000_small_and_100_large_collectives_leak_nothing() {
    let small = |c: &Communicator, k: usize| -> oxccl::Result<()> {
        for i in 0..k {
            let send = [(c.rank() + i) as f32; 2];
            let mut recv = [0f32; 2];
            c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
            let want = (0..c.size()).map(|r| (r + i) as f32).sum::<f32>();
            assert_eq!(recv, [want; 2]);
        }
        Ok(())
    };
    let large = |c: &Communicator, k: usize| -> oxccl::Result<()> {
        let mut buf = vec![0f32; 1 << 20];
        for i in 0..k {
            buf.iter_mut().for_each(|v| *v = (c.rank() * 3 + i) as f32);
            c.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
            let want = (0..c.size()).map(|r| (r * 3 + i) as f32).sum::<f32>();
            assert!(buf.iter().step_by(4099).all(|&v| v == want));
        }
        Ok(())
    };
    let ok = |v: Vec<(oxccl::Result<()>, Duration)>| v.iter().all(|(r, _)| r.is_ok());
    // Over TCP: warm up (links, staging buffers), then measure around the soak.
    let before = open_fds();
    let mut comms = tcp_comms(3);
    assert!(ok(on_comms(&mut comms, |c| small(c, 100).and(large(c, 5)))));
    let (fds, mem) = (open_fds(), rss());
    assert!(ok(on_comms(&mut comms, |c| small(c, 10_000).and(large(c, 100)))));
    let (fds2, mem2) = (open_fds(), rss());
    assert!(fds2 <= fds, "open fds grew from {fds} to {fds2}");
    assert!(mem2 <= mem + (16 << 20), "RSS grew from {} MiB to {} MiB", mem >> 20, mem2 >> 20);
    drop(comms);
    let after = open_fds();
    assert!(after <= before, "destroying the communicators left {} fds open", after.saturating_sub(before));
}
