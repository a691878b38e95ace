//! CUDA device memory: detection, pointer classification, per-GPU contexts, and the device
//! path of collectives.
//!
//! The CUDA driver (`libcuda`) and NVRTC are loaded at run time through cudarc's dynamic
//! loading, so the library builds and runs without CUDA. Nothing here calls into cudarc before
//! [`available`] has checked `is_culib_present()` (cudarc panics on a missing library), and every
//! call that could still panic (a symbol missing from an old driver) runs under `catch_unwind`
//! at the ABI boundary. On a machine without the driver or without a GPU, [`available`] is
//! false, [`classify`] says [`MemKind::Host`] for every pointer, and `OXCCL_DEBUG=INFO` logs
//! "CUDA not found: host memory only" once.
//!
//! Layout: [`kernels`] (NVRTC compile of `cuda/reduce.cu`, once per architecture) and `kcache`
//! (its cubins kept on disk), [`ops`] (stream-ordered kernel launches and copies), `kinds`
//! (buffer classification, cached per allocation), [`mem`] (`ncclMemAlloc` and the
//! communicator's GPU), `pinned` (mapped host memory), `state` (per-communicator device state
//! and the entry points), `setup` (the mode every rank picks: CUDA IPC or the proxy), `run` (the
//! device executor: the route of a call or group, run in a device session). CUDA IPC between
//! the ranks of one host: `region` (what a rank exports), `flags` (host-shared flag pages),
//! `mesh` (the mapped regions, barriers, sequence numbers and tickets every flow runs on),
//! `ipc` (the IPC state and the dispatcher of the all-reduce's flows), `small` (the one-launch
//! LL all-reduce), `window` (window plans run on the GPU), `direct` (the direct all-reduce
//! between processes), `bufs` and `vmm` (sharing user buffers: IPC handles, or POSIX
//! descriptors of `cuMemCreate` memory), `oneshot` (the other collectives), `p2p`
//! (send/receive), `watch` (the watchdog bounding every wait).
//! The proxy: `proxy` (device buffers staged through pinned host memory into the host engine)
//! and `exec` (any call or group: the host plans run on pinned staging).
//! `docs/ARCHITECTURE.md` ("The device path (CUDA)") explains the design.

mod bufs;
mod capture;
mod direct;
mod entry;
pub mod exec;
mod flags;
mod ipc;
mod kcache;
pub mod kernels;
mod kinds;
mod layout;
mod lockstep;
pub mod mem;
mod mesh;
mod oneshot;
pub mod ops;
mod p2p;
mod pinned;
mod proxy;
mod region;
mod run;
mod session;
mod setup;
mod small;
mod state;
mod vmm;
mod watch;
mod window;

pub use entry::all_reduce;
pub(crate) use entry::{enqueue, enqueue_group, GroupPart};
pub use exec::{DevOp, Scalar};
pub use kinds::cached as classifications_cached;
pub(crate) use kinds::forget;
pub use state::{memory, path};
pub(crate) use state::{quiesce, set_up_together};

use crate::error::{Error, ErrorKind, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// What the driver said at start-up: number of GPUs, or why there is no CUDA.
struct Driver {
    devices: i32,
}

/// Probes the driver once per process.
fn driver() -> Option<&'static Driver> {
    static D: OnceLock<Option<Driver>> = OnceLock::new();
    D.get_or_init(|| {
        let d = probe();
        if let Err(why) = &d {
            crate::info!("CUDA not found: host memory only ({why})");
        }
        d.ok()
    })
    .as_ref()
}

fn probe() -> std::result::Result<Driver, String> {
    if !crate::config::process().cuda {
        return Err(format!("disabled by {}=0", crate::log::var_name("CUDA")));
    }
    // SAFETY: only tries dlopen() on the candidate library names; no CUDA call is made.
    let present = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err("no libcuda.so".into());
    }
    let init = std::panic::catch_unwind(|| {
        cudarc::driver::result::init().map_err(|e| format!("cuInit: {e:?}"))?;
        cudarc::driver::result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))
    });
    match init {
        Ok(Ok(n)) if n > 0 => {
            crate::info!("CUDA driver loaded: {n} GPU(s)");
            Ok(Driver { devices: n })
        }
        Ok(Ok(_)) => Err("the driver sees no GPU".into()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the CUDA driver library lacks a required symbol".into()),
    }
}

