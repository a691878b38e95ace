//! Every collective on device buffers, on the CUDA stand-in (`cuda-standin/`, built here with
//! `cc`), or on the real driver when `OXCCL_DEVICE_TESTS_REAL=1` (scripts/gpu-check.sh).
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
//! `OXCCL_DEBUG=INFO` lines: on one host, IPC for all-reduce and the one-shot IPC flow for the
//! other collectives (groups and send/receive staged); across fake hosts (`OXCCL_HOSTID`) and
//! without IPC, the proxy for all-reduce and staged for everything else. `kill -9` of a rank
//! during a device broadcast fails every survivor within 2 s, SIGSTOP during a device
//! all-gather within OXCCL_TIMEOUT_MS + 1 s, both on the IPC and on the staged path; a device
//! group that fails its checks on the proxy thread releases the stream and reports the error.

mod common;

use cudarc::driver::{result, sys};
use oxccl::ffi::coll::{
    ncclAllGather, ncclAllReduce, ncclAlltoAll, ncclBroadcast, ncclGather, ncclRecv, ncclReduce, ncclReduceScatter,
    ncclScatter, ncclSend,
};
use oxccl::ffi::group::{ncclGroupEnd, ncclGroupStart};
use oxccl::ffi::premul::ncclRedOpCreatePreMulSum;
use oxccl::ffi::{
    comm::ncclCommDestroy, comm::ncclCommInitRank, config::ncclCommGetAsyncError, ncclComm_t, ncclResult_t,
    ncclUniqueId,
};
use oxccl::{reduce, Collective, DataType, ReduceOp};
use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::standin::{standin_env, wait_async_error, DevMem};

fn ok(r: ncclResult_t, comm: ncclComm_t, what: &str) {
    assert_eq!(r, ncclResult_t::ncclSuccess, "{what}: {}", last_error(comm));
}

fn last_error(comm: ncclComm_t) -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(oxccl::ffi::comm::ncclGetLastError(comm)) }.to_string_lossy().into_owned()
}

/// How a case reduces: a built-in operator, or PreMulSum with scalar `0.5 * (rank + 1)` on the
/// host or in device memory.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Red {
    Op(ReduceOp),
    PreMulHost,
    PreMulDevice,
}

impl Red {
    fn name(self) -> String {
        match self {
            Red::Op(o) => o.name().to_string(),
            Red::PreMulHost => "premulsum(host)".into(),
            Red::PreMulDevice => "premulsum(device)".into(),
        }
    }
}

fn scalar(rank: usize) -> f64 {
    0.5 * (rank + 1) as f64
}

/// Rank `rank`'s input for a case: `len` elements, as stored in `dt` and decoded back.
fn input(dt: DataType, red: Red, rank: usize, len: usize, seed: usize) -> (Vec<u8>, Vec<f64>) {
    let prod = red == Red::Op(ReduceOp::Prod);
    let vals: Vec<f64> = (0..len).map(|i| common::input(rank, i, seed, false, prod)).collect();
    let mut bytes = vec![0u8; len * dt.size()];
    reduce::from_f64(dt, &vals, &mut bytes);
    let exact = reduce::to_f64(dt, &bytes);
    (bytes, exact)
}

/// The f64 reduction of `xs` (one value per rank) and its tolerance.
fn reduce_ref(dt: DataType, red: Red, xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let abs: f64 = xs.iter().map(|x| x.abs()).sum();
    let eps = common::eps(dt);
    match red {
        Red::Op(ReduceOp::Sum) => (xs.iter().sum(), n * eps * abs),
        Red::Op(ReduceOp::Avg) if dt.is_float() => (xs.iter().sum::<f64>() / n, 2.0 * eps * abs),
        Red::Op(ReduceOp::Avg) => ((xs.iter().sum::<f64>() / n).trunc(), 0.0),
        Red::Op(ReduceOp::Prod) => (xs.iter().product(), n * eps * xs.iter().product::<f64>().abs()),
        Red::Op(ReduceOp::Max) => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
        Red::Op(ReduceOp::Min) => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        Red::PreMulHost | Red::PreMulDevice => {
            let s: Vec<f64> = xs.iter().enumerate().map(|(k, x)| scalar(k) * x).collect();
            (s.iter().sum(), 2.0 * n * eps * s.iter().map(|x| x.abs()).sum::<f64>())
        }
    }
}

