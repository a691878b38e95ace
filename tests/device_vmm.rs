//! Device all-reduces on virtual-memory allocations (`cuMemCreate` + `cuMemMap`, what torch's
//! `expandable_segments` allocator hands out), between rank processes, on the CUDA stand-in (or
//! the real driver, `OXCCL_DEVICE_TESTS_REAL=1`).
//!
//! Covered: buffers in memory made of three physical allocations mapped side by side, each
//! buffer crossing a boundary between two of them, created with the POSIX file descriptor
//! handle type, take the direct flow (the INFO line; on the stand-in at most the fold table's
//! upload is copied per call, where the staged flow copies every byte in and out) and are exact
//! for every type against the f64 reference, in and out of place; a repeated call copies
//! nothing (the peers' mappings and the fold table are cached). The same memory created without
//! an exportable handle type is staged (on the stand-in: copied in and out on every call):
//! exact, and one WARN line per process naming why, however many calls.
//!
//! Stream-ordered pool memory the same way: buffers allocated from a pool created with the
//! POSIX file descriptor handle type (`cuMemAllocFromPoolAsync`, at offsets inside their
//! allocation) take the direct flow, exact for every type, a repeated call copying nothing, and
//! an allocation freed and made again at the same place is imported afresh (exact), on one
//! simulated GPU and with a GPU per rank (the imported pool made accessible to the importer's
//! GPU); buffers of the device's
//! default pool (`cuMemAllocAsync`, what `cudaMallocAsync` uses: not exportable) are staged,
//! exact, with one WARN line per process naming why and the fix.

mod common;
#[path = "common/devcase.rs"]
mod devcase;

use common::allreduce::{reference, unsigned};
use common::standin::{join, real_driver, standin_count, standin_env, upload};
use cudarc::driver::{result, sys};
use devcase::last_error;
use oxccl::algo::select::IPC_DIRECT_MIN;
use oxccl::ffi::{coll::ncclAllReduce, comm::ncclCommDestroy, ncclComm_t, ncclResult_t};
use oxccl::{DataType, ReduceOp};
use std::time::Duration;

/// Bytes of each call: past the direct flow's threshold, with a tail that is no multiple of 16.
const BYTES: usize = IPC_DIRECT_MIN + 4096 + 40;
/// Physical allocations behind the buffers.
const PIECES: usize = 3;

/// Memory reserved, mapped from [`PIECES`] physical allocations side by side, readable and
/// writable by GPU 0; unmapped and released on drop.
struct Vmm {
    va: u64,
    size: usize,
    gran: usize,
    handles: Vec<u64>,
}

impl Vmm {
    fn new(exportable: bool) -> Vmm {
        // SAFETY: an all-zero CUmemAllocationProp is valid (plain integers and a null pointer).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
        prop.requestedHandleTypes = if exportable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        let mut gran = 0usize;
        let min = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: reads `prop`, writes the granularity.
        assert_eq!(unsafe { sys::cuMemGetAllocationGranularity(&mut gran, &prop, min) }, sys::CUresult::CUDA_SUCCESS);
        let gran = gran.max(BYTES.next_power_of_two());
        let size = PIECES * gran;
        let mut va = 0;
        // SAFETY: writes the reservation's base.
        assert_eq!(unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) }, sys::CUresult::CUDA_SUCCESS);
        let mut handles = Vec::new();
        for i in 0..PIECES {
            let mut h = 0;
            // SAFETY: reads `prop`, writes the handle.
            assert_eq!(unsafe { sys::cuMemCreate(&mut h, gran, &prop, 0) }, sys::CUresult::CUDA_SUCCESS);
            // SAFETY: the piece's range lies in the reservation; `h` is live.
            assert_eq!(unsafe { sys::cuMemMap(va + (i * gran) as u64, gran, 0, h, 0) }, sys::CUresult::CUDA_SUCCESS);
            handles.push(h);
        }
        let desc = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole range is mapped.
        assert_eq!(unsafe { sys::cuMemSetAccess(va, size, &desc, 1) }, sys::CUresult::CUDA_SUCCESS);
        Vmm { va, size, gran, handles }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        // SAFETY: mapped in `new`; the streams using it were synchronised; each handle once.
        unsafe {
            sys::cuMemUnmap(self.va, self.size);
            for &h in &self.handles {
                sys::cuMemRelease(h);
            }
            sys::cuMemAddressFree(self.va, self.size);
        }
    }
}

