//! One thread driving several communicators on device buffers (as nccl-tests `-g N` and
//! single-process multi-GPU trainers do), on the CUDA stand-in: `ncclCommInitAll`, then
//! `ncclGroupStart; ncclAllReduce(comm0); ...; ncclAllReduce(commN-1); ncclGroupEnd`, with 2
//! and 4 communicators on 1 and 2 simulated GPUs (`OXCCL_STANDIN_DEVICES`), three rounds each;
//! every result checked against an f64 sum. The device state of the group's communicators is
//! set up together at the group's end (its creation is collective), so this completes instead
//! of waiting on itself; every communicator uses CUDA IPC, on two GPUs through peer access.
//! Without peer access (`OXCCL_STANDIN_NO_P2P`), `OXCCL_CUDA_IPC=require` refuses the fallback.
//!
//! Also: host and device calls interleaved on one communicator (a device all-reduce, then at
//! once a host all-reduce, over and over) are correct in IPC and proxy modes: the host call
//! waits for the communicator's device work in flight.
//!
//! And the stand-in's one-hardware-queue mode (`CUDA_DEVICE_MAX_CONNECTIONS=1`): a stream wait
//! placed before the write it waits for deadlocks there (and not with a queue per stream); the
//! one-thread group of two and of three communicators on one GPU completes exactly in that mode.

mod common;

use common::standin::{standin_env, DevMem};
use cudarc::driver::{result, sys};
use oxccl::ffi::{
    coll::ncclAllReduce, comm::ncclCommDestroy, config::ncclCommInitAll, group::ncclGroupEnd, group::ncclGroupStart,
    ncclComm_t, ncclResult_t,
};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

const COUNT: usize = 40_003;

fn value(rank: usize, i: usize, round: usize) -> f32 {
    ((rank * 7 + i * 3 + round) % 11) as f32 - 5.0
}