/// What rank `rank` must hold after `coll` (`None`: its receive buffer is not written), from
/// every rank's full input (`n * count` elements each).
fn expected(
    coll: Collective,
    red: Red,
    dt: DataType,
    ins: &[Vec<f64>],
    rank: usize,
    count: usize,
) -> Option<Vec<(f64, f64)>> {
    let n = ins.len();
    let red_at = |j: usize| reduce_ref(dt, red, &ins.iter().map(|v| v[j]).collect::<Vec<_>>());
    let exact = |x: f64| (x, 0.0);
    Some(match coll {
        Collective::AllReduce => (0..count).map(red_at).collect(),
        Collective::Broadcast { root } => (0..count).map(|i| exact(ins[root][i])).collect(),
        Collective::Reduce { root } if root == rank => (0..count).map(red_at).collect(),
        Collective::AllGather => (0..n * count).map(|j| exact(ins[j / count][j % count])).collect(),
        Collective::ReduceScatter => (0..count).map(|i| red_at(rank * count + i)).collect(),
        Collective::AllToAll => (0..n * count).map(|j| exact(ins[j / count][rank * count + j % count])).collect(),
        Collective::Gather { root } if root == rank => {
            (0..n * count).map(|j| exact(ins[j / count][j % count])).collect()
        }
        Collective::Scatter { root } => (0..count).map(|i| exact(ins[root][rank * count + i])).collect(),
        Collective::Recv { peer } => (0..count).map(|i| exact(ins[peer][i])).collect(),
        _ => return None,
    })
}

/// One enqueued case and what to check once the streams are synchronised.
struct Case {
    what: String,
    want: Option<Vec<(f64, f64)>>,
    dt: DataType,
    got: Vec<u8>,
    /// Where the result is, and the stream that wrote it.
    out: u64,
    stream: sys::CUstream,
    _src: Vec<u8>,
    _mem: Vec<DevMem>,
}

impl Case {
    /// Enqueues the copy of the result back to the host (after the call on its stream).
    fn fetch(mut self) -> Case {
        let len = self.want.as_ref().map_or(0, |w| w.len()) * self.dt.size();
        self.got = vec![0u8; len];
        if len > 0 {
            // SAFETY: `got` lives in the case until the streams are synchronised.
            let r = unsafe { sys::cuMemcpyDtoHAsync_v2(self.got.as_mut_ptr().cast(), self.out, len, self.stream) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        }
        self
    }
}

/// The streams, the device scalars of the PreMulSum operators and the communicator of a rank.
struct Rank {
    comm: ncclComm_t,
    rank: usize,
    n: usize,
    streams: Vec<sys::CUstream>,
    host_dummy: Vec<u8>,
    dev_scalars: Vec<DevMem>,
}

impl Rank {
    /// The operator argument of `red` for `dt` (creates PreMulSum operators as needed).
    fn op_arg(&mut self, red: Red, dt: DataType) -> i32 {
        match red {
            Red::Op(o) => o as i32,
            Red::PreMulHost | Red::PreMulDevice => {
                let mut bytes = vec![0u8; dt.size()];
                reduce::from_f64(dt, &[scalar(self.rank)], &mut bytes);
                let mut op = 0;
                let r = if red == Red::PreMulHost {
                    ncclRedOpCreatePreMulSum(&mut op, bytes.as_mut_ptr().cast(), dt as i32, 1, self.comm)
                } else {
                    let m = DevMem::new(8);
                    // SAFETY: `m` holds 8 bytes, the scalar at most 8.
                    unsafe { result::memcpy_htod_sync(m.0, &bytes) }.expect("scalar upload");
                    let r = ncclRedOpCreatePreMulSum(&mut op, m.0 as *mut c_void, dt as i32, 0, self.comm);
                    self.dev_scalars.push(m);
                    r
                };
                ok(r, self.comm, "ncclRedOpCreatePreMulSum");
                op
            }
        }
    }