/// Two buffers (send, receive) of a stream-ordered pool: one created with the POSIX file
/// descriptor handle type, or the device's default pool (`cuMemAllocAsync`, not exportable).
struct Pool {
    pool: Option<sys::CUmemoryPool>,
    bufs: [u64; 2],
    stream: sys::CUstream,
}

/// Bytes of each pool buffer: a call's bytes at an offset of up to 2 elements of 8 bytes.
const POOL_BUF: usize = BYTES + 64;

impl Pool {
    fn new(exportable: bool, stream: sys::CUstream) -> Pool {
        Pool::on(0, exportable, stream)
    }

    /// The pool on GPU `dev` (its context current).
    fn on(dev: i32, exportable: bool, stream: sys::CUstream) -> Pool {
        let pool = exportable.then(|| {
            // SAFETY: an all-zero CUmemPoolProps is valid (plain integers and a null pointer).
            let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
            props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            props.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: reads `props`, writes the pool.
            assert_eq!(unsafe { sys::cuMemPoolCreate(&mut pool, &props) }, sys::CUresult::CUDA_SUCCESS);
            pool
        });
        let mut p = Pool { pool, bufs: [0; 2], stream };
        p.bufs = [p.alloc(), p.alloc()];
        p
    }

    fn alloc(&self) -> u64 {
        let mut d = 0;
        // SAFETY: a live stream of the current context (and pool); writes the address.
        let r = unsafe {
            match self.pool {
                Some(pool) => sys::cuMemAllocFromPoolAsync(&mut d, POOL_BUF, pool, self.stream),
                None => sys::cuMemAllocAsync(&mut d, POOL_BUF, self.stream),
            }
        };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
        d
    }