/// The child: `n` communicators from one thread, communicator `r` on GPU `r % gpus`.
fn group_child() {
    let n: usize = std::env::var("OXCCL_TEST_NCOMMS").unwrap().parse().unwrap();
    let gpus: usize = std::env::var("OXCCL_STANDIN_DEVICES").unwrap().parse().unwrap();
    assert!(oxccl::device::available(), "no CUDA (the stand-in is not on LD_LIBRARY_PATH?)");
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let devs: Vec<i32> = (0..n).map(|r| (r % gpus) as i32).collect();
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), n as i32, devs.as_ptr()), ncclResult_t::ncclSuccess);
    let gpu: Vec<_> = devs.iter().map(|&d| oxccl::device::gpu(d).unwrap()).collect();
    let mut bufs = Vec::new();
    let mut streams = Vec::new();
    for g in &gpu {
        let _g = g.enter().unwrap();
        bufs.push((DevMem::new(COUNT * 4), DevMem::new(COUNT * 4)));
        streams.push(result::stream::create(result::stream::StreamKind::NonBlocking).unwrap());
    }
    for round in 0..3 {
        // Uploaded on the stream of the all-reduce that reads them (a synchronous copy from
        // pageable memory is ordered on the legacy stream only); kept until it is synchronised.
        let mut inputs = Vec::new();
        for r in 0..n {
            let _g = gpu[r].enter().unwrap();
            let data: Vec<f32> = (0..COUNT).map(|i| value(r, i, round)).collect();
            // SAFETY: the send buffer holds COUNT floats; `data` lives in `inputs` until the
            // stream is synchronised.
            unsafe { result::memcpy_htod_async(bufs[r].0 .0, &data, streams[r]) }.unwrap();
            inputs.push(data);
        }
        assert_eq!(ncclGroupStart(), ncclResult_t::ncclSuccess);
        for r in 0..n {
            let _g = gpu[r].enter().unwrap();
            let (s, d) = (bufs[r].0 .0, bufs[r].1 .0);
            let res = ncclAllReduce(
                s as *const _,
                d as *mut _,
                COUNT,
                DataType::Float32 as i32,
                ReduceOp::Sum as i32,
                comms[r],
                streams[r].cast(),
            );
            assert_eq!(res, ncclResult_t::ncclSuccess, "enqueue on communicator {r}");
        }
        let end = ncclGroupEnd();
        if std::env::var("OXCCL_CUDA_IPC").as_deref() == Ok("require") {
            // GPUs without peer access (OXCCL_STANDIN_NO_P2P): refused, not slowed down.
            assert_ne!(end, ncclResult_t::ncclSuccess, "OXCCL_CUDA_IPC=require must refuse the proxy");
            // SAFETY: ncclGetLastError returns a NUL-terminated string.
            let msg = unsafe { std::ffi::CStr::from_ptr(oxccl::ffi::comm::ncclGetLastError(comms[0])) };
            let msg = msg.to_string_lossy();
            assert!(msg.contains("OXCCL_CUDA_IPC=require") && msg.contains("no peer access"), "{msg}");
            eprintln!("REFUSED AS REQUIRED: {msg}");
            std::process::exit(0);
        }
        assert_eq!(end, ncclResult_t::ncclSuccess, "ncclGroupEnd, round {round}");
        for r in 0..n {
            let _g = gpu[r].enter().unwrap();
            // SAFETY: a stream created above.
            unsafe { result::stream::synchronize(streams[r]) }.unwrap();
            let mut got = vec![0f32; COUNT];
            // SAFETY: the receive buffer holds COUNT floats.
            unsafe { result::memcpy_dtoh_sync(&mut got, bufs[r].1 .0) }.unwrap();
            for (i, g) in got.iter().enumerate() {
                let want: f64 = (0..n).map(|k| f64::from(value(k, i, round))).sum();
                assert_eq!(f64::from(*g), want, "communicator {r}, round {round}, element {i}");
            }
        }
        drop(inputs);
    }
    // What each communicator holds: its CUDA IPC region (two 32 MiB areas, three 16 KiB small
    // slots and a 256-byte board) and its fold tables (64 tables of 2n addresses and the two
    // words of a guarded table), on one GPU and on two (ranks of one process on different GPUs
    // address each other through peer access).
    let tables = 64 * (2 * n as u64 + 2) * 8;
    for &c in &comms {
        let mut held = u64::MAX;
        assert_eq!(oxccl::ffi::extra::ncclCommMemStats(c, 3, &mut held), ncclResult_t::ncclSuccess);
        assert_eq!(held, (64 << 20) + 3 * (16 << 10) + 256 + tables, "ncclCommMemStats(ncclStatGpuMemTotal)");
    }
    for r in 0..n {
        let _g = gpu[r].enter().unwrap();
        // SAFETY: synchronised above; destroyed once.
        unsafe { result::stream::destroy(streams[r]) }.unwrap();
    }
    drop(bufs);
    for c in comms {
        assert_eq!(ncclCommDestroy(c), ncclResult_t::ncclSuccess);
    }
}

#[test]
fn init_all_then_a_group_of_device_all_reduces_from_one_thread() {
    if common::child_role().is_some() {
        group_child();
        return;
    }
    for (ncomms, gpus) in [(2, 1), (4, 1), (2, 2), (4, 2)] {
        let mut env = standin_env();
        env.push(("OXCCL_STANDIN_DEVICES", gpus.to_string()));
        env.push(("OXCCL_TEST_NCOMMS", ncomms.to_string()));
        env.push(("OXCCL_TIMEOUT_MS", "20000".into()));
        env.push(("OXCCL_DEBUG", "INFO".into()));
        let res = common::run_ranks(
            "init_all_then_a_group_of_device_all_reduces_from_one_thread",
            1,
            &env,
            Duration::from_secs(120),
        );
        let err = &res[0].1;
        assert!(res[0].0, "{ncomms} communicators on {gpus} GPU(s):\n{err}");
        let ipc = err.lines().filter(|l| l.contains("device collectives through CUDA IPC")).count();
        assert_eq!(ipc, ncomms, "every communicator must use CUDA IPC, with no fallback:\n{err}");
        assert!(!err.contains("WARN"), "{ncomms} communicators on {gpus} GPU(s):\n{err}");
    }
    let mut env = standin_env();
    env.extend([
        ("OXCCL_STANDIN_DEVICES", "2".to_string()),
        ("OXCCL_TEST_NCOMMS", "2".to_string()),
        ("OXCCL_TIMEOUT_MS", "20000".to_string()),
        ("OXCCL_CUDA_IPC", "require".to_string()),
        ("OXCCL_STANDIN_NO_P2P", "1".to_string()),
    ]);
    let res = common::run_ranks(
        "init_all_then_a_group_of_device_all_reduces_from_one_thread",
        1,
        &env,
        Duration::from_secs(120),
    );
    assert!(res[0].0 && res[0].1.contains("REFUSED AS REQUIRED"), "OXCCL_CUDA_IPC=require:\n{}", res[0].1);
}

