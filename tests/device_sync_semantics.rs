//! The host and stream synchronisation of CUDA's synchronous copies and memsets, as the CUDA
//! stand-in models them (CUDA driver docs, "API synchronization behavior"): a synchronous
//! `cuMemcpyHtoD` from pageable host memory returns once the source is staged and lands later,
//! ordered on the legacy default stream only, as do the synchronous memsets into device memory;
//! non-blocking streams do not wait for them, blocking streams and every wait for the legacy
//! stream do. On the stand-in the landing is held back for `OXCCL_STANDIN_PAGEABLE_DELAY_MS`
//! (set to 60 s here, so a read that does not wait for it sees the old bytes deterministically,
//! and a synchronisation that failed to cut the delay short shows as a timed-out rank).
//!
//! On the real driver (`OXCCL_DEVICE_TESTS_REAL=1`) only what CUDA guarantees is checked: every
//! properly synchronised read sees the new bytes (a stale read there is possible, not certain).

mod common;

use common::standin::{real_driver, standin_env, DevMem};
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use std::time::{Duration, Instant};

const BYTES: usize = 1 << 16;

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// The bytes of `buf`, copied on `stream` and read after that stream is synchronised (and
/// nothing else).
fn read_on(stream: sys::CUstream, buf: &DevMem) -> Vec<u8> {
    let mut got = vec![0u8; BYTES];
    // SAFETY: `buf` holds BYTES bytes, `got` too; the stream is synchronised before `got` is read.
    unsafe {
        ok(sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), buf.0, BYTES, stream), "cuMemcpyDtoHAsync");
        ok(sys::cuStreamSynchronize(stream), "cuStreamSynchronize");
    }
    got
}

/// Uploads `byte` into all of `buf` with the synchronous copy from pageable memory.
fn upload_sync(buf: &DevMem, byte: u8) {
    let src = vec![byte; BYTES];
    // SAFETY: `buf` holds BYTES bytes; the source is staged before the call returns.
    ok(unsafe { sys::cuMemcpyHtoD_v2(buf.0, src.as_ptr().cast(), BYTES) }, "cuMemcpyHtoD");
}

fn assert_all(got: &[u8], want: u8, what: &str) {
    if let Some(i) = got.iter().position(|&b| b != want) {
        panic!("{what}: byte {i} is {:#04x}, want {want:#04x}", got[i]);
    }
}

/// The stale read: on the stand-in the old bytes for certain; on a GPU either.
fn assert_stale(got: &[u8], old: u8, new: u8, what: &str) {
    if real_driver() {
        assert!(got.iter().all(|&b| b == old || b == new), "{what}: neither the old nor the new bytes");
    } else {
        assert_all(got, old, what);
    }
}

extern "C" fn set_flag_later(flag: *mut c_void) {
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: `flag` is a pinned host word that outlives the stream work (synchronised below).
    unsafe { std::ptr::write_volatile(flag as *mut u32, 1) };
}