    /// Enqueues `coll` on stream `s` (the ring: a send and a receive in a group) and returns its
    /// check; [`Case::fetch`] then enqueues the copy of its result.
    #[allow(clippy::too_many_arguments)]
    fn case(
        &mut self,
        coll: Collective,
        dt: DataType,
        red: Red,
        count: usize,
        in_place: bool,
        seed: usize,
        s: usize,
    ) -> Case {
        let (rank, n, comm) = (self.rank, self.n, self.comm);
        let es = dt.size();
        let ins: Vec<Vec<f64>> = (0..n).map(|k| input(dt, red, k, n * count, seed).1).collect();
        let (mine, _) = input(dt, red, rank, n * count, seed);
        let (sc, rc) = match coll {
            Collective::Send { .. } => (count, count), // the ring both sends and receives
            c => c.buffer_counts(rank, n, count),
        };
        let blk = count * es;
        let stream = self.streams[s];
        let upload = |dst: u64, src: &[u8]| {
            // SAFETY: `dst` holds `src.len()` bytes; `mine` lives until the case is checked.
            let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        };
        let mut mem = Vec::new();
        // (send, recv, where the result is, its length in bytes)
        let (send, recv, out): (u64, u64, u64) = if in_place {
            let big = DevMem::new(n * blk);
            let b = big.0;
            let (send, recv) = match coll {
                Collective::AllGather => (b + (rank * blk) as u64, b),
                Collective::Gather { root } if root == rank => (b + (rank * blk) as u64, b),
                Collective::ReduceScatter => (b, b + (rank * blk) as u64),
                Collective::Scatter { root } if root == rank => (b, b + (rank * blk) as u64),
                _ => (b, b),
            };
            if sc > 0 {
                upload(send, &mine[..sc * es]);
            }
            mem.push(big);
            (send, recv, recv)
        } else {
            let sbuf = DevMem::new(sc * es);
            let rbuf = DevMem::new(rc.max(count) * es);
            if sc > 0 {
                upload(sbuf.0, &mine[..sc * es]);
            }
            // Buffers NCCL ignores on this rank: NULL send, host-memory receive.
            let send = if sc > 0 { sbuf.0 } else { 0 };
            let recv = if rc > 0 { rbuf.0 } else { self.host_dummy.as_mut_ptr() as u64 };
            let out = rbuf.0;
            mem.push(sbuf);
            mem.push(rbuf);
            (send, recv, out)
        };
        let op = self.op_arg(red, dt);
        let (sp, rp, st) = (send as *const c_void, recv as *mut c_void, stream.cast());
        let d = dt as i32;
        let r = match coll {
            Collective::AllReduce => ncclAllReduce(sp, rp, count, d, op, comm, st),
            Collective::Broadcast { root } => ncclBroadcast(sp, rp, count, d, root as i32, comm, st),
            Collective::Reduce { root } => ncclReduce(sp, rp, count, d, op, root as i32, comm, st),
            Collective::AllGather => ncclAllGather(sp, rp, count, d, comm, st),
            Collective::ReduceScatter => ncclReduceScatter(sp, rp, count, d, op, comm, st),
            Collective::AllToAll => ncclAlltoAll(sp, rp, count, d, comm, st),
            Collective::Gather { root } => ncclGather(sp, rp, count, d, root as i32, comm, st),
            Collective::Scatter { root } => ncclScatter(sp, rp, count, d, root as i32, comm, st),
            Collective::Recv { .. } | Collective::Send { .. } => {
                // The ring: send to the right, receive from the left, in one group.
                let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
                ok(ncclGroupStart(), comm, "ncclGroupStart");
                ok(ncclSend(sp, count, d, right as i32, comm, st), comm, "ncclSend");
                // In place: the receive overwrites the buffer the send reads (staged, so safe).
                ok(ncclRecv(rp, count, d, left as i32, comm, st), comm, "ncclRecv");
                ncclGroupEnd()
            }
        };
        let what = format!(
            "rank {rank}/{n} {} {} {} count {count} in_place {in_place} stream {s}",
            coll.name(),
            dt.name(),
            red.name()
        );
        ok(r, comm, &what);
        let check_coll = match coll {
            Collective::Send { .. } | Collective::Recv { .. } => Collective::Recv { peer: (rank + n - 1) % n },
            c => c,
        };
        let want = expected(check_coll, red, dt, &ins, rank, count);
        // `mine` outlives its asynchronous upload: it is kept with the case.
        Case { what, want, dt, got: Vec::new(), out, stream, _src: mine, _mem: mem }
    }
}

fn check(c: &Case) {
    let Some(want) = &c.want else { return };
    let got = reduce::to_f64(c.dt, &c.got);
    assert_eq!(got.len(), want.len(), "{}", c.what);
    for (i, (g, (w, tol))) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= *tol, "{}: element {i}: got {g} want {w} (tolerance {tol})", c.what);
    }
}