/// One rank: device all-reduces on a stream, each followed at once (no stream synchronisation)
/// by a host all-reduce of a different shape on the same communicator; then both checked.
fn interleaved_rank(rank: usize, n: usize, id: &str) {
    let id = oxccl::UniqueId::from_hex(id).unwrap();
    let comm = std::sync::Arc::new(oxccl::Communicator::init_rank(n, &id, rank).unwrap());
    let gpu = oxccl::device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let (send, recv) = (DevMem::new(COUNT * 4), DevMem::new(COUNT * 4));
    for round in 0..20 {
        let data: Vec<f32> = (0..COUNT).map(|i| value(rank, i, round)).collect();
        // SAFETY: the send buffer holds COUNT floats; `data` outlives the copy (the stream is
        // synchronised below). On the launch's stream: a synchronous copy from pageable memory
        // is ordered on the legacy stream only.
        unsafe { result::memcpy_htod_async(send.0, &data, stream) }.unwrap();
        let op = oxccl::device::DevOp {
            coll: oxccl::Collective::AllReduce,
            send: send.0,
            recv: recv.0,
            count: COUNT,
            dtype: DataType::Float32,
            op: ReduceOp::Sum,
            scale: None,
        };
        // SAFETY: both buffers hold COUNT floats until the stream is synchronised below.
        unsafe { comm.launch(op, stream.cast()) }.unwrap();
        let mut host = [0f64];
        comm.all_reduce(&[(rank + round) as f64], &mut host, ReduceOp::Max).unwrap();
        assert_eq!(host[0], (n - 1 + round) as f64, "host all-reduce, round {round}");
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(stream as sys::CUstream) }.unwrap();
        let mut got = vec![0f32; COUNT];
        // SAFETY: the receive buffer holds COUNT floats.
        unsafe { result::memcpy_dtoh_sync(&mut got, recv.0) }.unwrap();
        for (i, g) in got.iter().enumerate() {
            let want: f64 = (0..n).map(|k| f64::from(value(k, i, round))).sum();
            assert_eq!(f64::from(*g), want, "device all-reduce, round {round}, element {i}");
        }
    }
    // SAFETY: synchronised above.
    unsafe { result::stream::destroy(stream) }.unwrap();
}

#[test]
fn host_and_device_calls_interleaved_on_one_communicator() {
    if let Some((rank, n, id)) = common::child_role() {
        interleaved_rank(rank, n, &id);
        return;
    }
    for ipc in ["1", "0"] {
        let mut env = standin_env();
        env.push(("OXCCL_CUDA_IPC", ipc.into()));
        env.push(("OXCCL_TIMEOUT_MS", "20000".into()));
        let res = common::run_ranks(
            "host_and_device_calls_interleaved_on_one_communicator",
            2,
            &env,
            Duration::from_secs(120),
        );
        for (i, (ok, err)) in res.iter().enumerate() {
            assert!(ok, "OXCCL_CUDA_IPC={ipc}, rank {i}:\n{err}");
        }
    }
}

