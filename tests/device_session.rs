//! Device calls in their session (`comm/session.rs`, `device/run.rs`), on the CUDA stand-in:
//! each call, or each communicator's part of a group, has an entry in the flight record's device
//! ring (name, count, type, peers; done once enqueued, failed with its error when refused), and
//! two threads' device calls on one communicator at once are refused, as host calls are: the
//! second caller gets `ncclInvalidUsage` and the communicator is failed.

mod common;

use common::standin::{standin_env, DevMem};
use cudarc::driver::{result, sys};
use oxccl::device::DevOp;
use oxccl::{Collective, Communicator, DataType, ErrorKind, ReduceOp, UniqueId};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// A device call of `coll` from `send` to `recv` (`count` floats, sum).
fn op(coll: Collective, send: u64, recv: u64, count: usize) -> DevOp {
    DevOp { coll, send, recv, count, dtype: DataType::Float32, op: ReduceOp::Sum, scale: None }
}

fn upload(dst: u64, data: &[f32], stream: sys::CUstream) {
    // SAFETY: every caller's `dst` holds `data`; the stream is synchronised before returning.
    unsafe { result::memcpy_htod_async(dst, data, stream) }.expect("upload");
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.expect("synchronize");
}

fn download(src: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    // SAFETY: every caller's `src` holds `n` floats, written by synchronised streams.
    unsafe { result::memcpy_dtoh_sync(&mut out, src) }.expect("download");
    out
}

/// One rank: an all-reduce, a broadcast and a send/receive group on device buffers (results
/// checked); on rank 0 an all-reduce on GPU 1's memory, which the communicator (on GPU 0)
/// refuses; then one more all-reduce, a host barrier, and `abort` (which writes the dump).
fn recorded_rank(rank: usize, n: usize, id: &str) {
    let comm = Arc::new(Communicator::init_rank(n, &UniqueId::from_hex(id).unwrap(), rank).unwrap());
    let gpu = oxccl::device::gpu(0).unwrap();
    let ctx = gpu.enter().unwrap();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let s = stream as *mut std::ffi::c_void;
    let mem = DevMem::new(4096);
    let (a, b, c, d) = (mem.0, mem.0 + 512, mem.0 + 1024, mem.0 + 1536);
    let r = rank as f32;
    upload(a, &[r + 1.0, r + 2.0, r + 3.0, r + 4.0], stream);
    // SAFETY (every launch): the buffers are pieces of `mem`, which outlives the synchronised
    // stream; each piece holds the call's count.
    unsafe { comm.launch(op(Collective::AllReduce, a, b, 2), s) }.unwrap();
    unsafe { comm.launch(op(Collective::Broadcast { root: 0 }, a, c, 4), s) }.unwrap();
    let peer = (rank + 1) % n;
    let call = |coll, send: u64, recv: u64| oxccl::Call {
        coll,
        send: send as *const std::ffi::c_void,
        recv: recv as *mut std::ffi::c_void,
        count: 3,
        dtype: DataType::Float32,
        reduction: oxccl::Reduction::Builtin(ReduceOp::Sum),
        stream: s,
    };
    oxccl::call::start_group();
    let sent = unsafe { oxccl::call::submit(&comm, &call(Collective::Send { peer }, a, 0)) };
    let got = unsafe { oxccl::call::submit(&comm, &call(Collective::Recv { peer }, 0, d)) };
    let ended = oxccl::call::end_group();
    (sent.and(got).and(ended)).unwrap();
    // SAFETY: a live stream.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    let sum = |k: f32| (0..n).map(|q| q as f32 + k).sum::<f32>();
    assert_eq!(download(b, 2), vec![sum(1.0), sum(2.0)], "all-reduce");
    assert_eq!(download(c, 4), vec![1.0, 2.0, 3.0, 4.0], "broadcast from rank 0");
    let p = peer as f32;
    assert_eq!(download(d, 3), vec![p + 1.0, p + 2.0, p + 3.0], "receive from rank {peer}");
    if rank == 0 {
        let other = oxccl::device::gpu(1).unwrap();
        let e = {
            let _ctx1 = other.enter().unwrap();
            let far = DevMem::new(64);
            // SAFETY: `far` holds 2 floats; the call is refused before anything is enqueued.
            let e = unsafe { comm.launch(op(Collective::AllReduce, far.0, far.0, 2), std::ptr::null_mut()) };
            drop(far);
            e.expect_err("a call on another GPU than the communicator's")
        };
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{}", e.message());
        assert!(e.message().contains("this call's on GPU 1"), "{}", e.message());
        assert!(comm.async_error().is_none(), "a refused call does not fail the communicator");
    }
    // SAFETY: as above.
    unsafe { comm.launch(op(Collective::AllReduce, a, b, 4), s) }.unwrap();
    // SAFETY: a live stream.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    assert_eq!(download(b, 4), (1..=4).map(|k| sum(k as f32)).collect::<Vec<_>>(), "last all-reduce");
    // Every rank's device work is done before any rank aborts.
    let mut all = [0f64];
    comm.all_reduce(&[1.0], &mut all, ReduceOp::Sum).unwrap();
    assert_eq!(all[0], n as f64);
    comm.abort();
    drop(ctx);
}