fn child() {
    assert!(oxccl::device::available(), "no CUDA (stand-in not on LD_LIBRARY_PATH?)");
    let gpu = oxccl::device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    // Streams of the current context, destroyed by process exit.
    let nb = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let blocking = result::stream::create(result::stream::StreamKind::Default).unwrap();
    let legacy: sys::CUstream = std::ptr::null_mut();
    let buf = DevMem::new(BYTES);
    let start = Instant::now();

    // Seeded through the stream that reads it: the old bytes.
    let old = vec![0x11u8; BYTES];
    // SAFETY: `buf` holds BYTES bytes; `old` outlives the copy (the stream is synchronised).
    ok(unsafe { sys::cuMemcpyHtoDAsync_v2(buf.0, old.as_ptr().cast(), BYTES, nb) }, "cuMemcpyHtoDAsync");
    assert_all(&read_on(nb, &buf), 0x11, "an async upload read on its own stream");

    // A pageable synchronous upload is not awaited by a non-blocking stream...
    upload_sync(&buf, 0x22);
    assert_stale(&read_on(nb, &buf), 0x11, 0x22, "a pageable cuMemcpyHtoD read on a non-blocking stream");
    // ...until the context is synchronised.
    // SAFETY: plain call in the current context.
    ok(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize");
    assert_all(&read_on(nb, &buf), 0x22, "cuMemcpyHtoD then cuCtxSynchronize");

    // The synchronous memset into device memory is asynchronous to the host, on the legacy stream.
    // SAFETY: `buf` holds BYTES / 4 words.
    ok(unsafe { sys::cuMemsetD32_v2(buf.0, 0x3333_3333, BYTES / 4) }, "cuMemsetD32");
    assert_stale(&read_on(nb, &buf), 0x22, 0x33, "cuMemsetD32 read on a non-blocking stream");
    // SAFETY: the legacy stream of the current context.
    ok(unsafe { sys::cuStreamSynchronize(legacy) }, "cuStreamSynchronize(legacy)");
    assert_all(&read_on(nb, &buf), 0x33, "cuMemsetD32 then cuStreamSynchronize(legacy)");

    // A blocking stream waits for the legacy stream's earlier work.
    upload_sync(&buf, 0x44);
    assert_all(&read_on(blocking, &buf), 0x44, "cuMemcpyHtoD read on a blocking stream");

    // A synchronous copy back is ordered after it on the legacy stream.
    upload_sync(&buf, 0x55);
    let mut got = vec![0u8; BYTES];
    // SAFETY: `buf` holds BYTES bytes.
    unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
    assert_all(&got, 0x55, "cuMemcpyHtoD then cuMemcpyDtoH");

    // An event recorded on the legacy stream after it, awaited by the non-blocking stream.
    upload_sync(&buf, 0x66);
    // SAFETY: event of the current context; recorded on the legacy stream, awaited on `nb`.
    unsafe {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        ok(sys::cuEventRecord(ev, legacy), "cuEventRecord(legacy)");
        ok(sys::cuStreamWaitEvent(nb, ev, 0), "cuStreamWaitEvent");
    }
    assert_all(&read_on(nb, &buf), 0x66, "cuMemcpyHtoD, event on legacy, awaited on the stream");

    // The legacy stream waits for a blocking stream's earlier work: a memset on `blocking`
    // that runs only after a host function on `nb` sets a flag 50 ms later.
    let mut flag: *mut c_void = std::ptr::null_mut();
    // SAFETY: pinned host word; `flag` is device-accessible at the same address (unified addressing).
    unsafe {
        ok(sys::cuMemAllocHost_v2(&mut flag, 4), "cuMemAllocHost");
        std::ptr::write_volatile(flag as *mut u32, 0);
        let word = flag as u64;
        ok(sys::cuStreamWaitValue32_v2(blocking, word, 1, 0), "cuStreamWaitValue32");
        ok(sys::cuMemsetD8Async(buf.0, 0x77, BYTES, blocking), "cuMemsetD8Async");
        ok(sys::cuLaunchHostFunc(nb, Some(set_flag_later), flag), "cuLaunchHostFunc");
    }
    // SAFETY: `buf` holds BYTES bytes.
    unsafe { result::memcpy_dtoh_sync(&mut got, buf.0) }.unwrap();
    assert_all(&got, 0x77, "a blocking stream's memset then cuMemcpyDtoH");
    // SAFETY: both streams are idle once synchronised; then the pinned word is freed.
    unsafe {
        ok(sys::cuStreamSynchronize(nb), "cuStreamSynchronize");
        ok(sys::cuMemFreeHost(flag), "cuMemFreeHost");
    }
    // Every wait above cut the 60 s delay short.
    assert!(start.elapsed() < Duration::from_secs(20), "a synchronisation waited out the delay: {:?}", start.elapsed());
}

#[test]
fn synchronous_pageable_uploads_and_memsets_are_ordered_on_the_legacy_stream_only() {
    if common::child_role().is_some() {
        child();
        return;
    }
    let mut env = standin_env();
    env.push(("OXCCL_STANDIN_PAGEABLE_DELAY_MS", "60000".into()));
    let res = common::run_ranks(
        "synchronous_pageable_uploads_and_memsets_are_ordered_on_the_legacy_stream_only",
        1,
        &env,
        Duration::from_secs(120),
    );
    common::assert_all_ok(&res);
}