/// Stand-in check of `CUDA_DEVICE_MAX_CONNECTIONS=1` (every stream of a device in one FIFO, as
/// on a GPU with one hardware queue): a stream waiting for a word that another stream of the
/// device writes later never sees the write (the wait sits in front of it), and the stand-in
/// reports the deadlock; with a queue per stream (the default) the same pair completes.
fn one_queue_child() {
    let gpu = oxccl::device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let word = DevMem::new(16);
    // SAFETY: a 4-byte device word of this context; the legacy stream's memset is waited for
    // (the non-blocking streams below would not wait for it).
    unsafe { result::memset_d8_sync(word.0, 0, 4) }.unwrap();
    result::ctx::synchronize().unwrap();
    let (a, b) = (
        result::stream::create(result::stream::StreamKind::NonBlocking).unwrap(),
        result::stream::create(result::stream::StreamKind::NonBlocking).unwrap(),
    );
    let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
    let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: the word outlives both streams' work (synchronised below).
    unsafe {
        assert_eq!(sys::cuStreamWaitValue32_v2(a, word.0, 1, geq), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuStreamWriteValue32_v2(b, word.0, 1, write), sys::CUresult::CUDA_SUCCESS);
    }
    // SAFETY: live streams.
    let (ra, rb) = unsafe { (result::stream::synchronize(a), result::stream::synchronize(b)) };
    let one_queue = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").as_deref() == Ok("1");
    if one_queue {
        assert!(ra.is_err(), "one FIFO: the wait cannot see a write queued behind it");
    } else {
        assert!(ra.is_ok() && rb.is_ok(), "a queue per stream: {ra:?} {rb:?}");
    }
}

#[test]
fn the_stand_ins_one_hardware_queue_puts_a_wait_in_front_of_the_write_it_waits_for() {
    if common::child_role().is_some() {
        one_queue_child();
        return;
    }
    if common::standin::real_driver() {
        common::skipped("a stand-in mode (CUDA_DEVICE_MAX_CONNECTIONS on the stand-in)");
        return;
    }
    for (conns, deadlock) in [("1", true), ("", false)] {
        let mut env = standin_env();
        env.push(("CUDA_DEVICE_MAX_CONNECTIONS", conns.to_string()));
        env.push(("OXCCL_STANDIN_WAIT_MS", "500".into()));
        let name = "the_stand_ins_one_hardware_queue_puts_a_wait_in_front_of_the_write_it_waits_for";
        let res = common::run_ranks(name, 1, &env, Duration::from_secs(60));
        assert!(res[0].0, "CUDA_DEVICE_MAX_CONNECTIONS={conns}:\n{}", res[0].1);
        assert_eq!(res[0].1.contains("DEADLOCK"), deadlock, "CUDA_DEVICE_MAX_CONNECTIONS={conns}:\n{}", res[0].1);
    }
}

/// With every stream of the GPU in one FIFO (`CUDA_DEVICE_MAX_CONNECTIONS=1`, Megatron's
/// setting), one thread driving two (and three) communicators of one GPU through a group:
/// every round exact, no timeout. Enqueued one communicator after the other, communicator 0's
/// barrier wait would sit in front of communicator 1's write in the FIFO (a hang until the
/// watchdog, then wrong values); the group enqueues the parts in lockstep instead
/// (`device/lockstep.rs`).
#[test]
fn one_hardware_queue_a_group_of_communicators_on_one_gpu_completes_exactly() {
    const NAME: &str = "one_hardware_queue_a_group_of_communicators_on_one_gpu_completes_exactly";
    if common::child_role().is_some() {
        group_child();
        return;
    }
    if common::standin::real_driver() {
        common::skipped("a stand-in mode (CUDA_DEVICE_MAX_CONNECTIONS on the stand-in)");
        return;
    }
    for n in ["2", "3"] {
        let mut env = standin_env();
        env.extend([
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1".to_string()),
            ("OXCCL_STANDIN_DEVICES", "1".to_string()),
            ("OXCCL_TEST_NCOMMS", n.to_string()),
            ("OXCCL_TIMEOUT_MS", "3000".to_string()),
        ]);
        let res = common::run_ranks(NAME, 1, &env, Duration::from_secs(60));
        let log = &res[0].1;
        assert!(res[0].0 && !log.contains("did not finish") && !log.contains("DEADLOCK"), "{n} communicators:\n{log}");
    }
}
