//! The CUDA path on machines without CUDA (CI): host-only operation, the one INFO line, the
//! C ABI ignoring the stream, and `oxccl-perf --mem cuda` refusing to run. On a GPU machine
//! these tests print a SKIPPED line (tests/gpu.rs covers that case).

mod common;

use oxccl::device::{self, MemKind, Target};
use std::process::Command;

/// True (after printing why) when this machine has a GPU, so host-only checks do not apply.
fn skip_with_gpu(what: &str) -> bool {
    if device::available() {
        common::skipped(&format!("{what}: a CUDA device is present (tests/gpu.rs covers this machine)"));
        return true;
    }
    false
}

#[test]
fn without_cuda_every_pointer_is_host_and_device_calls_fail_cleanly() {
    if skip_with_gpu("host-only classification") {
        return;
    }
    let heap = Box::new([0u8; 64]);
    let stack = [0u32; 4];
    assert_eq!(device::classify(heap.as_ptr().cast()).unwrap(), MemKind::Host);
    assert_eq!(device::classify(stack.as_ptr().cast()).unwrap(), MemKind::Host);
    // Without CUDA a stream handle is never touched, whatever its value.
    let bogus_stream = 0x10 as *mut std::ffi::c_void;
    assert_eq!(device::route(heap.as_ptr().cast(), stack.as_ptr().cast(), bogus_stream).unwrap(), Target::Host);
    assert_eq!(device::device_count(), 0);
    let e = device::gpu(0).err().expect("no GPU without CUDA");
    assert_eq!(e.kind(), oxccl::ErrorKind::UnhandledCuda);
    assert!(e.message().contains("no CUDA device"), "{}", e.message());
    // The device entry point itself reports the same error instead of touching memory.
    let comm = std::sync::Arc::new(oxccl::Communicator::in_memory(1).pop().unwrap());
    let mut buf = [1.0f32; 4];
    let p = buf.as_mut_ptr() as u64;
    // SAFETY: `buf` holds 4 floats; the call fails before using them (no GPU).
    let r = unsafe {
        device::all_reduce(&comm, p, p, 4, oxccl::DataType::Float32, oxccl::ReduceOp::Sum, 0, std::ptr::null_mut())
    };
    assert_eq!(r.unwrap_err().kind(), oxccl::ErrorKind::UnhandledCuda);
}

#[test]
fn c_abi_all_reduce_on_host_memory_ignores_the_stream_without_cuda() {
    if skip_with_gpu("C ABI stream on host memory") {
        return;
    }
    use oxccl::ffi::comm::{ncclCommDestroy, ncclCommInitRank, ncclGetUniqueId};
    use oxccl::ffi::{coll::ncclAllReduce, ncclComm_t, ncclResult_t, ncclUniqueId};
    // A one-rank communicator made through the C ABI (rendezvous on loopback).
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    let mut id = ncclUniqueId { internal: [0; 128] };
    assert_eq!(ncclGetUniqueId(&mut id), ncclResult_t::ncclSuccess);
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, 1, id, 0), ncclResult_t::ncclSuccess);
    let send = [1.5f32, -2.0, 3.25];
    let mut recv = [0f32; 3];
    let stream = 0x20 as oxccl::ffi::cudaStream_t;
    let r = ncclAllReduce(send.as_ptr().cast(), recv.as_mut_ptr().cast(), 3, 7, 0, comm, stream);
    assert_eq!(r, ncclResult_t::ncclSuccess);
    assert_eq!(recv, send, "one rank: the sum is the input");
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn info_log_says_host_only_once() {
    if std::env::var("OXCCL_TEST_INFO_CHILD").is_ok() {
        // Child: several queries, one log line expected.
        for _ in 0..3 {
            assert!(!device::available());
            let x = 0u8;
            let _ = device::classify((&x as *const u8).cast());
        }
        return;
    }
    if skip_with_gpu("host-only INFO line") {
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["info_log_says_host_only_once", "--exact", "--nocapture", "--test-threads=1"])
        .env("OXCCL_TEST_INFO_CHILD", "1")
        .env("OXCCL_DEBUG", "INFO")
        .output()
        .expect("run child");
    assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("CUDA not found: host memory only").count(), 1, "stderr:\n{err}");
}

#[test]
fn perf_mem_cuda_without_gpu_exits_2() {
    if skip_with_gpu("oxccl-perf --mem cuda refusal") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_oxccl-perf"))
        .args(["--mem", "cuda"])
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .output()
        .expect("run oxccl-perf");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA device: --mem cuda needs a GPU"), "stderr: {err}");
}
