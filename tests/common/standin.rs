//! The CUDA stand-in (cuda-standin/) for device tests: built once per test process and put
//! first on the loader path of rank processes; or whatever CUDA is on the loader path (GPU kit).

use cudarc::driver::{result, sys};
use oxccl::ffi::config::ncclCommGetAsyncError;
use oxccl::ffi::{comm::ncclCommInitRank, ncclComm_t, ncclResult_t};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Set by the GPU check kit (docs/GPU.md): use whatever CUDA is on the loader path instead of
/// building the stand-in.
pub fn real_driver() -> bool {
    std::env::var("OXCCL_DEVICE_TESTS_REAL").is_ok_and(|v| v == "1")
}

/// Builds the stand-in once per test process and returns the environment that puts it first
/// on the loader path (empty on the real driver). `OXCCL_TEST_STANDIN_DIR` names a prebuilt
/// stand-in to use instead (nothing is built).
pub fn standin_env() -> Vec<(&'static str, String)> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if real_driver() {
        return Vec::new();
    }
    if let Ok(dir) = std::env::var("OXCCL_TEST_STANDIN_DIR") {
        // A prebuilt stand-in (the GPU check kit's `run --standin`): its caches and the loader
        // path come from the caller's environment.
        let ld = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        return vec![("LD_LIBRARY_PATH", if ld.is_empty() { dir } else { format!("{dir}:{ld}") })];
    }
    let dir = DIR.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-standin");
        let st = std::process::Command::new("bash")
            .arg(format!("{root}/cuda-standin/build.sh"))
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run cuda-standin/build.sh (needs bash and cc)");
        assert!(st.success(), "building the CUDA stand-in failed");
        out
    });
    let ld = match std::env::var("LD_LIBRARY_PATH") {
        Ok(v) if !v.is_empty() => format!("{}:{v}", dir.display()),
        _ => dir.display().to_string(),
    };
    vec![
        ("LD_LIBRARY_PATH", ld),
        ("OXCCL_STANDIN_CACHE", PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("standin-cache").display().to_string()),
        // Kernel images of the stand-in name its builds in the directory above: keep them beside it.
        ("OXCCL_KERNEL_CACHE", PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache").display().to_string()),
        // A lost wake-up shows as a reported deadlock, never as a hung test.
        ("OXCCL_STANDIN_WAIT_MS", "60000".into()),
    ]
}

/// A device allocation freed on drop (the GPU's context current while alive).
pub struct DevMem(pub u64);
impl DevMem {
    pub fn new(bytes: usize) -> DevMem {
        // SAFETY: plain allocation in the current context.
        DevMem(unsafe { result::malloc_sync(bytes.max(16)) }.expect("cuMemAlloc"))
    }
}
impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once (streams using it were synchronised).
        let _ = unsafe { result::free_sync(self.0) };
    }
}

/// The communicator's asynchronous error, polled until it is set or `limit` passes.
pub fn wait_async_error(comm: ncclComm_t, limit: Duration) -> ncclResult_t {
    let start = Instant::now();
    loop {
        let mut e = ncclResult_t::ncclSuccess;
        assert_eq!(ncclCommGetAsyncError(comm, &mut e), ncclResult_t::ncclSuccess);
        if e != ncclResult_t::ncclSuccess || start.elapsed() > limit {
            return e;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Counters of the CUDA stand-in loaded in this process (`oxccl_standin_count`, see
/// cuda-standin/README.md): (stream operations enqueued, `cuPointerGetAttribute` calls), over
/// every thread; `None` on the real driver.
pub fn standin_counts() -> Option<(u64, u64)> {
    Some((standin_count(100)?, standin_count(101)?))
}

/// One counter of the CUDA stand-in loaded in this process (`oxccl_standin_count(what)`: 0..10
/// stream operations by kind, 100 all of them, 101 attribute queries, ...); `None` on the real
/// driver.
pub fn standin_count(what: i32) -> Option<u64> {
    type Count = unsafe extern "C" fn(i32) -> u64;
    static F: OnceLock<Option<Count>> = OnceLock::new();
    let f = (*F.get_or_init(|| {
        // SAFETY: looks the stand-in's counter up in the already loaded driver library; the
        // library stays loaded for the process (cudarc holds it).
        unsafe {
            let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if h.is_null() {
                return None;
            }
            let p = libc::dlsym(h, c"oxccl_standin_count".as_ptr());
            (!p.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, Count>(p))
        }
    }))?;
    // SAFETY: the stand-in's counter reader, `uint64_t oxccl_standin_count(int)`.
    Some(unsafe { f(what) })
}

/// Uploads `data` to `dst` on `stream` and waits for it: a synchronous copy from pageable
/// memory is ordered on the legacy stream only, not before work on a non-blocking stream.
pub fn upload(dst: u64, data: &[u8], stream: sys::CUstream) {
    // SAFETY: every caller's `dst` holds data.len() bytes; `data` outlives the copy (the stream
    // is synchronised before returning).
    unsafe { result::memcpy_htod_async(dst, data, stream) }.expect("upload");
    // SAFETY: a live stream of the current context.
    unsafe { result::stream::synchronize(stream) }.expect("upload");
}

/// Joins the communicator of this child rank with GPU 0's context current, and two streams.
pub fn join(rank: usize, n: usize, id_hex: &str) -> (ncclComm_t, Vec<sys::CUstream>, oxccl::device::CtxGuard) {
    let id = oxccl::UniqueId::from_hex(id_hex).expect("id");
    let mut cid = oxccl::ffi::ncclUniqueId { internal: [0; 128] };
    for (d, s) in cid.internal.iter_mut().zip(id.bytes) {
        *d = s as std::ffi::c_char;
    }
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(ncclCommInitRank(&mut comm, n as i32, cid, rank as i32), ncclResult_t::ncclSuccess);
    let guard = oxccl::device::gpu(0).unwrap().enter().unwrap();
    let streams = (0..2).map(|_| result::stream::create(result::stream::StreamKind::NonBlocking).unwrap()).collect();
    (comm, streams, guard)
}

/// Runs `body(rank, comm, stream)` for `n` ranks as threads of this process, one
/// communicator each from `ncclCommInitAll` on GPU 0, each thread with GPU 0's context current
/// and a non-blocking stream of its own (destroyed after `body`, which must leave it
/// synchronised); the communicators are destroyed at the end.
pub fn as_threads(n: usize, body: impl Fn(usize, ncclComm_t, sys::CUstream) + Sync) {
    let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); n];
    let devs = vec![0i32; n];
    assert_eq!(
        oxccl::ffi::config::ncclCommInitAll(comms.as_mut_ptr(), n as i32, devs.as_ptr()),
        ncclResult_t::ncclSuccess
    );
    let gpu = oxccl::device::gpu(0).unwrap();
    std::thread::scope(|s| {
        for (rank, &comm) in comms.iter().enumerate() {
            let (gpu, body, comm) = (&gpu, &body, comm as usize);
            s.spawn(move || {
                let _ctx = gpu.enter().unwrap();
                let stream = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
                body(rank, comm as ncclComm_t, stream);
                // SAFETY: `body` left the stream synchronised; destroyed once.
                unsafe { result::stream::destroy(stream) }.unwrap();
            });
        }
    });
    for c in comms {
        assert_eq!(oxccl::ffi::comm::ncclCommDestroy(c), ncclResult_t::ncclSuccess);
    }
}
