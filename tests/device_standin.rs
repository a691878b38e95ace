//! The device path end to end on the CUDA stand-in (`cuda-standin/`, built here with `cc`), or
//! on the real driver when `OXCCL_DEVICE_TESTS_REAL=1` (the GPU check kit, docs/GPU.md): the same tests
//! prove both. Ranks are processes started with the stand-in first on `LD_LIBRARY_PATH`, so
//! cudarc loads it as `libcuda.so` / `libnvrtc.so`; they all share one simulated GPU.
//!
//! Covered: `ncclAllReduce` on device buffers over CUDA IPC and over the proxy, 1..4 ranks,
//! every type with sum and every operator with float32, in and out of place, calls alternating
//! over two and three user streams without host synchronisation between them (each result
//! checked against an f64 reference); which path ran (asserted from the `OXCCL_DEBUG=INFO`
//! line); `kill -9` of a rank mid-call (every survivor's stream completes and the error is
//! reported within 2 s); `ncclCommAbort` from another thread releasing a waiting stream; a
//! failed enqueue (fault injection) failing every rank instead of desynchronising them.

mod common;

use cudarc::driver::{result, sys};
use oxccl::ffi::{
    coll::ncclAllReduce, comm::ncclCommAbort, comm::ncclCommDestroy, comm::ncclCommInitRank,
    config::ncclCommGetAsyncError, ncclComm_t, ncclResult_t, ncclUniqueId,
};
use oxccl::{reduce, DataType, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::standin::{real_driver, standin_env, wait_async_error, DevMem};

fn input(dt: DataType, op: ReduceOp, rank: usize, n: usize, seed: usize) -> Vec<u8> {
    let unsigned = matches!(dt, DataType::Uint8 | DataType::Uint32 | DataType::Uint64);
    let vals: Vec<f64> = (0..n).map(|i| common::input(rank, i, seed, unsigned, op == ReduceOp::Prod)).collect();
    let mut out = vec![0u8; n * dt.size()];
    reduce::from_f64(dt, &vals, &mut out);
    out
}

/// Checks `got` against the f64 reduction of every rank's input.
fn check(dt: DataType, op: ReduceOp, nranks: usize, seed: usize, got: &[u8], what: &str) {
    let n = got.len() / dt.size();
    let ins: Vec<Vec<f64>> = (0..nranks).map(|r| reduce::to_f64(dt, &input(dt, op, r, n, seed))).collect();
    let got = reduce::to_f64(dt, got);
    let bad: Vec<usize> = (0..n)
        .filter(|&i| {
            let want: f64 = ins.iter().map(|v| v[i]).sum();
            op == ReduceOp::Sum && (got[i] - want).abs() > 1e-3 * (1.0 + want.abs())
        })
        .collect();
    if !bad.is_empty() {
        eprintln!("{what}: {} sums wrong, elements {}..={}", bad.len(), bad[0], bad[bad.len() - 1]);
    }
    for i in 0..n {
        let xs: Vec<f64> = ins.iter().map(|v| v[i]).collect();
        let abs: f64 = xs.iter().map(|x| x.abs()).sum();
        let (want, tol) = match op {
            ReduceOp::Sum => (xs.iter().sum::<f64>(), nranks as f64 * common::eps(dt) * abs),
            ReduceOp::Avg if dt.is_float() => (xs.iter().sum::<f64>() / nranks as f64, common::eps(dt) * abs),
            ReduceOp::Avg => ((xs.iter().sum::<f64>() / nranks as f64).trunc(), 0.0),
            ReduceOp::Prod => (xs.iter().product(), 0.0),
            ReduceOp::Max => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
            ReduceOp::Min => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        };
        assert!((got[i] - want).abs() <= tol, "{what}: element {i}: got {} want {want} (tolerance {tol})", got[i]);
    }
}

fn last_error(comm: ncclComm_t) -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(oxccl::ffi::comm::ncclGetLastError(comm)) }.to_string_lossy().into_owned()
}