/// True when this process has already loaded the CUDA driver library (the application uses
/// CUDA). Checked without loading or initialising it: a program that never touched CUDA can hold
/// no device pointer, so host collectives then never load the driver or call `cuInit` (which
/// would make a later `fork` unsafe on GPU machines).
pub fn driver_loaded() -> bool {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    static LOADED: AtomicBool = AtomicBool::new(false);
    // The loader's load count when the library was last looked for and not found: until another
    // object is loaded, it still is not (a look-up by name searches the library path, ~16 failing
    // opens per call, most of a small host collective's cost when there is no libcuda).
    static MISSING_AT: AtomicU64 = AtomicU64::new(0);
    if LOADED.load(Ordering::Relaxed) {
        return true;
    }
    let loads = loads_so_far();
    if loads != 0 && MISSING_AT.load(Ordering::Relaxed) == loads {
        return false;
    }
    let found = [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
        // SAFETY: RTLD_NOLOAD only looks the name up among loaded objects; the reference it may
        // take is released at once.
        unsafe {
            let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if !h.is_null() {
                libc::dlclose(h);
            }
            !h.is_null()
        }
    });
    if found {
        LOADED.store(true, Ordering::Relaxed);
    } else {
        MISSING_AT.store(loads, Ordering::Relaxed);
    }
    found
}

/// How many objects the dynamic loader has loaded into this process so far (glibc's
/// `dlpi_adds`, which only grows); 0 when the loader does not report it.
fn loads_so_far() -> u64 {
    unsafe extern "C" fn first(info: *mut libc::dl_phdr_info, size: libc::size_t, data: *mut c_void) -> libc::c_int {
        let needed = std::mem::offset_of!(libc::dl_phdr_info, dlpi_adds) + std::mem::size_of::<u64>();
        if size >= needed {
            // SAFETY: the loader passes a valid `dl_phdr_info` of `size` bytes, which holds
            // `dlpi_adds` (checked above); `data` is the `u64` below, alive for the call.
            unsafe { *(data as *mut u64) = (*info).dlpi_adds };
        }
        1 // stop after the first object: the count is the same in every one
    }
    let mut loads = 0u64;
    // SAFETY: `first` matches the callback type and only writes `loads` through `data`.
    unsafe { libc::dl_iterate_phdr(Some(first), &mut loads as *mut u64 as *mut c_void) };
    loads
}

/// True when the loaded CUDA driver library exports `name` (an entry point newer drivers
/// added): cudarc's loader panics on a missing symbol, so optional ones are looked up first.
pub(crate) fn driver_has(name: &std::ffi::CStr) -> bool {
    [c"libcuda.so.1", c"libcuda.so"].iter().any(|lib| {
        // SAFETY: RTLD_NOLOAD only looks the library up among loaded objects; the symbol is
        // only looked up, never called; the reference taken is released at once.
        unsafe {
            let h = libc::dlopen(lib.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if h.is_null() {
                return false;
            }
            let found = !libc::dlsym(h, name.as_ptr()).is_null();
            libc::dlclose(h);
            found
        }
    })
}

/// True when the CUDA driver is loaded and sees at least one GPU.
pub fn available() -> bool {
    driver().is_some()
}

/// Number of GPUs the driver sees (0 without CUDA).
pub fn device_count() -> usize {
    driver().map_or(0, |d| d.devices as usize)
}

/// `ncclUnhandledCudaError` for a failed driver call `what`.
pub(crate) fn cu_err(r: sys::CUresult, what: &str) -> Error {
    Error::new(ErrorKind::UnhandledCuda, format!("{what} failed: {r:?}"))
}

/// Turns a driver result into `ncclUnhandledCudaError` naming the call.
pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cu_err(r, what))
    }
}

/// One device all-reduce as the device paths receive it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevCall {
    /// Device address of the send buffer.
    pub send: u64,
    /// Device address of the receive buffer (equal to `send` in place).
    pub recv: u64,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: crate::types::DataType,
    /// Operator.
    pub op: crate::types::ReduceOp,
    /// The user's stream.
    pub stream: sys::CUstream,
}

/// Where a buffer lives, as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Ordinary (pageable) host memory, unknown to CUDA; also every pointer without CUDA.
    Host,
    /// Page-locked host memory registered with CUDA (`cudaMallocHost`, `cudaHostRegister`).
    PinnedHost,
    /// Device memory of GPU `ordinal` (`cudaMalloc`).
    Device {
        /// The GPU's ordinal.
        ordinal: i32,
    },
    /// Managed (unified) memory (`cudaMallocManaged`), associated with GPU `ordinal`.
    Managed {
        /// The GPU's ordinal.
        ordinal: i32,
    },
}

