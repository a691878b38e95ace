//! Reliability tests: collective mismatch detection (in-process, and with real processes over
//! TCP and shared memory: every rank fails with ncclInvalidUsage), abort from a second thread,
//! refusal after a failure, and a soak over TCP links (fds and memory do not grow).

mod common;

use oxccl::{Collectives, Communicator, DataType, ErrorKind, ReduceOp, UniqueId};
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

/// Every rank fails fast (well before the 10 s timeout) with ncclInvalidUsage and a message
/// naming both calls (ranks off the mismatched link learn it from a peer's abort frame).
fn assert_mismatch(results: &[(oxccl::Result<()>, Duration)], mine: &str, theirs: &str) {
    for (r, (res, t)) in results.iter().enumerate() {
        let e = res.as_ref().expect_err(&format!("rank {r} succeeded despite a mismatch"));
        assert!(*t < Duration::from_secs(2), "rank {r} took {t:?}: {e}");
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "rank {r}: {e}");
        assert!(e.message().contains("collective mismatch"), "rank {r}: {e}");
        assert!(
            e.message().contains(mine) && e.message().contains(theirs),
            "rank {r} must name `{mine}` and `{theirs}`: {e}"
        );
    }
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
    let comms = Communicator::in_memory(2);
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

/// Held by the soak (which counts this process's fds) and by the tests that start rank
/// processes (whose pipes would be counted).
static FDS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn fd_lock() -> std::sync::MutexGuard<'static, ()> {
    FDS.lock().unwrap_or_else(|e| e.into_inner())
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
    let _fds = fd_lock();
    let ok = |v: Vec<(oxccl::Result<()>, Duration)>| v.iter().all(|(r, _)| r.is_ok());
    // Over TCP: warm up (links, staging buffers), then measure around the soak.
    let before = common::open_fds();
    let mut comms = tcp_comms(3);
    assert!(ok(on_comms(&mut comms, |c| small(c, 100).and(large(c, 5)))));
    let (fds, mem) = (common::open_fds(), rss());
    assert!(ok(on_comms(&mut comms, |c| small(c, 10_000).and(large(c, 100)))));
    let (fds2, mem2) = (common::open_fds(), rss());
    assert!(fds2 <= fds, "open fds grew from {fds} to {fds2}");
    assert!(mem2 <= mem + (16 << 20), "RSS grew from {} MiB to {} MiB", mem >> 20, mem2 >> 20);
    drop(comms);
    let after = common::open_fds();
    assert!(after <= before, "destroying the communicators left {} fds open", after.saturating_sub(before));
}

/// One rank of a multi-process mismatch: two matched all-reduces, then the mismatched call
/// (`MISMATCH_CASE`: `coll` — rank `MISMATCH_RANK` calls broadcast while the others
/// all-reduce; `count` — it all-reduces 2048 elements instead of 1024; `small` — 3 elements
/// instead of 2, so steps are smaller than an abort frame; `root` — it broadcasts from root 1
/// instead of 0). A rank whose share of the mismatched call completed makes one
/// more call. Prints `RESULT kind=<ncclResult_t> ms=<since the mismatched call> msg=<text>`.
#[test]
fn mismatch_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let case = std::env::var("MISMATCH_CASE").unwrap_or_default();
    let odd: usize = std::env::var("MISMATCH_RANK").ok().and_then(|v| v.parse().ok()).expect("MISMATCH_RANK");
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
    let send: Vec<f32> = (0..2048).map(|i| (i % 5) as f32 + rank as f32).collect();
    let mut recv = vec![0f32; 2048];
    for _ in 0..2 {
        comm.all_reduce(&send[..1024], &mut recv[..1024], ReduceOp::Sum).expect("matched all-reduce");
        let want = |i: usize| (n * (i % 5) + n * (n - 1) / 2) as f32;
        assert!(recv[..1024].iter().enumerate().all(|(i, &v)| v == want(i)), "wrong all-reduce result");
    }
    let start = Instant::now();
    let me = rank == odd;
    let r_first = match (case.as_str(), me) {
        ("coll", true) => comm.broadcast(&send[..1024], &mut recv[..1024], 0),
        ("count", true) => comm.all_reduce(&send, &mut recv, ReduceOp::Sum),
        ("small", true) => comm.all_reduce(&send[..3], &mut recv[..3], ReduceOp::Sum),
        ("small", false) => comm.all_reduce(&send[..2], &mut recv[..2], ReduceOp::Sum),
        ("root", true) => comm.broadcast(&send[..1024], &mut recv[..1024], 1),
        ("root", false) => comm.broadcast(&send[..1024], &mut recv[..1024], 0),
        _ => comm.all_reduce(&send[..1024], &mut recv[..1024], ReduceOp::Sum),
    };
    // A rank whose share completed waits a moment for ncclCommGetAsyncError to report the
    // failure (a peer's abort frame), then makes one more call (which the odd rank may be
    // waiting for, when the two shared no link in the mismatched call).
    let mut via = "call";
    let r = match r_first {
        Err(e) => Err(e),
        Ok(()) => {
            let t = Instant::now();
            let mut pending = None;
            while pending.is_none() && t.elapsed() < Duration::from_millis(300) {
                pending = comm.async_error();
                std::thread::sleep(Duration::from_millis(5));
            }
            match pending {
                Some(e) => {
                    via = "async";
                    Err(e)
                }
                None => {
                    via = "next";
                    comm.all_reduce(&send[..4], &mut recv[..4], ReduceOp::Sum)
                }
            }
        }
    };
    match r {
        Ok(()) => eprintln!("RESULT kind=0 ms={} via={via} msg=", start.elapsed().as_millis()),
        Err(e) => {
            eprintln!("RESULT kind={} ms={} via={via} msg={}", e.code(), start.elapsed().as_millis(), e.message())
        }
    }
}