/// Joins the communicator of this child rank and makes GPU 0's context current.
fn join(rank: usize, n: usize, id_hex: &str) -> (ncclComm_t, Vec<sys::CUstream>, oxccl::device::CtxGuard) {
    assert!(oxccl::device::available(), "rank {rank}: no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let gpu = oxccl::device::gpu(0).unwrap();
    let guard = gpu.enter().unwrap();
    let streams =
        (0..3).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect::<Vec<_>>();
    (comm, streams, guard)
}

/// Every case: (type, op) pairs, placements and two sizes (one crossing IPC chunks).
fn cases() -> Vec<(DataType, ReduceOp, usize, bool)> {
    let mut v = Vec::new();
    let pairs = DataType::ALL
        .iter()
        .map(|&t| (t, ReduceOp::Sum))
        .chain(ReduceOp::ALL.iter().filter(|&&o| o != ReduceOp::Sum).map(|&o| (DataType::Float32, o)));
    for (i, (dt, op)) in pairs.enumerate() {
        for in_place in [false, true] {
            // 65536-byte IPC staging (set by the parent): 20_011 elements cross it for every type
            // but the 1-byte ones, which cross it at 70_001.
            let count = if i % 2 == 0 {
                1_003
            } else if dt.size() == 1 {
                70_001
            } else {
                20_011
            };
            v.push((dt, op, count, in_place));
        }
    }
    v
}

/// One rank: every case enqueued back to back, alternating over `nstreams` streams with no
/// host synchronisation in between, then all checked.
fn matrix_rank(rank: usize, n: usize, id: &str) {
    let nstreams: usize = std::env::var("OXCCL_TEST_STREAMS").unwrap().parse().unwrap();
    let (comm, streams, _ctx) = join(rank, n, id);
    let mut live = Vec::new();
    for (k, (dt, op, count, in_place)) in cases().into_iter().enumerate() {
        let seed = k + 1;
        let data = input(dt, op, rank, count, seed);
        let (send, recv) = (DevMem::new(data.len()), DevMem::new(data.len()));
        let stream = streams[k % nstreams];
        // SAFETY: `send` holds data.len() bytes; `data` lives in `live` until the streams are synchronised.
        unsafe {
            let r = sys::cuMemcpyHtoDAsync_v2(send.0, data.as_ptr().cast(), data.len(), stream);
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        }
        let dst = if in_place { send.0 } else { recv.0 };
        let r = ncclAllReduce(send.0 as *const _, dst as *mut _, count, dt as i32, op as i32, comm, stream.cast());
        assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
        let mut got = vec![0u8; data.len()];
        // SAFETY: `got` outlives the copy (the streams are synchronised below, before checking).
        unsafe {
            let r = sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), dst, got.len(), stream);
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        }
        live.push((dt, op, count, in_place, seed, data, got, send, recv));
    }
    for &s in &streams {
        // SAFETY: live streams of the current context.
        unsafe { result::stream::synchronize(s) }.expect("cuStreamSynchronize");
    }
    for (dt, op, count, in_place, seed, _data, got, _s, _r) in &live {
        let what = format!("rank {rank}/{n} {} {} count {count} in_place {in_place}", dt.name(), op.name());
        check(*dt, *op, n, *seed, got, &what);
    }
    let mut async_err = ncclResult_t::ncclInternalError;
    assert_eq!(ncclCommGetAsyncError(comm, &mut async_err), ncclResult_t::ncclSuccess);
    assert_eq!(async_err, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
    drop(live);
}

