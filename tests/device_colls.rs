//! Every collective on device buffers, on the CUDA stand-in (`cuda-standin/`, built here with
//! `cc`), or on the real driver when `OXCCL_DEVICE_TESTS_REAL=1` (the GPU check kit, docs/GPU.md).
//!
//! Ranks are processes with the stand-in first on `LD_LIBRARY_PATH`, sharing one simulated GPU.
//! Each rank enqueues every case back to back through the C ABI, alternating over two streams
//! with no host synchronisation in between, then checks every result element by element
//! against an f64 reference computed from every rank's input:
//! broadcast, reduce, all-gather, reduce-scatter, all-to-all, gather, scatter, all-reduce, a
//! send/receive ring (a group), in and out of place, float32/float16/bfloat16/int32 with sum,
//! float32 with every operator and PreMulSum (host scalar and device scalar); a group of mixed
//! collectives over two streams. Out of place, the buffers NCCL ignores on a rank are NULL or a
//! host pointer (they must not be classified). The path that ran is asserted from the
//! `OXCCL_DEBUG=INFO` lines: on one host, IPC for all-reduce, the one-shot IPC flow for the
//! other collectives (PreMulSum with a host scalar on reduce and reduce-scatter included), the
//! IPC exchange for the send/receive ring and the IPC flows for the mixed group; across fake
//! hosts (`OXCCL_HOSTID`) and without IPC, the proxy for all-reduce and staged for everything
//! else. A second test runs a send/receive group with unequal sizes per pair, several messages
//! per peer and sends to itself. The matrix runs again (2 ranks IPC, 3 ranks proxy) with the
//! stand-in's one hardware queue per GPU (`CUDA_DEVICE_MAX_CONNECTIONS=1`). The cases and the rank set-up are in tests/common/devcase.rs;
//! failures (kill -9, SIGSTOP, an unpaired group) are tests/device_failures.rs.

mod common;
#[path = "common/devcase.rs"]
mod devcase;