/// (ncclResult_t, ms, message) from a child's stderr.
fn child_report(stderr: &str) -> Option<(i32, u128, String)> {
    let line = stderr.lines().find(|l| l.starts_with("RESULT "))?;
    let kind = line.split("kind=").nth(1)?.split(' ').next()?.parse().ok()?;
    let ms = line.split("ms=").nth(1)?.split(' ').next()?.parse().ok()?;
    Some((kind, ms, line.split("msg=").nth(1)?.to_string()))
}

/// 4 and 5 ranks as processes, over TCP and over shared memory; each kind of mismatch (different
/// collective, count only — large and tiny —, root only) made by a different rank: every rank must return
/// ncclInvalidUsage within 2 s (with a 20 s timeout, so the timeout cannot be what fires), with
/// a message naming the odd rank and the rank on the other side and both calls.
#[test]
fn mismatch_fails_every_rank_of_4_and_5_processes_over_tcp_and_shm() {
    if common::child_role().is_some() {
        return;
    }
    let _fds = fd_lock();
    let cases = [
        ("coll", "broadcast(count=1024,float,root=0)", "all_reduce(count=1024,float,sum)"),
        ("count", "all_reduce(count=2048,float,sum)", "all_reduce(count=1024,float,sum)"),
        ("root", "broadcast(count=1024,float,root=1)", "broadcast(count=1024,float,root=0)"),
        ("small", "all_reduce(count=3,float,sum)", "all_reduce(count=2,float,sum)"),
    ];
    let mut worst = 0;
    for transport in ["tcp", "shm"] {
        for n in [4usize, 5] {
            for (k, (case, odd_call, other_call)) in cases.iter().enumerate() {
                let odd = (k + n - 1) % n;
                let env = [
                    ("MISMATCH_CASE", case.to_string()),
                    ("MISMATCH_RANK", odd.to_string()),
                    ("OXCCL_TIMEOUT_MS", "20000".to_string()),
                    ("OXCCL_TRANSPORT", transport.to_string()),
                ];
                let outs = common::run_ranks("mismatch_child", n, &env, Duration::from_secs(30));
                let at = format!("{transport}, {n} ranks, {case} mismatch by rank {odd}");
                for (r, (_, out)) in outs.iter().enumerate() {
                    let (kind, ms, msg) =
                        child_report(out).unwrap_or_else(|| panic!("{at}: rank {r} reported nothing:\n{out}"));
                    assert_eq!(kind, 5, "{at}: rank {r} must see ncclInvalidUsage, got {kind}: {msg}");
                    assert!(ms < 2000, "{at}: rank {r} took {ms} ms: {msg}");
                    if *case != "root" {
                        worst = worst.max(ms);
                    }
                    assert!(msg.contains("collective mismatch"), "{at}: rank {r}: {msg}");
                    assert!(
                        msg.contains(&format!("rank {odd} called {odd_call}")),
                        "{at}: rank {r}: must name rank {odd}'s call: {msg}"
                    );
                    // With roots that differ, a rank whose share of the broadcast completed is
                    // caught by the odd rank at its next call (it shared no link with it).
                    let next = "all_reduce(count=4,float,sum)";
                    let other = (0..n).filter(|&o| o != odd).any(|o| {
                        msg.contains(&format!("rank {o} called {other_call}"))
                            || (*case == "root" && msg.contains(&format!("rank {o} called {next}")))
                    });
                    assert!(other, "{at}: rank {r}: must name the other side's rank and call: {msg}");
                }
            }
        }
    }
    println!("slowest rank (all but the root case): {worst} ms from its mismatched call to its error");
}