fn run(entry: &str, n: usize, extra: &[(&'static str, String)], limit: Duration) -> Vec<(bool, String)> {
    let mut env = standin_env();
    env.extend_from_slice(extra);
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    common::run_ranks(entry, n, &env, limit)
}

/// Prints a child's lines containing `key` (the timings these tests measure).
fn show(stderr: &str, key: &str, label: &str) {
    use std::io::Write;
    for l in stderr.lines().filter(|l| l.contains(key)) {
        let _ = writeln!(std::io::stderr().lock(), "[{label}] {l}");
    }
}

/// The INFO line of the path each rank must report.
fn path_line(ipc: bool) -> &'static str {
    if ipc {
        "device collectives through CUDA IPC"
    } else {
        "device collectives through pinned host staging (proxy)"
    }
}

fn assert_clean(res: &[(bool, String)]) {
    for (i, (_, err)) in res.iter().enumerate() {
        for bad in ["DEADLOCK", "double free", "leaking"] {
            assert!(!err.contains(bad), "rank {i} reported {bad:?}:\n{err}");
        }
    }
}

#[test]
fn all_reduce_matrix_over_ipc_and_proxy_with_alternating_streams() {
    if let Some((rank, n, id)) = common::child_role() {
        matrix_rank(rank, n, &id);
        return;
    }
    for (n, ipc, streams) in [(1, true, 2), (2, true, 2), (3, true, 3), (4, true, 2), (2, false, 3), (3, false, 2)] {
        let extra =
            [("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()), ("OXCCL_TEST_STREAMS", streams.to_string())];
        let t = Instant::now();
        let res =
            run("all_reduce_matrix_over_ipc_and_proxy_with_alternating_streams", n, &extra, Duration::from_secs(300));
        common::assert_all_ok(&res);
        assert_clean(&res);
        if n > 1 {
            for (i, (_, err)) in res.iter().enumerate() {
                assert_eq!(
                    err.matches(path_line(ipc)).count(),
                    1,
                    "rank {i} of {n}: expected one {:?} line:\n{err}",
                    path_line(ipc)
                );
            }
        }
        eprintln!(
            "device matrix: {n} rank(s), {}, {streams} streams: {:?}",
            if ipc { "IPC" } else { "proxy" },
            t.elapsed()
        );
    }
}

/// One all-reduce of `count` float32 on `stream`: returns the enqueue result and the result
/// buffer (valid once the stream is synchronised).
fn one_call(
    comm: ncclComm_t,
    rank: usize,
    count: usize,
    seed: usize,
    stream: sys::CUstream,
) -> (ncclResult_t, DevMem, Vec<u8>) {
    let data = input(DataType::Float32, ReduceOp::Sum, rank, count, seed);
    let buf = DevMem::new(data.len());
    // On the call's stream (a synchronous copy from pageable memory is ordered on the legacy
    // stream only, not before work on this non-blocking one), complete before `data` may go.
    // SAFETY: `buf` holds data.len() bytes; `data` outlives the copy (the stream is synchronised).
    unsafe { result::memcpy_htod_async(buf.0, &data, stream) }.expect("upload");
    sync(stream).expect("upload");
    let r = ncclAllReduce(buf.0 as *const _, buf.0 as *mut _, count, DataType::Float32 as i32, 0, comm, stream.cast());
    (r, buf, data)
}

fn sync(stream: sys::CUstream) -> Result<(), sys::CUresult> {
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.map_err(|e| e.0)
}

/// Sets up the path with one good call (checked), then rank n-1 kills itself with SIGKILL while
/// the others are in their next call: each survivor's stream must complete and the
/// communicator report an error within 2 s (OXCCL_TIMEOUT_MS is 60 s: death is detected, not
/// timed out).
fn kill_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let (r, buf, _) = one_call(comm, rank, 5_000, 1, streams[0]);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    sync(streams[0]).expect("first call");
    let mut got = vec![0u8; 20_000];
    // SAFETY: `buf` holds 20_000 bytes.
    unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
    check(DataType::Float32, ReduceOp::Sum, n, 1, &got, "before the kill");
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: kills this process, as `kill -9` would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    let (r, _buf, _) = one_call(comm, rank, 200_000, 2, streams[0]);
    if r == ncclResult_t::ncclSuccess {
        let _ = sync(streams[0]);
    }
    let e = wait_async_error(comm, Duration::from_secs(10));
    let took = t.elapsed();
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error after a peer was killed");
    assert!(took < Duration::from_secs(2), "rank {rank}: the stream completed and the error showed after {took:?}");
    eprintln!("rank {rank}: peer death reported after {took:?}: {}", last_error(comm));
    // Later calls fail at once.
    let (r, _b, _) = one_call(comm, rank, 10, 3, streams[0]);
    assert_ne!(r, ncclResult_t::ncclSuccess);
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn kill_9_of_a_rank_mid_call_fails_every_survivor_within_2s() {
    if let Some((rank, n, id)) = common::child_role() {
        kill_rank(rank, n, &id);
        return;
    }
    for ipc in [true, false] {
        let extra = [("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()), ("OXCCL_TIMEOUT_MS", "60000".into())];
        let res = run("kill_9_of_a_rank_mid_call_fails_every_survivor_within_2s", 3, &extra, Duration::from_secs(120));
        assert!(!res[2].0, "the killed rank cannot succeed");
        common::assert_all_ok(&res[..2]);
        for (i, (_, err)) in res[..2].iter().enumerate() {
            assert!(err.contains(path_line(ipc)), "rank {i}: wrong path:\n{err}");
            assert!(!err.contains("DEADLOCK"), "rank {i}:\n{err}");
            show(err, "reported after", if ipc { "IPC" } else { "proxy" });
        }
    }
}

/// Rank 0 enqueues a call rank 1 never makes; another thread aborts the communicator 300 ms
/// later: the waiting stream must be released within 2 s (OXCCL_TIMEOUT_MS is 60 s).
fn abort_rank(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let (r, _buf, _) = one_call(comm, rank, 1_000, 1, streams[0]);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    sync(streams[0]).expect("first call");
    if rank != 0 {
        // Wait until rank 0's abort shuts the links, then leave.
        let _ = wait_async_error(comm, Duration::from_secs(3));
        assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
        return;
    }
    let (r, _buf2, _) = one_call(comm, rank, 1_000, 2, streams[1]);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    let c = comm as usize;
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        assert_eq!(ncclCommAbort(c as ncclComm_t), ncclResult_t::ncclSuccess);
        t
    });
    let waited = Instant::now();
    let _ = sync(streams[1]);
    let aborted_at = aborter.join().unwrap();
    let after = aborted_at.elapsed();
    eprintln!("stream released {after:?} after ncclCommAbort (waited {:?})", waited.elapsed());
    assert!(after < Duration::from_secs(2), "the stream was released {after:?} after the abort");
}

#[test]
fn comm_abort_from_another_thread_releases_a_waiting_stream() {
    if let Some((rank, n, id)) = common::child_role() {
        abort_rank(rank, n, &id);
        return;
    }
    for ipc in [true, false] {
        let extra = [("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()), ("OXCCL_TIMEOUT_MS", "60000".into())];
        let res = run("comm_abort_from_another_thread_releases_a_waiting_stream", 2, &extra, Duration::from_secs(120));
        common::assert_all_ok(&res);
        assert!(res[0].1.contains(path_line(ipc)), "{}", res[0].1);
        show(&res[0].1, "after ncclCommAbort", if ipc { "IPC" } else { "proxy" });
    }
}

/// Rank 1's copy for its second call fails (OXCCL_STANDIN_FAIL_COPY): that call returns an
/// error, and instead of pairing with the peers' next call, every rank fails within 2 s.
fn fault_rank(rank: usize, n: usize, id: &str) {
    if rank == 1 {
        // Copies of this process before the second call's first one: proxy: upload, D2H, H2D,
        // download, upload; IPC (2 ranks, 4000 bytes: the one-shot small flow): upload,
        // copy-in, download, upload.
        let nth = if std::env::var("OXCCL_CUDA_IPC").as_deref() == Ok("0") { 6 } else { 5 };
        std::env::set_var("OXCCL_STANDIN_FAIL_COPY", nth.to_string());
    }
    let (comm, streams, _ctx) = join(rank, n, id);
    let (r, buf, _) = one_call(comm, rank, 1_000, 1, streams[0]);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    sync(streams[0]).expect("first call");
    let mut got = vec![0u8; 4_000];
    // SAFETY: `buf` holds 4_000 bytes.
    unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
    let t = Instant::now();
    let (r, _b, _) = one_call(comm, rank, 1_000, 2, streams[0]);
    if rank == 1 {
        assert_ne!(r, ncclResult_t::ncclSuccess, "the injected copy failure must fail the call");
    } else if r == ncclResult_t::ncclSuccess {
        let _ = sync(streams[0]);
    }
    let e = wait_async_error(comm, Duration::from_secs(10));
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error after rank 1 failed to enqueue");
    assert!(t.elapsed() < Duration::from_secs(2), "rank {rank}: error after {:?}", t.elapsed());
    let (r, _b, _) = one_call(comm, rank, 10, 3, streams[0]);
    assert_ne!(r, ncclResult_t::ncclSuccess, "rank {rank}: a later call must fail, not pair with another");
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn a_failed_enqueue_fails_every_rank_instead_of_desynchronising() {
    if real_driver() {
        common::skipped("fault injection needs the CUDA stand-in");
        return;
    }
    if let Some((rank, n, id)) = common::child_role() {
        fault_rank(rank, n, &id);
        return;
    }
    for ipc in [true, false] {
        let extra = [("OXCCL_CUDA_IPC", if ipc { "1" } else { "0" }.to_string()), ("OXCCL_TIMEOUT_MS", "60000".into())];
        let res =
            run("a_failed_enqueue_fails_every_rank_instead_of_desynchronising", 2, &extra, Duration::from_secs(120));
        common::assert_all_ok(&res);
        assert!(res[1].1.contains("OXCCL_STANDIN_FAIL_COPY"), "the fault was not injected:\n{}", res[1].1);
    }
}

/// One checked all-reduce (the PTX fallback test's rank).
fn one_checked_call(rank: usize, n: usize, id: &str) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let (r, buf, _) = one_call(comm, rank, 3_001, 7, streams[0]);
    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
    sync(streams[0]).expect("call");
    let mut got = vec![0u8; 3_001 * 4];
    // SAFETY: `buf` holds 3_001 floats.
    unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
    check(DataType::Float32, ReduceOp::Sum, n, 7, &got, "PTX fallback");
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn a_cubin_the_driver_rejects_falls_back_to_ptx() {
    if real_driver() {
        common::skipped("cubin rejection is injected by the CUDA stand-in");
        return;
    }
    if let Some((rank, n, id)) = common::child_role() {
        one_checked_call(rank, n, &id);
        return;
    }
    let extra = [("OXCCL_STANDIN_REJECT_CUBIN", "1".to_string())];
    let res = run("a_cubin_the_driver_rejects_falls_back_to_ptx", 2, &extra, Duration::from_secs(120));
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        assert!(err.contains("rejecting cubin"), "rank {i}: the cubin was not rejected:\n{err}");
        assert!(err.contains("loading PTX instead"), "rank {i}: no PTX fallback:\n{err}");
    }
}

/// A driver older than NVRTC refuses the cubin, and would refuse NVRTC's PTX too: no PTX fallback
/// is tried; the kernels' error names both versions and what to install, and the calls run on
/// the host-staged path with a WARN line saying so, with correct results.
#[test]
fn a_cubin_refused_by_an_older_driver_names_both_versions_and_runs_staged() {
    if real_driver() {
        common::skipped("cubin rejection and the driver version are injected by the CUDA stand-in");
        return;
    }
    if let Some((rank, n, id)) = common::child_role() {
        one_checked_call(rank, n, &id);
        return;
    }
    let extra =
        [("OXCCL_STANDIN_REJECT_CUBIN", "1".to_string()), ("OXCCL_STANDIN_DRIVER_VERSION", "12080".to_string())];
    let res = run(
        "a_cubin_refused_by_an_older_driver_names_both_versions_and_runs_staged",
        2,
        &extra,
        Duration::from_secs(120),
    );
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        let warn = err.lines().find(|l| l.contains("WARN") && l.contains("pinned host staging (proxy)")).unwrap_or("");
        assert!(
            warn.contains("CUDA 12.8") && warn.contains("NVRTC 13.0") && warn.contains("PTX from an NVRTC newer"),
            "rank {i}: no WARN naming both versions:\n{err}"
        );
        assert!(!err.contains("loading PTX instead"), "rank {i}: a PTX fallback that cannot work was tried:\n{err}");
    }
}

/// A C program against nccl.h and the CUDA runtime (ffi-tests/cuda_allreduce.c), linked with
/// liboxccl and the stand-in's libcudart (or the real one on a GPU machine).
#[test]
fn c_program_against_the_cuda_runtime() {
    let env = standin_env();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = common::cprog::lib_dir();
    assert!(lib.join("liboxccl.so").exists(), "liboxccl.so not found in {}", lib.display());
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ffi-cuda_allreduce");
    let mut cc = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg(format!("-I{}", root.join("include").display()))
        .arg(root.join("ffi-tests/cuda_allreduce.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-loxccl");
    if real_driver() {
        // The CUDA toolkit's header and libcudart (CUDA_HOME, default /usr/local/cuda).
        let home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".into());
        cc.arg(format!("-I{home}/include")).arg(format!("-L{home}/lib64")).arg("-lcudart");
    } else {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
        cc.arg(format!("-I{}", root.join("cuda-standin/include").display()))
            .arg(format!("-L{}", dir.display()))
            .arg("-lcudart");
    }
    assert!(cc.status().expect("run cc").success(), "compiling ffi-tests/cuda_allreduce.c failed");
    for n in ["1", "3"] {
        let mut c = std::process::Command::new(&exe);
        c.arg(n)
            .env("OXCCL_SOCKET_IFNAME", "lo")
            .env("OXCCL_TIMEOUT_MS", "60000")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in &env {
            c.env(k, v);
        }
        let res = common::wait_all(vec![c.spawn().expect("run the C program")], Duration::from_secs(120));
        common::assert_all_ok(&res);
    }
}