use common::standin::DevMem;
use cudarc::driver::sys;
use devcase::{finish, join, ok, run, Case, Red, TYPES};
use oxccl::ffi::coll::ncclAllGather;
use oxccl::ffi::coll::ncclAllReduce;
use oxccl::ffi::coll::{ncclRecv, ncclSend};
use oxccl::ffi::comm::ncclCommDestroy;
use oxccl::ffi::group::{ncclGroupEnd, ncclGroupStart};
use oxccl::ffi::{ncclComm_t, ncclResult_t};
use oxccl::{Collective, DataType, ReduceOp};
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Every collective × type × placement with sum, float32 with every other operator and
/// PreMulSum, then a group of mixed collectives over both streams.
fn matrix_rank(rank: usize, n: usize, id: &str) {
    let (mut r, _ctx) = join(rank, n, id);
    let mut cases = Vec::new();
    let mut k = 0;
    fn next(k: &mut usize) -> usize {
        *k += 1;
        *k
    }
    let colls = |k: usize| {
        let root = k % n;
        [
            Collective::AllReduce,
            Collective::Broadcast { root },
            Collective::Reduce { root },
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::Gather { root },
            Collective::Scatter { root },
            Collective::Send { peer: (rank + 1) % n },
        ]
    };
    for dt in TYPES {
        for in_place in [false, true] {
            for coll in colls(next(&mut k)) {
                let seed = next(&mut k);
                let count = if seed % 3 == 0 { 4_099 } else { 1_003 };
                cases.push(r.case(coll, dt, Red::Op(ReduceOp::Sum), count, in_place, seed, seed % 2).fetch());
            }
        }
    }
    let reds = [
        Red::Op(ReduceOp::Prod),
        Red::Op(ReduceOp::Max),
        Red::Op(ReduceOp::Min),
        Red::Op(ReduceOp::Avg),
        Red::PreMulHost,
        Red::PreMulDevice,
    ];
    for red in reds {
        let root = next(&mut k) % n;
        for coll in [Collective::AllReduce, Collective::Reduce { root }, Collective::ReduceScatter] {
            let seed = next(&mut k);
            cases.push(r.case(coll, DataType::Float32, red, 257, seed % 2 == 0, seed, seed % 2).fetch());
        }
    }
    // A call on host buffers right after the device calls, with a stream: it must not run on
    // the links while the proxy thread still runs staged device calls.
    let hin: Vec<f32> = (0..64).map(|i| (rank * 100 + i) as f32).collect();
    let mut hout = vec![0f32; 64];
    let (hs, hr) = (hin.as_ptr().cast(), hout.as_mut_ptr().cast());
    let st = r.streams[1].cast();
    ok(ncclAllReduce(hs, hr, 64, DataType::Float32 as i32, 0, r.comm, st), r.comm, "host all-reduce");
    for (i, v) in hout.iter().enumerate() {
        let want: usize = (0..n).map(|k| k * 100 + i).sum();
        assert_eq!(*v, want as f32, "rank {rank}: host all-reduce between device calls, element {i}");
    }
    // From a thread with no current context (as oxccl-perf's ranks call): an empty call with
    // a stream returns at once, and a host call with a stream synchronises it under the
    // stream's own context (both failed with CUDA_ERROR_INVALID_CONTEXT before).
    let (comm, stream) = (r.comm as usize, r.streams[0] as usize);
    std::thread::spawn(move || {
        let (comm, st) = (comm as ncclComm_t, stream as *mut oxccl::ffi::CUstream_st);
        let none = std::ptr::null_mut::<c_void>();
        ok(ncclAllGather(none, none, 0, DataType::Float32 as i32, comm, st), comm, "empty all-gather, no context");
        let hin = [rank as f32; 8];
        let mut hout = [0f32; 8];
        let (hs, hr) = (hin.as_ptr().cast(), hout.as_mut_ptr().cast());
        ok(ncclAllReduce(hs, hr, 8, DataType::Float32 as i32, 0, comm, st), comm, "host all-reduce, no context");
        let want: usize = (0..n).sum();
        assert!(hout.iter().all(|&v| v == want as f32), "rank {rank}: {hout:?}");
    })
    .join()
    .expect("calls from a thread without a context");
    // A group of mixed collectives on two streams (the ring is a group of its own above).
    ok(ncclGroupStart(), r.comm, "ncclGroupStart");
    let base = next(&mut k);
    let mut grouped = Vec::new();
    for (i, coll) in colls(base).into_iter().take(8).enumerate() {
        grouped.push(r.case(coll, DataType::Float32, Red::Op(ReduceOp::Sum), 300 + i, i % 3 == 0, base + 1 + i, i % 2));
    }
    ok(ncclGroupEnd(), r.comm, "ncclGroupEnd");
    cases.extend(grouped.into_iter().map(Case::fetch));
    finish(&r, &cases);
    drop(cases);
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

fn assert_paths(res: &[(bool, String)], all_reduce: &str) {
    for (i, (_, err)) in res.iter().enumerate() {
        for bad in ["DEADLOCK", "double free", "leaking"] {
            assert!(!err.contains(bad), "rank {i} reported {bad:?}:\n{err}");
        }
        if res.len() > 1 {
            let line = format!("device all_reduce path: {all_reduce}");
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
        }
        // The one-shot IPC flow runs every single call of these on one host (n ≥ 2); across
        // fake hosts, without IPC and on one rank, they are staged.
        let one_shot = [
            Collective::Broadcast { root: 0 },
            Collective::Reduce { root: 0 },
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::Gather { root: 0 },
            Collective::Scatter { root: 0 },
        ];
        let ipc = all_reduce == "ipc";
        for c in one_shot {
            let line = format!("device {} path: {}", c.name(), if ipc { "ipc" } else { "staged" });
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
            if !ipc {
                let wrong = format!("device {} path: ipc", c.name());
                assert!(!err.contains(&wrong), "rank {i}: unexpected {wrong:?}:\n{err}");
            }
        }
        // PreMulSum with a host factor on reduce and reduce-scatter: one-shot IPC on one host;
        // with a factor in device memory: staged everywhere.
        for c in ["reduce", "reduce_scatter"] {
            for (kind, on_ipc) in [("host", ipc), ("device", false)] {
                let line = format!("device {c} premulsum({kind}) path: {}", if on_ipc { "ipc" } else { "staged" });
                assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
            }
        }
        // Send/receive (the ring, a group of its own) and the group of mixed collectives on two
        // streams: through CUDA IPC on one host (n ≥ 2), staged otherwise.
        let how = if ipc { "ipc" } else { "staged" };
        let names = ["send".to_string(), "recv".to_string(), "p2p group".to_string(), "group".to_string()];
        for name in names {
            let line = format!("device {name} path: {how}");
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
            let wrong = format!("device {name} path: {}", if ipc { "staged" } else { "ipc" });
            assert!(!err.contains(&wrong), "rank {i}: unexpected {wrong:?}:\n{err}");
        }
    }
}

#[test]
fn every_collective_on_device_buffers_against_an_f64_reference() {
    if let Some((rank, n, id)) = common::child_role() {
        matrix_rank(rank, n, &id);
        return;
    }
    // (ranks, IPC allowed, fake hosts) -> the all-reduce path every rank must report.
    for (n, ipc, hosts, path) in [
        (1, true, false, ""),
        (2, true, false, "ipc"),
        (3, true, false, "ipc"),
        (4, true, false, "ipc"),
        (3, false, false, "proxy"),
        (4, true, true, "proxy"),
    ] {
        let extra = [
            ("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()),
            ("OXCCL_TEST_FAKE_HOSTS", if hosts { "1" } else { "0" }.to_string()),
        ];
        let t = Instant::now();
        let res =
            run("every_collective_on_device_buffers_against_an_f64_reference", n, &extra, Duration::from_secs(240));
        common::assert_all_ok(&res);
        assert_paths(&res, path);
        eprintln!("device collectives: {n} rank(s), ipc {ipc}, fake hosts {hosts}: {:?}", t.elapsed());
    }
}

/// The same matrix with every stream of the (stand-in) GPU in one FIFO per process
/// (`CUDA_DEVICE_MAX_CONNECTIONS=1`): 2 ranks in IPC mode and 3 through the proxy, exact.
#[test]
fn every_collective_on_one_hardware_queue() {
    if let Some((rank, n, id)) = common::child_role() {
        matrix_rank(rank, n, &id);
        return;
    }
    if common::standin::real_driver() {
        common::skipped("a stand-in mode (CUDA_DEVICE_MAX_CONNECTIONS on the stand-in)");
        return;
    }
    for (n, ipc, path) in [(2, true, "ipc"), (3, false, "proxy")] {
        let extra = [
            ("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()),
            ("OXCCL_TEST_FAKE_HOSTS", "0".to_string()),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1".to_string()),
        ];
        let t = Instant::now();
        let res = run("every_collective_on_one_hardware_queue", n, &extra, Duration::from_secs(120));
        common::assert_all_ok(&res);
        assert_paths(&res, path);
        eprintln!("device collectives on one hardware queue: {n} ranks, ipc {ipc}: {:?}", t.elapsed());
    }
}

/// Elements rank `from` sends to rank `to` in the exchange test: unequal per pair, 0 for some
/// pairs, several 16 KiB blocks (the block at 4 ranks and a 64 KiB area) for others.
fn p2p_count(from: usize, to: usize) -> usize {
    if from != to && (from + 2 * to) % 5 == 0 {
        return 0;
    }
    [3, 1_000, 4_099, 9_001][(from + to) % 4] + 7 * from
}

/// One group per rank: a send to and a receive from every rank, itself included (two messages
/// each way per pair, matched in order as NCCL matches them), with sizes that differ per pair; the sends from one
/// buffer on stream 0, the receives into another on stream 1. Checked against every rank's
/// input, element by element.
fn p2p_rank(rank: usize, n: usize, id: &str) {
    let (r, _ctx) = join(rank, n, id);
    let dt = DataType::Float32;
    let d = dt as i32;
    let sends: Vec<usize> = (0..n).map(|q| p2p_count(rank, q)).collect();
    let recvs: Vec<usize> = (0..n).map(|q| p2p_count(q, rank)).collect();
    let (s_total, r_total) = (sends.iter().sum::<usize>(), recvs.iter().sum::<usize>());
    let (mine, _) = devcase::input(dt, Red::Op(ReduceOp::Sum), rank, s_total, 77);
    let (sbuf, rbuf) = (DevMem::new(s_total * 4), DevMem::new(r_total * 4));
    let (s0, s1) = (r.streams[0], r.streams[1]);
    // On the sends' stream: a synchronous copy from pageable memory is ordered on the legacy
    // stream only, not before work on a non-blocking stream.
    // SAFETY: `sbuf` holds `mine`, which outlives the copy (the streams are synchronised in `finish`).
    assert_eq!(
        unsafe { sys::cuMemcpyHtoDAsync_v2(sbuf.0, mine.as_ptr().cast(), mine.len(), s0) },
        sys::CUresult::CUDA_SUCCESS
    );
    ok(ncclGroupStart(), r.comm, "ncclGroupStart");
    let mut at = 0;
    for (q, &c) in sends.iter().enumerate() {
        let half = c / 2;
        for (off, len) in [(at, half), (at + half, c - half)] {
            let p = (sbuf.0 + (off * 4) as u64) as *const c_void;
            ok(ncclSend(p, len, d, q as i32, r.comm, s0.cast()), r.comm, "ncclSend");
        }
        at += c;
    }
    let mut at = 0;
    for (q, &c) in recvs.iter().enumerate() {
        let half = c / 2;
        for (off, len) in [(at, half), (at + half, c - half)] {
            let p = (rbuf.0 + (off * 4) as u64) as *mut c_void;
            ok(ncclRecv(p, len, d, q as i32, r.comm, s1.cast()), r.comm, "ncclRecv");
        }
        at += c;
    }
    ok(ncclGroupEnd(), r.comm, "ncclGroupEnd");
    let mut got = vec![0u8; r_total * 4];
    // SAFETY: `got` holds the receive buffer; the stream is synchronised before it is read.
    unsafe {
        assert_eq!(
            sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), rbuf.0, got.len(), s1),
            sys::CUresult::CUDA_SUCCESS
        );
    }
    finish(&r, &[]);
    let got = oxccl::reduce::to_f64(dt, &got);
    let mut at = 0;
    for (q, &c) in recvs.iter().enumerate() {
        // Rank q's sends start with its messages to the ranks before this one.
        let first: usize = (0..rank).map(|k| p2p_count(q, k)).sum();
        let (_, theirs) = devcase::input(dt, Red::Op(ReduceOp::Sum), q, first + c, 77);
        for i in 0..c {
            assert_eq!(got[at + i], theirs[first + i], "rank {rank}: from rank {q}, element {i} of {c}");
        }
        at += c;
    }
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

#[test]
fn send_receive_groups_with_unequal_sizes_and_self_sends() {
    if let Some((rank, n, id)) = common::child_role() {
        p2p_rank(rank, n, &id);
        return;
    }
    for (n, ipc, hosts) in [(4, true, false), (3, true, false), (4, true, true)] {
        let extra = [
            ("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()),
            ("OXCCL_TEST_FAKE_HOSTS", if hosts { "1" } else { "0" }.to_string()),
        ];
        let t = Instant::now();
        let res = run("send_receive_groups_with_unequal_sizes_and_self_sends", n, &extra, Duration::from_secs(120));
        common::assert_all_ok(&res);
        let how = if hosts { "staged" } else { "ipc" };
        for (i, (_, err)) in res.iter().enumerate() {
            let line = format!("device p2p group path: {how}");
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
        }
        eprintln!("device send/receive: {n} ranks, fake hosts {hosts}: {:?}", t.elapsed());
    }
}
