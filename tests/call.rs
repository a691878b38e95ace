//! The call layer through the Rust API (`oxccl::call`), the path the C ABI takes: PreMulSum on
//! host buffers (typed, raw, in place, in groups) against an f64 reference, the per-thread
//! nested group (`start_group` / `submit` / `end_group`, as `ncclGroupStart` / `End`) driving
//! every rank from one thread, and creation: nonblocking (`CommInit`) and inside a group (`call::create`).

use oxccl::call::{self, Call, CommInit, Created, InitState, Reduction, Scalar};
use oxccl::{Collective, Collectives, Communicator, DataType, ErrorKind, ReduceOp, UniqueId};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rank `r`'s input element `i`: small integers, exact in f32 and f64.
fn val(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 11) as f64 - 5.0
}

/// Rank `r`'s PreMulSum factor (a power-of-two fraction: every product is exact).
fn factor(r: usize) -> f64 {
    0.5 * (r + 1) as f64
}

/// `sum_p factor(p) * val(p, i)` in f64.
fn premul_ref(n: usize, i: usize) -> f64 {
    (0..n).map(|p| factor(p) * val(p, i)).sum()
}

fn premul(r: usize) -> Reduction {
    Reduction::PreMulSum(Scalar::Host(factor(r)))
}

/// Runs `f(comm)` on every rank of an `n`-rank in-memory communicator, one thread each.
fn on_ranks<R: Send>(n: usize, f: impl Fn(&Arc<Communicator>) -> R + Sync) -> Vec<R> {
    let comms: Vec<Arc<Communicator>> = Communicator::in_memory(n).into_iter().map(Arc::new).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

#[test]
fn premul_sum_on_host_buffers_against_an_f64_reference() {
    let n = 3;
    on_ranks(n, |c| {
        let r = c.rank();
        // Typed all-reduce, small (the plan-less paths) and large (a plan), f32.
        for count in [16, 5000] {
            let send: Vec<f32> = (0..count).map(|i| val(r, i) as f32).collect();
            let mut recv = vec![0f32; count];
            c.all_reduce_with(&send, &mut recv, premul(r)).unwrap();
            for (i, x) in recv.iter().enumerate() {
                assert_eq!(f64::from(*x), premul_ref(n, i), "all_reduce count {count} element {i}");
            }
            // The send buffer is not scaled in place.
            assert!(send.iter().enumerate().all(|(i, x)| f64::from(*x) == val(r, i)));
        }
        // Reduce-scatter: block r of the scaled sum.
        let big: Vec<f32> = (0..n * 40).map(|i| val(r, i) as f32).collect();
        let mut part = vec![0f32; 40];
        c.reduce_scatter_with(&big, &mut part, premul(r)).unwrap();
        for (i, x) in part.iter().enumerate() {
            assert_eq!(f64::from(*x), premul_ref(n, r * 40 + i), "reduce_scatter element {i}");
        }
        // Reduce to root 1, f64.
        let send: Vec<f64> = (0..33).map(|i| val(r, i)).collect();
        let mut out = if r == 1 { vec![0f64; 33] } else { Vec::new() };
        c.reduce_with(&send, &mut out, premul(r), 1).unwrap();
        if r == 1 {
            assert!(out.iter().enumerate().all(|(i, x)| *x == premul_ref(n, i)), "{out:?}");
        }
        // A raw call in place (send == recv), f64, through call::run.
        let mut buf: Vec<f64> = (0..300).map(|i| val(r, i)).collect();
        let mut call = Call::new(Collective::AllReduce, buf.len(), DataType::Float64);
        call.send = buf.as_ptr().cast();
        call.recv = buf.as_mut_ptr().cast();
        call.reduction = premul(r);
        // SAFETY: `buf` holds 300 f64 and is untouched until `run` returns.
        unsafe { call::run(c, &call) }.unwrap();
        assert!(buf.iter().enumerate().all(|(i, x)| *x == premul_ref(n, i)), "in place");
        // A scalar in GPU memory needs device buffers.
        call.reduction = Reduction::PreMulSum(Scalar::Device(0x1000));
        // SAFETY: as above (the call is refused before any access).
        let e = unsafe { call::run(c, &call) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    });
}

#[test]
fn premul_sum_in_a_scoped_group_with_other_calls() {
    let n = 4;
    on_ranks(n, |c| {
        let r = c.rank();
        let send: Vec<f32> = (0..700).map(|i| val(r, i) as f32).collect();
        let mut sum = vec![0f32; 700];
        let mine = vec![r as u32; 5];
        let mut all = vec![0u32; 5 * n];
        let mut from_left = vec![0f64; 9];
        let to_right: Vec<f64> = (0..9).map(|i| val(r, i)).collect();
        // The pre-scaled copy lives until the merged group has run.
        oxccl::group(|g| {
            g.on(c).all_reduce_with(&send, &mut sum, premul(r))?;
            g.on(c).all_gather(&mine, &mut all)?;
            g.on(c).send(&to_right, (r + 1) % n)?;
            g.on(c).recv(&mut from_left, (r + n - 1) % n)
        })
        .unwrap();
        assert!(sum.iter().enumerate().all(|(i, x)| f64::from(*x) == premul_ref(n, i)), "{sum:?}");
        assert!((0..n).all(|p| all[p * 5..(p + 1) * 5].iter().all(|x| *x == p as u32)));
        assert!(from_left.iter().enumerate().all(|(i, x)| *x == val((r + n - 1) % n, i)));
    });
}

#[test]
fn one_thread_drives_every_rank_through_the_thread_group() {
    let n = 3;
    let comms: Vec<Arc<Communicator>> = Communicator::in_memory(n).into_iter().map(Arc::new).collect();
    let sends: Vec<Vec<f32>> = (0..n).map(|r| (0..2000).map(|i| val(r, i) as f32).collect()).collect();
    let mut sums = vec![vec![0f32; 2000]; n];
    let mut got = vec![vec![0i64; 4]; n];
    let ring: Vec<Vec<i64>> = (0..n).map(|r| (0..4).map(|i| (r * 10 + i) as i64).collect()).collect();
    // Nested: only the outermost end runs the calls.
    call::start_group();
    call::start_group();
    assert_eq!(call::group_depth(), 2);
    for (r, c) in comms.iter().enumerate() {
        let mut ar = Call::new(Collective::AllReduce, 2000, DataType::Float32);
        ar.send = sends[r].as_ptr().cast();
        ar.recv = sums[r].as_mut_ptr().cast();
        ar.reduction = premul(r);
        let mut s = Call::new(Collective::Send { peer: (r + 1) % n }, 4, DataType::Int64);
        s.send = ring[r].as_ptr().cast();
        let mut v = Call::new(Collective::Recv { peer: (r + n - 1) % n }, 4, DataType::Int64);
        v.recv = got[r].as_mut_ptr().cast();
        for call in [ar, s, v] {
            // SAFETY: the buffers outlive the group and are untouched until its end returns.
            unsafe { call::submit(c, &call) }.unwrap();
        }
    }
    // A call that fails its checks is left out; the others still run.
    let bad = Call::new(Collective::Broadcast { root: n }, 1, DataType::Float32);
    // SAFETY: refused before any access.
    let e = unsafe { call::submit(&comms[0], &bad) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    call::end_group().unwrap();
    assert!(sums.iter().all(|s| s.iter().all(|x| *x == 0.0)), "ran at the inner end");
    call::end_group().unwrap();
    assert_eq!(call::group_depth(), 0);
    for r in 0..n {
        assert!(sums[r].iter().enumerate().all(|(i, x)| f64::from(*x) == premul_ref(n, i)), "rank {r}");
        assert_eq!(got[r], ring[(r + n - 1) % n], "rank {r} ring");
    }
    let e = call::end_group().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
}

/// `n` ranks' all-reduce (sum) of `val(r, i)` for 8 elements, one thread per rank, checked
/// against the f64 sum.
fn check_all_reduce(comms: &[Communicator]) {
    let n = comms.len();
    let sums: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut out = vec![0f64; 8];
                    let mine: Vec<f64> = (0..8).map(|i| val(c.rank(), i)).collect();
                    c.all_reduce(&mine, &mut out, ReduceOp::Sum).unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, s) in sums.iter().enumerate() {
        for (i, x) in s.iter().enumerate() {
            let want: f64 = (0..n).map(|p| val(p, i)).sum();
            assert_eq!(*x, want, "rank {r} element {i}");
        }
    }
}

#[test]
fn nonblocking_creation_is_in_progress_until_the_peers_join_then_all_reduces() {
    let n = 3;
    let id = UniqueId::new().expect("id");
    let first = Communicator::init_rank_nonblocking(n, &id, 0).unwrap();
    // Ranks 1 and 2 have not started: rank 0's creation cannot finish, whatever the timing.
    assert!(matches!(first.state(), InitState::InProgress), "{first:?}");
    assert!(first.poll().is_none());
    let e = first.wait(Duration::from_millis(200)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(matches!(first.state(), InitState::InProgress), "a timed-out wait leaves it running");
    let comms: Vec<Communicator> = std::thread::scope(|s| {
        let peers: Vec<_> = (1..n)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    let init = Communicator::init_rank_nonblocking(n, id, r).unwrap();
                    init.wait(Duration::from_secs(60)).expect("peer built")
                })
            })
            .collect();
        let mut comms = vec![first.wait(Duration::from_secs(60)).expect("rank 0 built")];
        comms.extend(peers.into_iter().map(|h| h.join().expect("peer thread")));
        comms
    });
    assert!(matches!(first.state(), InitState::Ready));
    assert!(first.poll().is_none(), "taken once");
    assert!(comms.iter().enumerate().all(|(r, c)| c.rank() == r && c.size() == n));
    check_all_reduce(&comms);
    // A creation that fails reports its error, every time it is asked.
    let bad = CommInit::start(|| Err(oxccl::Error::invalid_argument("no such rank"))).unwrap();
    let e = bad.wait(Duration::from_secs(30)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    match bad.state() {
        InitState::Failed(e) => assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(matches!(bad.poll(), Some(Err(_))));
}

/// The call layer's creation policy: blocking outside a group builds at once; blocking inside
/// a group builds on workers that the group's end has waited for (every rank created from one
/// thread, as `ncclGroupStart` / `ncclCommInitRank` x n / `ncclGroupEnd` do); nonblocking is
/// in progress.
#[test]
fn blocking_creation_in_a_group_is_awaited_by_the_group_end() {
    let n = 3;
    let id = UniqueId::new().expect("id");
    call::start_group();
    let inits: Vec<CommInit> = (0..n)
        .map(|r| match call::create(true, move || Communicator::init_rank(n, &id, r)).unwrap() {
            Created::Building { init, in_progress: false } => init,
            other => panic!("rank {r}: expected a build awaited by the group, got {other:?}"),
        })
        .collect();
    call::end_group().unwrap();
    // No wait here: the group's end waited.
    let comms: Vec<Communicator> = inits
        .iter()
        .map(|i| match i.poll() {
            Some(Ok(c)) => c,
            other => panic!("not built at the group's end: {:?} ({:?})", other.map(|r| r.map(|_| ())), i.state()),
        })
        .collect();
    check_all_reduce(&comms);
    let one = UniqueId::new().expect("id");
    match call::create(true, move || Communicator::init_rank(1, &one, 0)).unwrap() {
        Created::Ready(c) => assert_eq!(c.size(), 1),
        other => panic!("expected a communicator built at once, got {other:?}"),
    }
    let one = UniqueId::new().expect("id");
    match call::create(false, move || Communicator::init_rank(1, &one, 0)).unwrap() {
        Created::Building { init, in_progress: true } => {
            assert_eq!(init.wait(Duration::from_secs(30)).unwrap().size(), 1)
        }
        other => panic!("expected a nonblocking build, got {other:?}"),
    }
}

/// The C ABI's nonblocking handles: a handle whose communicator was built is usable by the
/// first call that looks it up (here `ncclCommCount`, before any `ncclCommGetAsyncError`), and
/// `ncclInvalidUsage` before that. Run on a helper thread so that a hang fails the test.
#[test]
fn a_built_nonblocking_handle_is_usable_without_polling_first() {
    use oxccl::ffi::comm::{ncclCommCount, ncclCommDestroy, ncclGetUniqueId};
    use oxccl::ffi::config::{ncclCommInitRankConfig, ncclConfig_t};
    use oxccl::ffi::{ncclComm_t, ncclResult_t, ncclUniqueId};
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut id = ncclUniqueId { internal: [0; 128] };
        assert_eq!(ncclGetUniqueId(&mut id), ncclResult_t::ncclSuccess);
        let mut config = ncclConfig_t { blocking: 0, ..Default::default() };
        let mut comms: [ncclComm_t; 2] = [std::ptr::null_mut(); 2];
        for (r, c) in comms.iter_mut().enumerate() {
            let st = ncclCommInitRankConfig(c, 2, id, r as i32, &mut config);
            assert_eq!(st, ncclResult_t::ncclInProgress, "rank {r}");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for c in comms {
            let mut n = 0;
            loop {
                match ncclCommCount(c, &mut n) {
                    ncclResult_t::ncclSuccess => break,
                    ncclResult_t::ncclInvalidUsage if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    other => panic!("ncclCommCount on a pending handle: {other:?}"),
                }
            }
            assert_eq!(n, 2);
        }
        for c in comms {
            assert_eq!(ncclCommDestroy(c), ncclResult_t::ncclSuccess);
        }
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("the nonblocking handles became usable without a hang");
}
