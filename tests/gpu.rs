//! GPU tests: device kernels against the host reductions, pointer classification, and
//! `ncclAllReduce` on device buffers through the C ABI with 1..4 ranks sharing GPU 0 (ranks are
//! processes), in both device modes (CUDA IPC and pinned-host proxy), every type × op, in and
//! out of place, checked against a reference computed here in f64.
//!
//! Without a GPU every test prints "SKIPPED: no CUDA device (...)" and passes, so CPU-only CI
//! stays green; `OXCCL_GPU_TESTS_REQUIRED=1` (set by the GPU check kit, docs/GPU.md) turns that into a
//! failure.

mod common;

use common::eps;
use cudarc::driver::{result, sys};
use oxccl::device::{self, kernels, MemKind, Target};
use oxccl::ffi::{
    coll::ncclAllReduce, comm::ncclCommDestroy, comm::ncclCommInitRank, ncclComm_t, ncclResult_t, ncclUniqueId,
};
use oxccl::{reduce, DataType, ReduceOp};
use std::time::Duration;

fn gpu_present(what: &str) -> bool {
    if device::available() {
        return true;
    }
    assert!(
        std::env::var("OXCCL_GPU_TESTS_REQUIRED").is_err(),
        "{what}: OXCCL_GPU_TESTS_REQUIRED is set but no CUDA device is usable"
    );
    common::skipped(&format!("no CUDA device ({what}: needs libcuda.so and a GPU)"));
    false
}

/// A device allocation freed on drop (GPU 0's context current while alive).
struct DevMem(u64);
impl DevMem {
    fn new(bytes: usize) -> DevMem {
        // SAFETY: plain allocation in the current context.
        DevMem(unsafe { result::malloc_sync(bytes.max(16)) }.expect("cuMemAlloc"))
    }
    /// Copies `data` in and waits for the copy: a pageable `cuMemcpyHtoD` returns before its DMA
    /// (on the legacy stream) lands, and the collectives run on non-blocking streams.
    fn upload(&self, data: &[u8]) {
        // SAFETY: the allocation holds at least data.len() bytes; the context is current.
        unsafe {
            result::memcpy_htod_sync(self.0, data).expect("cuMemcpyHtoD");
            result::ctx::synchronize().expect("cuCtxSynchronize");
        }
    }
    fn download(&self, out: &mut [u8]) {
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_sync(out, self.0) }.expect("cuMemcpyDtoH");
    }
}
impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once.
        let _ = unsafe { result::free_sync(self.0) };
    }
}

/// Test input of `rank` (small integers, valid in every type; ±1/±2 for products).
fn input(dt: DataType, op: ReduceOp, rank: usize, n: usize, seed: usize) -> Vec<u8> {
    let unsigned = matches!(dt, DataType::Uint8 | DataType::Uint32 | DataType::Uint64);
    let vals: Vec<f64> = (0..n).map(|i| common::input(rank, i, seed, unsigned, op == ReduceOp::Prod)).collect();
    let mut out = vec![0u8; n * dt.size()];
    reduce::from_f64(dt, &vals, &mut out);
    out
}

/// Checks `got` (element bytes) against the f64 reduction of every rank's input.
fn check(dt: DataType, op: ReduceOp, nranks: usize, seed: usize, got: &[u8], what: &str) {
    let n = got.len() / dt.size();
    let ins: Vec<Vec<f64>> = (0..nranks).map(|r| reduce::to_f64(dt, &input(dt, op, r, n, seed))).collect();
    let got = reduce::to_f64(dt, got);
    for i in 0..n {
        let xs: Vec<f64> = ins.iter().map(|v| v[i]).collect();
        let abs: f64 = xs.iter().map(|x| x.abs()).sum();
        let (want, tol) = match op {
            ReduceOp::Sum => (xs.iter().sum::<f64>(), nranks as f64 * eps(dt) * abs),
            ReduceOp::Avg if dt.is_float() => (xs.iter().sum::<f64>() / nranks as f64, eps(dt) * abs),
            ReduceOp::Avg => ((xs.iter().sum::<f64>() / nranks as f64).trunc(), 0.0),
            ReduceOp::Prod => (xs.iter().product(), 0.0),
            ReduceOp::Max => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
            ReduceOp::Min => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        };
        assert!((got[i] - want).abs() <= tol, "{what}: element {i}: got {} want {want} (tolerance {tol})", got[i]);
    }
}