    /// Frees buffer `i` and, once the free has run, allocates it again (on the stand-in at the
    /// same place: the peers' imports of the old allocation are stale there).
    fn renew(&mut self, i: usize) {
        // SAFETY: allocated by `alloc` on this stream; the stream is synchronised by its users.
        assert_eq!(unsafe { sys::cuMemFreeAsync(self.bufs[i], self.stream) }, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(self.stream) }.unwrap();
        let old = self.bufs[i];
        self.bufs[i] = self.alloc();
        if !real_driver() {
            assert_eq!(self.bufs[i], old, "the stand-in's pool did not reuse the freed block");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` / `renew`, each freed once; then the pool, once.
        unsafe {
            for &b in &self.bufs {
                sys::cuMemFreeAsync(b, self.stream);
            }
            result::stream::synchronize(self.stream).unwrap();
            if let Some(pool) = self.pool {
                sys::cuMemPoolDestroy(pool);
            }
        }
    }
}

fn input(t: DataType, rank: usize, count: usize, seed: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, seed, unsigned(t), false)).collect();
    let mut out = vec![0u8; count * t.size()];
    oxccl::reduce::from_f64(t, &vals, &mut out);
    out
}

/// One sum all-reduce of `t` from `send` into `recv` (`bufs`), checked; returns the copies the
/// stand-in counted while it was enqueued.
fn call(
    comm: ncclComm_t,
    rank: usize,
    n: usize,
    bufs: (u64, u64),
    t: DataType,
    seed: usize,
    stream: sys::CUstream,
) -> u64 {
    let (send, recv) = bufs;
    let count = BYTES / t.size();
    upload(send, &input(t, rank, count, seed), stream);
    let before = standin_count(0).unwrap_or(0);
    let r = ncclAllReduce(send as *const _, recv as *mut _, count, t as i32, ReduceOp::Sum as i32, comm, stream.cast());
    assert_eq!(r, ncclResult_t::ncclSuccess, "rank {rank}: {}", last_error(comm));
    let copies = standin_count(0).unwrap_or(0) - before;
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    let mut got = vec![0u8; count * t.size()];
    // SAFETY: `recv` holds count elements; the stream is synchronised.
    unsafe { result::memcpy_dtoh_sync(&mut got, recv) }.unwrap();
    for (i, g) in oxccl::reduce::to_f64(t, &got).iter().enumerate() {
        let (want, tol) = reference(t, ReduceOp::Sum, n, i, seed);
        assert!((g - want).abs() <= tol, "rank {rank}: {} element {i} is {g}, want {want} (tolerance {tol})", t.name());
    }
    copies
}

/// Every type on VMM memory, each buffer across a boundary between physical allocations.
fn rank_main(rank: usize, n: usize, id: &str, exportable: bool) {
    let (comm, streams, _ctx) = join(rank, n, id);
    let mem = Vmm::new(exportable);
    for (k, &t) in DataType::ALL.iter().enumerate() {
        // The send buffer crosses the first boundary, the receive buffer the second.
        let send = mem.va + mem.gran as u64 - (BYTES / 2) as u64 + (k % 3 * t.size()) as u64;
        let recv = if k % 2 == 0 { send } else { mem.va + 2 * mem.gran as u64 - (BYTES / 3) as u64 };
        let copies = call(comm, rank, n, (send, recv), t, 20 + k, streams[0]);
        if exportable && !real_driver() {
            assert!(
                copies <= 1,
                "rank {rank}, {}: {copies} copies (direct flow: at most the fold table's upload)",
                t.name()
            );
            let again = call(comm, rank, n, (send, recv), t, 40 + k, streams[0]);
            assert_eq!(again, 0, "rank {rank}, {}: a repeated call copied", t.name());
        } else if !real_driver() {
            // Staged: the send buffer is copied in and the result out, at least.
            assert!(
                copies >= 2,
                "rank {rank}, {}: {copies} copies (a buffer that cannot be shared is staged)",
                t.name()
            );
        }
    }
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
    drop(mem);
}

/// Joins like [`join`], with GPU `dev`'s context current instead of GPU 0's.
fn join_on(rank: usize, n: usize, id: &str, dev: usize) -> (ncclComm_t, Vec<sys::CUstream>, oxccl::device::CtxGuard) {
    let (comm, streams, ctx) = join(rank, n, id);
    if dev == 0 {
        return (comm, streams, ctx);
    }
    for s in streams {
        // SAFETY: created by `join`, unused.
        unsafe { result::stream::destroy(s) }.unwrap();
    }
    drop(ctx);
    let ctx = oxccl::device::gpu(dev as i32).unwrap().enter().unwrap();
    let streams = (0..2).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect();
    (comm, streams, ctx)
}

/// Every type on stream-ordered pool memory, at offsets inside the allocations; rank r on GPU
/// r when `gpu_per_rank` (a peer's pool is then another device's: access granted on import).
fn pool_main(rank: usize, n: usize, id: &str, exportable: bool, gpu_per_rank: bool) {
    let dev = if gpu_per_rank { rank } else { 0 };
    let (comm, streams, _ctx) = join_on(rank, n, id, dev);
    let mut mem = Pool::on(dev as i32, exportable, streams[0]);
    let check = |copies: u64, t: DataType, what: &str| {
        if real_driver() {
            return;
        }
        if exportable {
            assert!(
                copies <= 1,
                "rank {rank}, {} {what}: {copies} copies (direct flow: at most the fold table's upload)",
                t.name()
            );
        } else {
            assert!(
                copies >= 2,
                "rank {rank}, {} {what}: {copies} copies (pool memory that cannot be shared is staged)",
                t.name()
            );
        }
    };
    for (k, &t) in DataType::ALL.iter().enumerate() {
        let send = mem.bufs[0] + (k % 3 * t.size()) as u64;
        let recv = if k % 2 == 0 { send } else { mem.bufs[1] + (k % 2 * t.size()) as u64 };
        let copies = call(comm, rank, n, (send, recv), t, 60 + k, streams[0]);
        check(copies, t, "first call");
        let again = call(comm, rank, n, (send, recv), t, 80 + k, streams[0]);
        if exportable && !real_driver() {
            assert_eq!(again, 0, "rank {rank}, {}: a repeated call copied", t.name());
        }
    }
    // A receive buffer freed and allocated again at the same place: another allocation, whose
    // import must replace the peers' import of the old one.
    mem.renew(1);
    let t = DataType::Float32;
    let copies = call(comm, rank, n, (mem.bufs[0], mem.bufs[1]), t, 99, streams[0]);
    check(copies, t, "after a new allocation");
    assert_eq!(ncclCommDestroy(comm), ncclResult_t::ncclSuccess);
    drop(mem);
}

fn run(entry: &str, n: usize) -> Vec<(bool, String)> {
    run_with(entry, n, &[])
}

fn run_with(entry: &str, n: usize, extra: &[(&'static str, String)]) -> Vec<(bool, String)> {
    let mut env = standin_env();
    env.extend(extra.iter().cloned());
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_TIMEOUT_MS", "60000".into()));
    let res = common::run_ranks(entry, n, &env, Duration::from_secs(240));
    common::assert_all_ok(&res);
    res
}

const DIRECT_LINE: &str = "direct flow from";
const REFUSED_LINE: &str = "cannot be shared with the peer processes";

#[test]
fn vmm_buffers_take_the_direct_flow_between_processes() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id, true);
        return;
    }
    for (i, (_, err)) in run("vmm_buffers_take_the_direct_flow_between_processes", 2).iter().enumerate() {
        assert!(err.contains(DIRECT_LINE), "rank {i}: no INFO line naming the direct flow:\n{err}");
        assert!(!err.contains(REFUSED_LINE), "rank {i}: exportable VMM memory was refused:\n{err}");
    }
}

#[test]
fn vmm_buffers_without_an_exportable_handle_take_the_staged_flow_with_one_warning() {
    if let Some((rank, n, id)) = common::child_role() {
        rank_main(rank, n, &id, false);
        return;
    }
    for (i, (_, err)) in
        run("vmm_buffers_without_an_exportable_handle_take_the_staged_flow_with_one_warning", 2).iter().enumerate()
    {
        let warns: Vec<&str> = err.lines().filter(|l| l.contains(REFUSED_LINE)).collect();
        assert_eq!(warns.len(), 1, "rank {i}: want one WARN line naming why:\n{err}");
        assert!(warns[0].contains("POSIX_FILE_DESCRIPTOR"), "rank {i}: the WARN line does not say why: {}", warns[0]);
    }
}

#[test]
fn exportable_pool_buffers_take_the_direct_flow_between_processes() {
    if let Some((rank, n, id)) = common::child_role() {
        pool_main(rank, n, &id, true, std::env::var("OXCCL_STANDIN_DEVICES").is_ok_and(|v| v == "2"));
        return;
    }
    let two_gpus = [("OXCCL_STANDIN_DEVICES", "2".to_string())];
    let runs = [run("exportable_pool_buffers_take_the_direct_flow_between_processes", 2), {
        if real_driver() {
            Vec::new()
        } else {
            run_with("exportable_pool_buffers_take_the_direct_flow_between_processes", 2, &two_gpus)
        }
    }];
    for (i, (_, err)) in runs.iter().flatten().enumerate() {
        assert!(err.contains(DIRECT_LINE), "rank {i}: no INFO line naming the direct flow:\n{err}");
        assert!(!err.contains(REFUSED_LINE), "rank {i}: exportable pool memory was refused:\n{err}");
        assert!(!err.contains("freeing an imported pool buffer"), "rank {i}: an import was not freed:\n{err}");
        assert!(!err.contains("cuda-standin"), "rank {i}: the stand-in complained:\n{err}");
    }
}

#[test]
fn default_pool_buffers_take_the_staged_flow_with_one_warning() {
    if let Some((rank, n, id)) = common::child_role() {
        pool_main(rank, n, &id, false, false);
        return;
    }
    for (i, (_, err)) in run("default_pool_buffers_take_the_staged_flow_with_one_warning", 2).iter().enumerate() {
        let warns: Vec<&str> = err.lines().filter(|l| l.contains(REFUSED_LINE)).collect();
        assert_eq!(warns.len(), 1, "rank {i}: want one WARN line naming why:\n{err}");
        for why in ["default pool", "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"] {
            assert!(warns[0].contains(why), "rank {i}: the WARN line does not name {why:?}: {}", warns[0]);
        }
    }
}

/// The stand-in's pools refuse what the driver documents as refused (one process, no
/// communicator): exporting the default pool or its pointers, importing a pointer into a pool
/// that is not an imported one; and answer what oxccl asks of pool memory.
fn standin_pool_main() {
    let _ctx = oxccl::device::gpu(0).unwrap().enter().unwrap();
    let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let fd_type = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let ok = sys::CUresult::CUDA_SUCCESS;
    let pool_attr = |p: u64| {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE;
        // SAFETY: writes one pool handle.
        assert_eq!(unsafe { sys::cuPointerGetAttribute((&mut pool as *mut sys::CUmemoryPool).cast(), attr, p) }, ok);
        pool
    };
    let export_fd = |pool: sys::CUmemoryPool| {
        let mut fd: i32 = -1;
        // SAFETY: writes an int for this handle type.
        let r = unsafe { sys::cuMemPoolExportToShareableHandle((&mut fd as *mut i32).cast(), pool, fd_type, 0) };
        if r == ok {
            // SAFETY: a descriptor the stand-in opened for us.
            drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
        r
    };
    let export_ptr = |p: u64| {
        let mut data = sys::CUmemPoolPtrExportData { reserved: [0; 64] };
        // SAFETY: writes 64 bytes.
        (unsafe { sys::cuMemPoolExportPointer(&mut data, p) }, data)
    };
    let mut dflt: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes the pool handle.
    assert_eq!(unsafe { sys::cuDeviceGetDefaultMemPool(&mut dflt, 0) }, ok);
    let shared = Pool::new(true, stream);
    let plain = Pool::new(false, stream);
    assert_eq!(pool_attr(shared.bufs[0]), shared.pool.unwrap());
    assert_eq!(pool_attr(plain.bufs[0]), dflt);
    let mut dev = 0;
    // SAFETY: writes the address.
    assert_eq!(unsafe { sys::cuMemAlloc_v2(&mut dev, 4096) }, ok);
    assert!(pool_attr(dev).is_null(), "cuMemAlloc memory names a pool");
    // SAFETY: allocated above, freed once.
    assert_eq!(unsafe { sys::cuMemFree_v2(dev) }, ok);
    // The default pool, and its pointers, cannot be exported; an exportable pool's can.
    assert_ne!(export_fd(dflt), ok, "the default pool was exported");
    assert_ne!(export_ptr(plain.bufs[0]).0, ok, "a default-pool pointer was exported");
    assert_eq!(export_fd(shared.pool.unwrap()), ok);
    let (r, mut data) = export_ptr(shared.bufs[0]);
    assert_eq!(r, ok);
    // A pointer imports only into the imported pool it comes from, never into a pool of its own.
    let mut at = 0;
    for pool in [shared.pool.unwrap(), dflt] {
        // SAFETY: writes the address on success.
        assert_ne!(
            unsafe { sys::cuMemPoolImportPointer(&mut at, pool, &mut data) },
            ok,
            "imported into a pool not imported"
        );
    }
    // SAFETY: a live stream.
    unsafe { result::stream::synchronize(stream) }.unwrap();
    drop((shared, plain));
}

#[test]
fn standin_pools_refuse_what_the_driver_refuses() {
    if real_driver() {
        println!("SKIPPED: stand-in semantics only (OXCCL_DEVICE_TESTS_REAL=1)");
        return;
    }
    if common::child_role().is_some() {
        standin_pool_main();
        return;
    }
    run("standin_pools_refuse_what_the_driver_refuses", 1);
}