impl MemKind {
    /// True for memory the host path reads and writes directly.
    pub fn is_host(self) -> bool {
        matches!(self, MemKind::Host | MemKind::PinnedHost)
    }
    /// The GPU of device or managed memory.
    pub fn ordinal(self) -> Option<i32> {
        match self {
            MemKind::Device { ordinal } | MemKind::Managed { ordinal } => Some(ordinal),
            _ => None,
        }
    }
}

fn pointer_attr(ptr: *const c_void, attr: sys::CUpointer_attribute) -> std::result::Result<u32, sys::CUresult> {
    let mut v: u32 = 0;
    // SAFETY: every attribute read here (memory type, is-managed, device ordinal) is a 32-bit
    // integer, written into `v`; the pointer is only inspected by the driver, never accessed.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut u32).cast(), attr, ptr as sys::CUdeviceptr) };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(v)
    } else {
        Err(r)
    }
}

/// Classifies a buffer with `cuPointerGetAttribute`.
///
/// Without CUDA, and for NULL, every pointer is [`MemKind::Host`]; the driver's
/// `CUDA_ERROR_INVALID_VALUE` (a pointer it does not know) also means ordinary host memory.
pub fn classify(ptr: *const c_void) -> Result<MemKind> {
    if ptr.is_null() || !driver_loaded() || !available() {
        return Ok(MemKind::Host);
    }
    use sys::CUpointer_attribute as A;
    let mut first = pointer_attr(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
    // Some drivers want a current context even for these queries: redo them under a context
    // this process already holds (never retaining one just for this: that would create GPU 0's
    // primary context in a process that may not use GPU 0).
    let _ctx = match first {
        Err(sys::CUresult::CUDA_ERROR_INVALID_CONTEXT) => match retained_gpus().into_iter().next() {
            Some(g) => {
                let guard = g.enter()?;
                first = pointer_attr(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
                Some(guard)
            }
            None => None,
        },
        _ => None,
    };
    let kind = match first {
        Ok(t) => t,
        Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE) => return Ok(MemKind::Host),
        Err(r) => return Err(cu_err(r, &format!("cuPointerGetAttribute({ptr:p})"))),
    };
    let managed = pointer_attr(ptr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED).unwrap_or(0) != 0;
    let ordinal = || {
        pointer_attr(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
            .map(|o| o as i32)
            .map_err(|r| cu_err(r, &format!("cuPointerGetAttribute(DEVICE_ORDINAL, {ptr:p})")))
    };
    if managed {
        return Ok(MemKind::Managed { ordinal: ordinal()? });
    }
    if kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
        Ok(MemKind::PinnedHost)
    } else if kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        Ok(MemKind::Device { ordinal: ordinal()? })
    } else {
        Err(Error::invalid_argument(format!(
            "buffer {ptr:p} is CUDA memory of type {kind}, which collectives do not support"
        )))
    }
}

/// Where a call runs, decided from its buffers (the call layer's [`crate::call::Target`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Host memory: the blocking host path (after synchronising a non-null stream).
    Host,
    /// Device (or managed) memory of GPU `ordinal`: the stream-ordered device path.
    Device {
        /// The GPU holding both buffers.
        ordinal: i32,
    },
}

/// Decides the path of a call from its buffers, and for host buffers synchronises `stream`
/// (when non-null and CUDA is present) so the host sees the results of earlier GPU work.
///
/// Buffers of different kinds (host and device, or two GPUs) are `ncclInvalidArgument`.
pub fn route(send: *const c_void, recv: *const c_void, stream: *mut c_void) -> Result<Target> {
    if !driver_loaded() || !available() {
        return Ok(Target::Host);
    }
    let (s, r) = (kinds::classify_cached(send)?, kinds::classify_cached(recv)?);
    // A NULL buffer (count 0) takes the kind of the other one.
    let (s, r) = match (send.is_null(), recv.is_null()) {
        (true, false) => (r, r),
        (false, true) => (s, s),
        _ => (s, r),
    };
    if s.is_host() && r.is_host() {
        // A call with no buffer (count 0) reads and writes nothing: no GPU work to wait for.
        let no_buffer = send.is_null() && recv.is_null();
        if !stream.is_null() && !no_buffer {
            sync_user_stream(stream as sys::CUstream)?;
        }
        return Ok(Target::Host);
    }
    match (s.ordinal(), r.ordinal()) {
        (Some(a), Some(b)) if a == b => Ok(Target::Device { ordinal: a }),
        (Some(a), Some(b)) => Err(Error::invalid_argument(format!(
            "sendbuff is on GPU {a} but recvbuff is on GPU {b}: both must be on one GPU"
        ))),
        _ => Err(Error::invalid_argument(format!(
            "sendbuff is {} but recvbuff is {}: both must be host memory or both device memory",
            describe(s),
            describe(r)
        ))),
    }
}