/// The device ring of rank `rank`'s dump in `dir`, each entry a line.
fn device_ops(dir: &std::path::Path, rank: usize) -> Vec<String> {
    let suffix = format!("-rank{rank}.json");
    let file = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().ends_with(&suffix))
        .unwrap_or_else(|| panic!("no dump of rank {rank} in {}", dir.display()));
    let text = std::fs::read_to_string(&file).unwrap();
    let (_, device) = text.split_once("\"device_ops\":[").unwrap_or_else(|| panic!("no device_ops: {text}"));
    device.lines().filter(|l| l.contains("\"seq\":")).map(str::to_string).collect()
}

#[test]
fn device_calls_are_in_the_flight_record() {
    if let Some((rank, n, id)) = common::child_role() {
        recorded_rank(rank, n, &id);
        return;
    }
    let dir = std::env::temp_dir().join(format!("oxccl-device-session-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut env = standin_env();
    env.extend([
        ("OXCCL_STANDIN_DEVICES", "2".to_string()),
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_DUMP", dir.display().to_string()),
    ]);
    let res = common::run_ranks("device_calls_are_in_the_flight_record", 2, &env, Duration::from_secs(120));
    common::assert_all_ok(&res);
    for rank in 0..2 {
        let ops = device_ops(&dir, rank);
        let peer = 1 - rank;
        let want = |seq: usize, what: &str, count: usize, ty: &str, state: &str| {
            format!("\"seq\":{seq},\"op\":\"{what}\",\"count\":{count},\"type\":\"{ty}\",\"peers\":[{peer}],\"state\":\"{state}\"")
        };
        let mut expect = vec![
            want(1, "all_reduce", 2, "float", "done"),
            want(2, "broadcast", 4, "float", "done"),
            want(3, "group(send, recv)", 0, "-", "done"),
        ];
        if rank == 0 {
            expect.push(want(4, "all_reduce", 2, "float", "failed"));
        }
        expect.push(want(expect.len() + 1, "all_reduce", 4, "float", "done"));
        assert_eq!(ops.len(), expect.len(), "rank {rank}: {ops:#?}");
        for (line, w) in ops.iter().zip(&expect) {
            assert!(line.contains(w), "rank {rank}: want {w} in\n{line}");
        }
        if rank == 0 {
            assert!(ops[3].contains("this call's on GPU 1"), "the refusal's error is recorded: {}", ops[3]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rank 0: two threads make the communicator's first device call at once. The first device
/// call sets up the device state, which waits for rank 1 (which makes no device call), so
/// whichever thread comes second finds the first still in its call. Rank 1 waits (bounded)
/// until rank 0 says it is done (the file `OXCCL_TEST_DONE_FILE`), then aborts.
fn concurrent_rank(rank: usize, n: usize, id: &str) {
    let comm = Arc::new(Communicator::init_rank(n, &UniqueId::from_hex(id).unwrap(), rank).unwrap());
    let done = std::path::PathBuf::from(std::env::var("OXCCL_TEST_DONE_FILE").unwrap());
    if rank != 0 {
        let t = Instant::now();
        while !done.exists() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(5));
        }
        comm.abort();
        return;
    }
    let gpu = oxccl::device::gpu(0).unwrap();
    let start = Barrier::new(2);
    let t = Instant::now();
    let results: Vec<oxccl::Result<()>> = std::thread::scope(|sc| {
        let calls: Vec<_> = (0..2)
            .map(|_| {
                sc.spawn(|| {
                    let _ctx = gpu.enter().unwrap();
                    let mem = DevMem::new(64);
                    start.wait();
                    // SAFETY: `mem` holds 2 floats; nothing is left enqueued (both calls fail
                    // before they enqueue: one refused, the other in the set-up).
                    unsafe { comm.launch(op(Collective::AllReduce, mem.0, mem.0, 2), std::ptr::null_mut()) }
                })
            })
            .collect();
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = t.elapsed();
    let refused: Vec<&oxccl::Error> = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|e| e.message().starts_with("rank 0: all_reduce was called while another thread's call"))
        .collect();
    assert_eq!(refused.len(), 1, "exactly one of the two calls is refused: {results:?}");
    assert_eq!(refused[0].kind(), ErrorKind::InvalidUsage, "{}", refused[0].message());
    assert!(results.iter().all(|r| r.is_err()), "the call that was running stops too: {results:?}");
    assert!(took < Duration::from_secs(10), "both calls ended after {took:?}");
    let _ctx = gpu.enter().unwrap();
    let mem = DevMem::new(64);
    // SAFETY: as above.
    let later = unsafe { comm.launch(op(Collective::AllReduce, mem.0, mem.0, 2), std::ptr::null_mut()) };
    let e = later.expect_err("the communicator is failed");
    assert!(e.message().contains("failed earlier"), "{}", e.message());
    eprintln!("rank 0: both calls ended after {took:?}: {results:?}");
    comm.abort();
    std::fs::write(&done, b"done").unwrap();
}

#[test]
fn two_threads_device_calls_at_once_on_one_communicator_are_refused() {
    if let Some((rank, n, id)) = common::child_role() {
        concurrent_rank(rank, n, &id);
        return;
    }
    let done = std::env::temp_dir().join(format!("oxccl-device-session-done-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let mut env = standin_env();
    env.push(("OXCCL_TIMEOUT_MS", "20000".to_string()));
    env.push(("OXCCL_TEST_DONE_FILE", done.display().to_string()));
    let res = common::run_ranks(
        "two_threads_device_calls_at_once_on_one_communicator_are_refused",
        2,
        &env,
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_file(&done);
    common::assert_all_ok(&res);
}