fn join(rank: usize, n: usize, id_hex: &str) -> (Rank, oxccl::device::CtxGuard) {
    if std::env::var("OXCCL_TEST_FAKE_HOSTS").is_ok_and(|v| v == "1") {
        // Two fake hosts: ranks 0, 2 on one, 1, 3 on the other.
        std::env::set_var("OXCCL_HOSTID", format!("fake-host-{}", rank % 2));
    }
    assert!(oxccl::device::available(), "rank {rank}: no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let guard = oxccl::device::gpu(0).unwrap().enter().unwrap();
    let streams =
        (0..2).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect::<Vec<_>>();
    (Rank { comm, rank, n, streams, host_dummy: vec![0u8; 64], dev_scalars: Vec::new() }, guard)
}

fn finish(r: &Rank, cases: &[Case]) {
    for &s in &r.streams {
        // SAFETY: live streams of the current context.
        unsafe { result::stream::synchronize(s) }.expect("cuStreamSynchronize");
    }
    cases.iter().for_each(check);
    let mut e = ncclResult_t::ncclInternalError;
    assert_eq!(ncclCommGetAsyncError(r.comm, &mut e), ncclResult_t::ncclSuccess);
    assert_eq!(e, ncclResult_t::ncclSuccess, "{}", last_error(r.comm));
}

const TYPES: [DataType; 4] = [DataType::Float32, DataType::Float16, DataType::Bfloat16, DataType::Int32];

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

/// The tests of this file start their ranks one test at a time (all ranks share one simulated
/// GPU; parallel tests on a loaded 2-core machine only add noise).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(entry: &str, n: usize, extra: &[(&'static str, String)], limit: Duration) -> Vec<(bool, String)> {
    let _one = serial();
    let mut env = standin_env();
    env.extend_from_slice(extra);
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    common::run_ranks(entry, n, &env, limit)
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
        // Send/receive (groups) always take the staged path.
        for c in [Collective::Send { peer: 0 }, Collective::Recv { peer: 0 }] {
            let line = format!("device {} path: staged", c.name());
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
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

/// One good broadcast (checked), then rank n-1 kills itself with SIGKILL while the
/// others are in their next broadcast: every survivor's stream completes and the error shows
/// within 2 s (OXCCL_TIMEOUT_MS is 60 s: the death is detected, not timed out).
fn kill_rank(rank: usize, n: usize, id: &str) {
    let (mut r, _ctx) = join(rank, n, id);
    let c =
        r.case(Collective::Broadcast { root: 0 }, DataType::Float32, Red::Op(ReduceOp::Sum), 5_000, true, 1, 0).fetch();
    finish(&r, &[c]);
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: kills this process, as `kill -9` would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    let buf = DevMem::new(4 << 20);
    let st = r.streams[0];
    let res = ncclBroadcast(
        buf.0 as *const c_void,
        buf.0 as *mut c_void,
        1 << 20,
        DataType::Float32 as i32,
        0,
        r.comm,
        st.cast(),
    );
    if res == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        let _ = unsafe { result::stream::synchronize(st) };
    }
    let e = wait_async_error(r.comm, Duration::from_secs(10));
    let took = t.elapsed();
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error after a peer was killed");
    assert!(took < Duration::from_secs(2), "rank {rank}: the stream completed and the error showed after {took:?}");
    eprintln!("rank {rank}: peer death reported after {took:?}: {}", last_error(r.comm));
    r.dev_scalars.clear();
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

#[test]
fn kill_9_of_a_rank_during_a_device_collective_fails_every_survivor_within_2s() {
    if let Some((rank, n, id)) = common::child_role() {
        kill_rank(rank, n, &id);
        return;
    }
    let entry = "kill_9_of_a_rank_during_a_device_collective_fails_every_survivor_within_2s";
    // One host: the one-shot IPC broadcast (the watchdog sees the death); fake hosts: staged.
    for (hosts, path) in [("0", "ipc"), ("1", "staged")] {
        let extra = [("OXCCL_TIMEOUT_MS", "60000".to_string()), ("OXCCL_TEST_FAKE_HOSTS", hosts.to_string())];
        let res = run(entry, 3, &extra, Duration::from_secs(120));
        assert!(!res[2].0, "the killed rank cannot succeed");
        common::assert_all_ok(&res[..2]);
        for (i, (_, err)) in res[..2].iter().enumerate() {
            let line = format!("device broadcast path: {path}");
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
            assert!(!err.contains("DEADLOCK"), "rank {i}:\n{err}");
        }
    }
}

/// The OXCCL_TIMEOUT_MS of the SIGSTOP tests.
const STOP_TIMEOUT: Duration = Duration::from_millis(3000);

/// One good all-gather (checked), then rank n-1 stops itself with SIGSTOP (alive, silent)
/// while the others are in their next all-gather: every survivor's stream completes and the
/// error shows within OXCCL_TIMEOUT_MS + 1 s of the call. On one host the all-gather runs the
/// one-shot IPC flow (the watchdog times it out); across fake hosts it is staged (the host
/// links time out on the proxy thread).
fn stop_rank(rank: usize, n: usize, id: &str) {
    let (mut r, _ctx) = join(rank, n, id);
    let c = r.case(Collective::AllGather, DataType::Float32, Red::Op(ReduceOp::Sum), 3_000, false, 1, 0).fetch();
    finish(&r, &[c]);
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: stops this process, as `kill -STOP` would; the parent kills it at the end.
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        unreachable!("rank {rank} was continued");
    }
    let t = Instant::now();
    let (send, recv) = (DevMem::new(1 << 20), DevMem::new(n << 20));
    let st = r.streams[0];
    let res = ncclAllGather(
        send.0 as *const c_void,
        recv.0 as *mut c_void,
        1 << 18,
        DataType::Float32 as i32,
        r.comm,
        st.cast(),
    );
    if res == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        let _ = unsafe { result::stream::synchronize(st) };
    }
    let e = wait_async_error(r.comm, STOP_TIMEOUT + Duration::from_secs(10));
    let took = t.elapsed();
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error while a peer was stopped");
    let bound = STOP_TIMEOUT + Duration::from_secs(1);
    assert!(took < bound, "rank {rank}: the stream completed and the error showed after {took:?} (bound {bound:?})");
    eprintln!("rank {rank}: stopped peer reported after {took:?}: {}", last_error(r.comm));
    r.dev_scalars.clear();
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

/// Runs `stop_rank` on 3 ranks: waits for the two survivors, then kills the stopped rank.
fn run_stopped(fake_hosts: bool, path: &str) {
    let entry = "sigstop_of_a_rank_during_a_device_collective_fails_every_survivor_within_timeout_plus_1s";
    let _one = serial();
    let mut env = standin_env();
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    env.push(("OXCCL_TIMEOUT_MS", STOP_TIMEOUT.as_millis().to_string()));
    env.push(("OXCCL_TEST_FAKE_HOSTS", if fake_hosts { "1" } else { "0" }.into()));
    let mut children = common::spawn_ranks(entry, 3, &env);
    let mut stopped = children.pop().expect("three ranks");
    let start = Instant::now();
    while children.iter_mut().any(|c| c.try_wait().ok().flatten().is_none())
        && start.elapsed() < Duration::from_secs(90)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = stopped.kill();
    let _ = stopped.wait();
    let res = common::wait_all(children, Duration::from_secs(5));
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        let line = format!("device all_gather path: {path}");
        assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
        let Some(report) = err.lines().find(|l| l.contains("stopped peer reported after")) else {
            panic!("rank {i}: no report:\n{err}")
        };
        eprintln!("{path}: {report}");
        assert!(!err.contains("DEADLOCK"), "rank {i}:\n{err}");
    }
}