/// Synchronises a user's stream. When the calling thread has no current context (the driver
/// then refuses stream calls), retries under each GPU context this process holds: the stream
/// belongs to one of them.
fn sync_user_stream(stream: sys::CUstream) -> Result<()> {
    // SAFETY: a non-null stream handle given by the caller (the NCCL contract).
    let sync = || unsafe { sys::cuStreamSynchronize(stream) };
    let mut r = sync();
    if r == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
        for g in retained_gpus() {
            let _ctx = g.enter()?;
            r = sync();
            if r != sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
                break;
            }
        }
    }
    check(r, "cuStreamSynchronize(stream)")
}

fn describe(k: MemKind) -> String {
    match k {
        MemKind::Host => "host memory".into(),
        MemKind::PinnedHost => "pinned host memory".into(),
        MemKind::Device { ordinal } => format!("device memory of GPU {ordinal}"),
        MemKind::Managed { ordinal } => format!("managed memory of GPU {ordinal}"),
    }
}

/// One GPU as this process uses it: its primary context (retained), properties, and the
/// reduction kernels loaded into that context (compiled on first use).
pub struct Gpu {
    /// Device ordinal.
    pub ordinal: i32,
    ctx: sys::CUcontext,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`: 64-bit stream memory operations
    /// work here (otherwise `device::write_value64` writes two 32-bit halves).
    pub memop64: bool,
    kernels: OnceLock<std::result::Result<Arc<kernels::Kernels>, Error>>,
}

// SAFETY: a CUDA context handle may be used from any thread (each call pushes it first), and
// the loaded kernels are immutable function handles.
unsafe impl Send for Gpu {}
// SAFETY: as above; shared access only reads the handles.
unsafe impl Sync for Gpu {}

fn gpus() -> &'static Mutex<HashMap<i32, Arc<Gpu>>> {
    static GPUS: OnceLock<Mutex<HashMap<i32, Arc<Gpu>>>> = OnceLock::new();
    GPUS.get_or_init(Default::default)
}

/// The GPUs whose primary context this process has retained so far.
fn retained_gpus() -> Vec<Arc<Gpu>> {
    crate::sync::lock(gpus()).values().cloned().collect()
}

/// The process-wide [`Gpu`] for `ordinal` (created on first use).
pub fn gpu(ordinal: i32) -> Result<Arc<Gpu>> {
    if !available() {
        return Err(Error::new(
            ErrorKind::UnhandledCuda,
            "no CUDA device: the CUDA driver (libcuda.so) or a GPU is missing",
        ));
    }
    let mut map = crate::sync::lock(gpus());
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    if ordinal < 0 || ordinal as usize >= device_count() {
        return Err(Error::invalid_argument(format!("GPU {ordinal} does not exist ({} visible)", device_count())));
    }
    let dev =
        cudarc::driver::result::device::get(ordinal).map_err(|e| cu_err(e.0, &format!("cuDeviceGet({ordinal})")))?;
    // SAFETY: `dev` is a valid device handle; the primary context is retained for the process.
    let ctx = unsafe { cudarc::driver::result::primary_ctx::retain(dev) }
        .map_err(|e| cu_err(e.0, &format!("cuDevicePrimaryCtxRetain({ordinal})")))?;
    let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
        // SAFETY: valid device handle; the attribute is an int.
        unsafe { cudarc::driver::result::device::get_attribute(dev, a) }
            .map_err(|e| cu_err(e.0, &format!("cuDeviceGetAttribute({a:?})")))
    };
    use sys::CUdevice_attribute as DA;
    let g = Arc::new(Gpu {
        ordinal,
        ctx,
        sm_count: attr(DA::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
        cc: (
            attr(DA::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(DA::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        memop64: attr(DA::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS).unwrap_or(0) != 0,
        kernels: OnceLock::new(),
    });
    crate::info!("GPU {ordinal}: compute capability {}.{}, {} SMs", g.cc.0, g.cc.1, g.sm_count);
    if !g.memop64 {
        WITHOUT_MEMOP64.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    map.insert(ordinal, g.clone());
    Ok(g)
}

impl Gpu {
    /// The primary context's handle.
    pub fn context(&self) -> sys::CUcontext {
        self.ctx
    }

    /// Makes this GPU's primary context current on the calling thread until the guard drops.
    pub fn enter(&self) -> Result<CtxGuard> {
        // SAFETY: `ctx` is the retained primary context of this GPU.
        check(unsafe { sys::cuCtxPushCurrent_v2(self.ctx) }, "cuCtxPushCurrent")?;
        Ok(CtxGuard(()))
    }

    /// The reduction kernels, compiled (once per architecture) and loaded (once per GPU).
    /// The context must be current ([`Gpu::enter`]).
    pub fn kernels(&self) -> Result<Arc<kernels::Kernels>> {
        self.kernels.get_or_init(|| kernels::Kernels::load(self.cc).map(Arc::new)).clone()
    }
}

/// Enqueues a write of the 64-bit `value` to `addr` on `stream` (of the current context's
/// device): one `cuStreamWriteValue64` where the device reports 64-bit stream memory operations,
/// otherwise two `cuStreamWriteValue32`, the low half first (a WARN line once per process). Each
/// write without `NO_MEMORY_BARRIER` orders the work before it, so a reader that sees the new
/// high half sees the low half too; none sees a torn value after the stream passed both.
///
/// # Safety
/// `addr` must be an 8-byte aligned device-accessible word that stays valid until the stream
/// executes the write.
pub(crate) unsafe fn write_value64(stream: sys::CUstream, addr: u64, value: u64, what: &str) -> Result<()> {
    let write = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // Only a process that retained a GPU without them asks which device is current.
    if !WITHOUT_MEMOP64.load(std::sync::atomic::Ordering::Relaxed) || current_memop64()? {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { sys::cuStreamWriteValue64_v2(stream, addr, value, write) };
        if rc == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        return Err(cu_err(rc, &format!("cuStreamWriteValue64({what})")));
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        crate::warn!(
            "this GPU has no 64-bit stream memory operations (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0): \
             64-bit flag words are written as two 32-bit halves"
        )
    });
    for (off, half) in [(0, value as u32), (4, (value >> 32) as u32)] {
        // SAFETY: both halves lie in the word of this function's contract (little-endian).
        check(
            unsafe { sys::cuStreamWriteValue32_v2(stream, addr + off, half, write) },
            &format!("cuStreamWriteValue32({what}, half at +{off})"),
        )?;
    }
    Ok(())
}

/// Set once this process retained a GPU without 64-bit stream memory operations: only then
/// does [`write_value64`] look up the current device.
static WITHOUT_MEMOP64: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the current context's device has 64-bit stream memory operations.
fn current_memop64() -> Result<bool> {
    let mut dev = 0;
    // SAFETY: writes one int; fails without a current context.
    check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(crate::sync::lock(gpus()).get(&dev).is_some_and(|g| g.memop64))
}

/// Pops the context pushed by [`Gpu::enter`].
pub struct CtxGuard(());

impl Drop for CtxGuard {
    fn drop(&mut self) {
        let mut old: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context this guard pushed (the output handle is just written).
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_pointers_route_to_the_host_path() {
        let a = [1u8; 16];
        let mut b = [0u8; 16];
        // Plain stack memory is host memory whether or not CUDA is present.
        assert_eq!(classify(a.as_ptr().cast()).unwrap(), MemKind::Host);
        assert_eq!(route(a.as_ptr().cast(), b.as_mut_ptr().cast(), std::ptr::null_mut()).unwrap(), Target::Host);
        assert_eq!(classify(std::ptr::null()).unwrap(), MemKind::Host);
        assert!(MemKind::PinnedHost.is_host() && !MemKind::Device { ordinal: 0 }.is_host());
        assert_eq!(MemKind::Managed { ordinal: 3 }.ordinal(), Some(3));
    }

    /// The load count that lets `driver_loaded` skip its look-up grows when a new object is
    /// loaded, so a driver loaded after a negative answer is still found.
    #[test]
    fn the_load_count_grows_with_a_new_object() {
        let before = loads_so_far();
        assert!(before > 0, "glibc reports dlpi_adds");
        let loaded = |name: &std::ffi::CStr| {
            // SAFETY: RTLD_NOLOAD only looks the name up among loaded objects.
            let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            !h.is_null()
        };
        // A glibc library this test binary does not link, loaded now.
        let name = [c"libanl.so.1", c"libresolv.so.2", c"libutil.so.1", c"libBrokenLocale.so.1"]
            .into_iter()
            .find(|n| !loaded(n))
            .expect("one of glibc's small libraries is not loaded yet");
        let answer = driver_loaded();
        assert_eq!(driver_loaded(), answer, "a cached answer equals the looked-up one");
        // SAFETY: loading a glibc library runs no code of ours; it stays loaded (never closed).
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY) };
        assert!(!h.is_null(), "{name:?} loads");
        assert!(loads_so_far() > before, "loading {name:?} grew the count");
    }
}