/// One rank of the async-error case: rank 2 sends to rank 1 (matched, so its call completes),
/// then polls ncclCommGetAsyncError; rank 1 receives that, then sends 8 floats to rank 0, which
/// expects 16: rank 1 and rank 0 find the mismatch, and rank 1's abort frame reaches the idle
/// rank 2. Prints `RESULT kind=<ncclResult_t> ms=<since the mismatched call> msg=<text>`.
#[test]
fn async_child() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).expect("id"), rank).expect("init");
    let one = [1f32; 8];
    let mut got = [0f32; 16];
    let start = Instant::now();
    let r = match rank {
        2 => comm.send(&one, 1).map_err(Some).and_then(|()| {
            while start.elapsed() < Duration::from_secs(5) {
                if let Some(e) = comm.async_error() {
                    // The communicator now refuses calls, with the same code.
                    let again = comm.send(&one, 1).expect_err("a call after an async error must be refused");
                    assert!(again.message().contains("must be destroyed") && again.code() == e.code(), "{again}");
                    return Err(Some(e));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(None)
        }),
        1 => comm.recv(&mut got[..8], 2).and_then(|()| comm.send(&one, 0)).map_err(Some),
        _ => comm.recv(&mut got, 1).map_err(Some),
    };
    match r {
        Err(Some(e)) => eprintln!("RESULT kind={} ms={} msg={}", e.code(), start.elapsed().as_millis(), e.message()),
        _ => eprintln!("RESULT kind=0 ms={} msg=no error", start.elapsed().as_millis()),
    }
}

/// A rank whose own calls all completed learns of a mismatch found by others through
/// ncclCommGetAsyncError (the abort frame a peer left on its link), within 2 s, over TCP and
/// shared memory; the communicator then refuses further calls.
#[test]
fn async_error_reports_a_mismatch_found_after_this_ranks_calls_completed() {
    if common::child_role().is_some() {
        return;
    }
    let _fds = fd_lock();
    for transport in ["tcp", "shm"] {
        let env = [("OXCCL_TIMEOUT_MS", "20000".to_string()), ("OXCCL_TRANSPORT", transport.to_string())];
        let outs = common::run_ranks("async_child", 3, &env, Duration::from_secs(30));
        for (r, (_, out)) in outs.iter().enumerate() {
            let (kind, ms, msg) =
                child_report(out).unwrap_or_else(|| panic!("{transport}: rank {r} reported nothing:\n{out}"));
            assert_eq!(kind, 5, "{transport}: rank {r} must see ncclInvalidUsage, got {kind}: {msg}");
            assert!(ms < 2000, "{transport}: rank {r} took {ms} ms: {msg}");
            assert!(
                msg.contains("collective mismatch")
                    && msg.contains("rank 1 called send(count=8,float,peer=0)")
                    && msg.contains("rank 0 called recv(count=16,float,peer=1)"),
                "{transport}: rank {r} must name both sides: {msg}"
            );
        }
    }
}

/// With `OXCCL_LIVENESS_TIMEOUT_MS=0` (no death by silence) the control channels still carry
/// failures: the idle rank 2 of [`async_child`] (no call running, so no data link can tell it)
/// learns of the mismatch found by ranks 0 and 1 through `ncclCommGetAsyncError` within 2 s,
/// over TCP.
#[test]
fn liveness_off_still_carries_abort_frames_to_an_idle_rank() {
    if common::child_role().is_some() {
        return;
    }
    let _fds = fd_lock();
    let env = [
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_TRANSPORT", "tcp".to_string()),
        ("OXCCL_LIVENESS_TIMEOUT_MS", "0".to_string()),
    ];
    let outs = common::run_ranks("async_child", 3, &env, Duration::from_secs(30));
    let (kind, ms, msg) = child_report(&outs[2].1).unwrap_or_else(|| panic!("rank 2 reported nothing:\n{}", outs[2].1));
    assert_eq!(kind, 5, "rank 2 must see ncclInvalidUsage, got {kind}: {msg}");
    assert!(ms < 2000, "rank 2 took {ms} ms: {msg}");
    assert!(
        msg.contains("collective mismatch") && msg.contains("rank 1 called send(count=8,float,peer=0)"),
        "rank 2 must name the mismatch: {msg}"
    );
}