#[test]
fn sigstop_of_a_rank_during_a_device_collective_fails_every_survivor_within_timeout_plus_1s() {
    if let Some((rank, n, id)) = common::child_role() {
        stop_rank(rank, n, &id);
        return;
    }
    run_stopped(false, "ipc");
    run_stopped(true, "staged");
}

/// A device group whose plan fails its checks on the proxy thread (a send to itself without
/// the matching receive): the stream is released and the communicator reports the error.
fn unpaired_rank(rank: usize, n: usize, id: &str) {
    let (r, _ctx) = join(rank, n, id);
    let buf = DevMem::new(4096);
    let st = r.streams[0];
    ok(ncclGroupStart(), r.comm, "ncclGroupStart");
    let sent = ncclSend(buf.0 as *const c_void, 1024, DataType::Float32 as i32, rank as i32, r.comm, st.cast());
    ok(sent, r.comm, "ncclSend");
    let ended = ncclGroupEnd();
    if ended == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(st) }.expect("the stream must be released");
    }
    let e = wait_async_error(r.comm, Duration::from_secs(10));
    assert!(ended != ncclResult_t::ncclSuccess || e != ncclResult_t::ncclSuccess, "no error reported");
    let msg = last_error(r.comm);
    assert!(msg.contains("send(s) to itself"), "unexpected error: {msg}");
    eprintln!("rank {rank}: unpaired device send to itself: {msg}");
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

#[test]
fn an_unpaired_device_send_to_itself_in_a_group_is_reported() {
    if let Some((rank, n, id)) = common::child_role() {
        unpaired_rank(rank, n, &id);
        return;
    }
    let res = run("an_unpaired_device_send_to_itself_in_a_group_is_reported", 1, &[], Duration::from_secs(60));
    common::assert_all_ok(&res);
}