#[test]
fn kernels_on_the_gpu_match_host_reductions() {
    if !gpu_present("device kernels") {
        return;
    }
    let gpu = device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let n = 100_003;
    for dt in DataType::ALL {
        for op in ReduceOp::ALL {
            let (a, b) = (input(dt, op, 0, n, 1), input(dt, op, 1, n, 1));
            let mut want = vec![0u8; a.len()];
            reduce::reduce_to(dt, op, &mut want, &a, &b);
            if op == ReduceOp::Avg {
                reduce::divide(dt, &mut want, 2);
            }
            let (da, db, dd) = (DevMem::new(a.len()), DevMem::new(b.len()), DevMem::new(a.len()));
            da.upload(&a);
            db.upload(&b);
            // SAFETY: each allocation holds `n` elements.
            unsafe { device::ops::reduce(&gpu, dd.0, da.0, db.0, n as u64, dt, op, 2, std::ptr::null_mut()) }.unwrap();
            let mut got = vec![0u8; a.len()];
            dd.download(&mut got);
            assert!(got == want, "{}: device result differs from the host reduction", kernels::reduce_name(dt, op));
        }
    }
}

#[test]
fn classification_of_cuda_memory() {
    if !gpu_present("pointer classification") {
        return;
    }
    let gpu = device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let d = DevMem::new(64);
    assert_eq!(device::classify(d.0 as *const _).unwrap(), MemKind::Device { ordinal: 0 });
    // SAFETY: pinned and managed allocations, freed below.
    let pinned = unsafe { result::malloc_host(64, 0) }.unwrap();
    assert_eq!(device::classify(pinned).unwrap(), MemKind::PinnedHost);
    // SAFETY: as above.
    let managed = unsafe { result::malloc_managed(64, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }.unwrap();
    assert_eq!(device::classify(managed as *const _).unwrap(), MemKind::Managed { ordinal: 0 });
    let host = [0u8; 64];
    assert_eq!(device::classify(host.as_ptr().cast()).unwrap(), MemKind::Host);
    assert_eq!(
        device::route(d.0 as *const _, d.0 as *const _, std::ptr::null_mut()).unwrap(),
        Target::Device { ordinal: 0 }
    );
    let mixed = device::route(host.as_ptr().cast(), d.0 as *const _, std::ptr::null_mut()).unwrap_err();
    assert_eq!(mixed.kind(), oxccl::ErrorKind::InvalidArgument);
    // SAFETY: allocated above.
    unsafe {
        result::free_host(pinned).unwrap();
        result::free_sync(managed).unwrap();
    }
}

fn last_error(comm: ncclComm_t) -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(oxccl::ffi::comm::ncclGetLastError(comm)) }.to_string_lossy().into_owned()
}

/// One rank: every type × op × placement × size through `ncclAllReduce` on device memory.
fn rank_body(rank: usize, n: usize, id_hex: &str) {
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let gpu = device::gpu(0).unwrap();
    let _ctx = gpu.enter().unwrap();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let mut seed = 0;
    for dt in DataType::ALL {
        for op in ReduceOp::ALL {
            for count in [1usize, 1000, (1 << 20) + 3] {
                for in_place in [false, true] {
                    seed += 1;
                    let data = input(dt, op, rank, count, seed);
                    let (send, recv) = (DevMem::new(data.len()), DevMem::new(data.len()));
                    send.upload(&data);
                    let dst = if in_place { send.0 } else { recv.0 };
                    let r = ncclAllReduce(
                        send.0 as *const _,
                        dst as *mut _,
                        count,
                        dt as i32,
                        op as i32,
                        comm,
                        stream.cast(),
                    );
                    assert_eq!(r, ncclResult_t::ncclSuccess, "{}", last_error(comm));
                    // Later work on the same stream sees the result.
                    let mut got = vec![0u8; data.len()];
                    // SAFETY: `got` is pinned for the copy's duration by the synchronize below.
                    unsafe {
                        let r = sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), dst, got.len(), stream);
                        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
                        result::stream::synchronize(stream).unwrap();
                    }
                    let what = format!("rank {rank}/{n} {} {} count {count} in_place {in_place}", dt.name(), op.name());
                    check(dt, op, n, seed, &got, &what);
                }
            }
        }
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
}

#[test]
fn all_reduce_ranks_sharing_one_gpu() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_body(rank, n, &id);
        return;
    }
    if !gpu_present("multi-rank device all-reduce") {
        return;
    }
    // OXCCL_TEST_CUDA_IPC_MODES: the modes to run, of "1" (IPC) and "0" (proxy), comma-separated
    // (the GPU kit runs them as two steps, each inside its bound).
    let modes = std::env::var("OXCCL_TEST_CUDA_IPC_MODES").unwrap_or_else(|_| "1,0".into());
    for ipc in modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        assert!(ipc == "1" || ipc == "0", "OXCCL_TEST_CUDA_IPC_MODES: {ipc:?} is neither 1 nor 0");
        for n in 1..=4 {
            let env = [
                ("OXCCL_CUDA_IPC", ipc.to_string()),
                ("OXCCL_CUDA_IPC_BUFFER", "262144".to_string()),
                ("OXCCL_TIMEOUT_MS", "120000".to_string()),
            ];
            eprintln!("device all-reduce: {n} rank(s) on GPU 0, OXCCL_CUDA_IPC={ipc}");
            let res = common::run_ranks("all_reduce_ranks_sharing_one_gpu", n, &env, Duration::from_secs(600));
            common::assert_all_ok(&res);
        }
    }
}
