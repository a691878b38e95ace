//! The device kernels: `cuda/reduce.cu`, embedded in the library, compiled at run time with
//! NVRTC for the GPU's architecture and loaded into each GPU's primary context.
//!
//! Only what a call needs is compiled, on first use: the source is compiled once per [`Unit`]
//! (the reduce-copy and fold of one type and operator, the divide and scale of one type, or the
//! LL all-reduce of one type and operator), selected with `-D` macros (`OX_SEL_TYPE`,
//! `OX_SEL_OP`, `OX_SEL_MAP`, `OX_SEL_LL`; entry-point names do not
//! change), per architecture per process and through the on-disk cache (`device::kcache`,
//! keyed by the options, so per selection), where the ranks of one host take turns on a lock so
//! that one compiles and the others load its image. The whole file for sm_90 takes NVRTC 13.5
//! about 45 s of CPU; the unit of an f32 sum under a second (docs/GPU.md, "Compiling the kernels").
//!
//! Compilation asks NVRTC for a cubin of the exact architecture (`sm_XY`), which the driver
//! loads without a JIT step and whatever its own PTX level. If this NVRTC does not know the
//! architecture (a GPU newer than the NVRTC), it falls back to PTX for the newest architecture
//! NVRTC supports, which the driver compiles forward. If the driver rejects the cubin, the module
//! is loaded from PTX instead (a WARN line) when this NVRTC is no newer than the driver's CUDA;
//! an NVRTC newer than the driver writes PTX the driver refuses too, so that case is an error
//! naming both versions and what to install.

use super::check;
use crate::error::{Error, ErrorKind, Result};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nv;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The CUDA C++ source of every kernel (`cuda/reduce.cu`).
pub const SOURCE: &str = include_str!("../../cuda/reduce.cu");

/// The kernel source's name for each type, in `ncclDataType_t` order.
const TYPE_TAGS: [&str; 12] = ["i8", "u8", "i32", "u32", "i64", "u64", "f16", "f32", "f64", "bf16", "e4m3", "e5m2"];

/// The tag of `dtype` in kernel names (`f32`, `bf16`, `e4m3`, ...).
pub fn type_tag(dtype: DataType) -> &'static str {
    TYPE_TAGS[dtype as usize]
}

/// `oxccl_reduce_<type>_<op>`: `dst = a op b` (avg divides by its `div` argument when > 1).
pub fn reduce_name(dtype: DataType, op: ReduceOp) -> String {
    format!("oxccl_reduce_{}_{}", type_tag(dtype), op.name())
}

/// `oxccl_fold_<type>_<op>`: the fold of a window plan over a table of `nsrc` sources and
/// `ndst` destinations in device memory.
pub fn fold_name(dtype: DataType, op: ReduceOp) -> String {
    format!("oxccl_fold_{}_{}", type_tag(dtype), op.name())
}

/// `oxccl_divide_<type>`: `dst = src / div`.
pub fn divide_name(dtype: DataType) -> String {
    format!("oxccl_divide_{}", type_tag(dtype))
}

/// `oxccl_scale_<type>`: `dst = src * factor` (PreMulSum).
pub fn scale_name(dtype: DataType) -> String {
    format!("oxccl_scale_{}", type_tag(dtype))
}

/// `oxccl_ll_<type>_<op>`: a whole small all-reduce in one launch (the LL flow,
/// `device::small`).
pub fn ll_name(dtype: DataType, op: ReduceOp) -> String {
    format!("oxccl_ll_{}_{}", type_tag(dtype), op.name())
}

/// Every entry point the library looks up: 12 types × (5 reduce-copies, 5 folds, divide,
/// scale, 5 LL all-reduces).
pub fn all_names() -> Vec<String> {
    let mut v = Vec::new();
    for t in DataType::ALL {
        v.extend(ReduceOp::ALL.iter().map(|&o| reduce_name(t, o)));
        v.extend(ReduceOp::ALL.iter().map(|&o| fold_name(t, o)));
        v.push(divide_name(t));
        v.push(scale_name(t));
        v.extend(ReduceOp::ALL.iter().map(|&o| ll_name(t, o)));
    }
    v
}

/// A set of entry points compiled together: the reduce-copy and fold of one type and operator
/// (`op` set), the divide and scale of one type (`op` None), or the LL all-reduce of one type
/// and operator alone (`ll`, `op` set: a unit of its own, so that neither the calls that use it
/// nor those that do not compile more than they need).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Unit {
    /// The element type.
    pub dtype: DataType,
    /// The operator of a reduce-copy/fold or LL unit; `None` for divide and scale.
    pub op: Option<ReduceOp>,
    /// The LL all-reduce's unit (with `op` set).
    pub ll: bool,
}

impl Unit {
    /// The unit that holds entry point `name` (one of [`all_names`]).
    pub fn of(name: &str) -> Option<Unit> {
        let rest = name.strip_prefix("oxccl_")?;
        let (family, rest) = rest.split_once('_')?;
        let (tag, op) = match family {
            "reduce" | "fold" | "ll" => {
                let (t, o) = rest.split_once('_')?;
                (t, Some(ReduceOp::ALL.into_iter().find(|x| x.name() == o)?))
            }
            "divide" | "scale" => (rest, None),
            _ => return None,
        };
        let dtype = DataType::ALL.into_iter().find(|&t| type_tag(t) == tag)?;
        Some(Unit { dtype, op, ll: family == "ll" })
    }

    /// The entry points compiled for this unit.
    pub fn names(self) -> Vec<String> {
        match self.op {
            Some(op) if self.ll => vec![ll_name(self.dtype, op)],
            Some(op) => vec![reduce_name(self.dtype, op), fold_name(self.dtype, op)],
            None => vec![divide_name(self.dtype), scale_name(self.dtype)],
        }
    }

    /// The `-D` options that select this unit in `cuda/reduce.cu`.
    pub fn defines(self) -> Vec<String> {
        let t = format!("-DOX_SEL_TYPE={}", type_tag(self.dtype));
        match self.op {
            Some(op) if self.ll => vec![t, format!("-DOX_SEL_OP={}", op.name()), "-DOX_SEL_LL=1".to_string()],
            Some(op) => vec![t, format!("-DOX_SEL_OP={}", op.name())],
            None => vec![t, "-DOX_SEL_MAP=1".to_string()],
        }
    }

    /// Every unit: per type, five reduce-copy/fold units, one divide/scale unit, five LL units.
    pub fn all() -> Vec<Unit> {
        let mut v = Vec::new();
        for dtype in DataType::ALL {
            v.extend(ReduceOp::ALL.map(|op| Unit { dtype, op: Some(op), ll: false }));
            v.push(Unit { dtype, op: None, ll: false });
            v.extend(ReduceOp::ALL.map(|op| Unit { dtype, op: Some(op), ll: true }));
        }
        v
    }
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.op {
            Some(op) if self.ll => write!(f, "{} {} LL", type_tag(self.dtype), op.name()),
            Some(op) => write!(f, "{} {}", type_tag(self.dtype), op.name()),
            None => write!(f, "{} divide/scale", type_tag(self.dtype)),
        }
    }
}

/// The unit compiled when a GPU's kernels are first set up, to prove that NVRTC and the driver
/// work before a communicator chooses the IPC path: the smallest one.
const PROBE: Unit = Unit { dtype: DataType::Uint8, op: None, ll: false };

/// NVRTC options besides `--gpu-architecture` (scripts/nvrtc-check.sh compiles with exactly
/// these, read from the lines between the markers below).
// nvrtc-options-begin
pub const NVRTC_OPTIONS: [&str; 4] = ["--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true"];
// nvrtc-options-end

/// Library names cudarc tries for NVRTC (CUDA 13 first).
const NVRTC_HINT: &str = "libnvrtc.so.13 (or libnvrtc.so.12)";

/// The error of a device call when NVRTC cannot be loaded.
pub fn nvrtc_missing_error() -> Error {
    Error::new(
        ErrorKind::UnhandledCuda,
        format!(
            "NVRTC not found: device collectives compile their kernels at run time and need the NVRTC library {NVRTC_HINT}; \
             install the CUDA runtime compiler (apt: cuda-nvrtc-13-0, pip: nvidia-cuda-nvrtc) and put its lib directory on LD_LIBRARY_PATH"
        ),
    )
}

/// True when the NVRTC library can be loaded.
pub fn nvrtc_available() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries dlopen() on the candidate names; no NVRTC call is made.
    *P.get_or_init(|| std::panic::catch_unwind(|| unsafe { nv::is_culib_present() }).unwrap_or(false))
}

fn nvrtc_check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::UnhandledCuda, format!("{what} failed: {r:?}")))
    }
}

/// A compiled image: a cubin, or NUL-terminated PTX.
struct Image {
    bytes: Vec<u8>,
    what: String,
    cubin: bool,
    /// Read from the on-disk cache ([`super::kcache`]), not compiled here.
    cached: bool,
    /// NVRTC's target (`sm_90`, `compute_90`).
    target: String,
    /// The entry points it holds.
    unit: Unit,
}

/// Compiles `unit` once per compute capability and kind (cached for the process): a cubin for
/// `sm_XY` unless `ptx`, falling back to PTX when NVRTC cannot build the cubin.
fn image(cc: (i32, i32), ptx: bool, unit: Unit) -> Result<Arc<Image>> {
    type Cache = Mutex<HashMap<(i32, i32, bool, Unit), Arc<Image>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = crate::sync::lock(CACHE.get_or_init(Default::default));
    if let Some(i) = cache.get(&(cc.0, cc.1, ptx, unit)) {
        return Ok(i.clone());
    }
    if !nvrtc_available() {
        return Err(nvrtc_missing_error());
    }
    let arch = cc.0 * 10 + cc.1;
    let t = std::time::Instant::now();
    let as_ptx = || -> Result<Image> {
        let archs = supported_archs()?;
        let a = if archs.contains(&arch) { Some(arch) } else { archs.into_iter().filter(|&a| a <= arch).max() };
        let a = a.ok_or_else(|| {
            Error::new(ErrorKind::UnhandledCuda, format!("NVRTC supports no architecture up to sm_{arch}"))
        })?;
        compile_cached(&format!("compute_{a}"), false, unit)
    };
    let img = if ptx {
        as_ptx()?
    } else {
        match compile_cached(&format!("sm_{arch}"), true, unit) {
            Ok(i) => i,
            Err(e) => {
                crate::info!("NVRTC cannot build sm_{arch} ({}); using PTX", e.message());
                as_ptx().map_err(|_| e)?
            }
        }
    };
    if !img.cached {
        crate::info!(
            "NVRTC compiled cuda/reduce.cu ({unit}) to {} ({} bytes) in {:.3} s",
            img.what,
            img.bytes.len(),
            t.elapsed().as_secs_f64()
        );
    }
    let img = Arc::new(img);
    cache.insert((cc.0, cc.1, ptx, unit), img.clone());
    Ok(img)
}

/// Loads `img` as a module of the current context.
fn load_module(img: &Image) -> Result<sys::CUmodule> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the image is a complete cubin or NUL-terminated PTX produced by NVRTC, alive for
    // the call; a context is current (the caller entered the GPU). Under RELAXED capture mode:
    // a captured call may be the first to need this unit, and loading a module (which may
    // allocate) is no part of the graph; the module stays loaded for the process.
    let r = super::capture::relaxed(|| unsafe { sys::cuModuleLoadData(&mut module, img.bytes.as_ptr().cast()) });
    check(r, &format!("cuModuleLoadData({})", img.what))?;
    Ok(module)
}

/// Loads `img`; an image from the on-disk cache that the driver refuses is compiled again (and
/// its cache entry replaced) before giving up.
fn load_checked(img: &Image) -> Result<sys::CUmodule> {
    match load_module(img) {
        Err(e) if img.cached => {
            crate::warn!(
                "kernel cache: the driver refused the cached {} ({}); compiling it again",
                img.what,
                e.message()
            );
            let fresh = compile(&img.target, img.cubin, img.unit)?;
            if let Some(dir) = crate::config::process().kernel_cache.as_deref() {
                let key = cache_key(&img.target, img.unit)?;
                super::kcache::store(dir, &key, &fresh.bytes);
            }
            load_module(&fresh)
        }
        r => r,
    }
}

fn supported_archs() -> Result<Vec<i32>> {
    let mut n = 0;
    // SAFETY: writes one int.
    nvrtc_check(unsafe { nv::nvrtcGetNumSupportedArchs(&mut n) }, "nvrtcGetNumSupportedArchs")?;
    let mut v = vec![0; n.max(0) as usize];
    // SAFETY: `v` holds exactly the number of entries NVRTC reported.
    nvrtc_check(unsafe { nv::nvrtcGetSupportedArchs(v.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
    Ok(v)
}

/// The options of one compile of `unit` (besides the architecture).
fn options(unit: Unit) -> Vec<String> {
    NVRTC_OPTIONS.iter().map(|o| o.to_string()).chain(unit.defines()).collect()
}

/// The on-disk cache key of `unit` for `target`.
fn cache_key(target: &str, unit: Unit) -> Result<String> {
    let opts = options(unit);
    let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
    Ok(super::kcache::key(nvrtc_version()?, target, &opts, SOURCE))
}

/// [`compile`] through the on-disk cache of `OXCCL_KERNEL_CACHE` ([`super::kcache`]): an image
/// an earlier process built with the same NVRTC, target, options and source is loaded instead.
/// A miss takes the entry's compile lock first, so that of several processes of this host
/// missing at once one compiles and the others load its image.
fn compile_cached(target: &str, cubin: bool, unit: Unit) -> Result<Image> {
    let dir = crate::config::process().kernel_cache.clone().filter(|d| super::kcache::usable(d));
    let Some(dir) = dir else { return compile(target, cubin, unit) };
    let key = cache_key(target, unit)?;
    let cached = |bytes: Vec<u8>| {
        let what = if cubin { format!("cubin {target}") } else { format!("PTX {target}") };
        crate::info!(
            "kernel cache: {what} ({unit}, {} bytes) loaded from {}, nothing compiled",
            bytes.len(),
            super::kcache::entry(&dir, &key).display()
        );
        Image { bytes, what, cubin, cached: true, target: target.to_string(), unit }
    };
    if let Some(bytes) = super::kcache::load(&dir, &key) {
        return Ok(cached(bytes));
    }
    let _lock = super::kcache::lock(&dir, &key);
    if let Some(bytes) = _lock.as_ref().and_then(|_| super::kcache::load(&dir, &key)) {
        return Ok(cached(bytes));
    }
    let img = compile(target, cubin, unit)?;
    super::kcache::store(&dir, &key, &img.bytes);
    Ok(img)
}

/// The CUDA version the driver supports (major, minor).
fn driver_version() -> Result<(i32, i32)> {
    let mut v = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
    Ok((v / 1000, v % 1000 / 10))
}

/// NVRTC's version (major, minor).
fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    nvrtc_check(unsafe { nv::nvrtcVersion(&mut major, &mut minor) }, "nvrtcVersion")?;
    Ok((major, minor))
}

/// Runs NVRTC on [`SOURCE`] for `arch` (`sm_90`: cubin; `compute_90`: PTX), `unit` only.
fn compile(arch: &str, cubin: bool, unit: Unit) -> Result<Image> {
    let src = CString::new(SOURCE).map_err(|_| Error::internal("cuda/reduce.cu contains a NUL byte"))?;
    let name = c"oxccl_reduce.cu";
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: `src` and `name` are NUL-terminated and outlive the program (destroyed below).
    nvrtc_check(
        unsafe {
            nv::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
        },
        "nvrtcCreateProgram",
    )?;
    let opts: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
        .chain(options(unit))
        .map(|o| CString::new(o).expect("no NUL in options"))
        .collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `prog` is live; the option strings outlive the call.
    let r = unsafe { nv::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let out = if r != nv::nvrtcResult::NVRTC_SUCCESS {
        Err(Error::new(
            ErrorKind::UnhandledCuda,
            format!("NVRTC could not compile cuda/reduce.cu ({unit}) for {arch} ({r:?}): {}", program_log(prog)),
        ))
    } else {
        fetch(prog, cubin).map(|bytes| Image {
            bytes,
            what: if cubin { format!("cubin {arch}") } else { format!("PTX {arch}") },
            cubin,
            cached: false,
            target: arch.to_string(),
            unit,
        })
    };
    // SAFETY: `prog` was created above and is destroyed once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    out
}

fn fetch(prog: nv::nvrtcProgram, cubin: bool) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; the buffer is sized as NVRTC reported.
    unsafe {
        if cubin {
            nvrtc_check(nv::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")?;
            let mut v = vec![0u8; size];
            nvrtc_check(nv::nvrtcGetCUBIN(prog, v.as_mut_ptr().cast()), "nvrtcGetCUBIN")?;
            Ok(v)
        } else {
            nvrtc_check(nv::nvrtcGetPTXSize(prog, &mut size), "nvrtcGetPTXSize")?;
            let mut v = vec![0u8; size];
            nvrtc_check(nv::nvrtcGetPTX(prog, v.as_mut_ptr().cast()), "nvrtcGetPTX")?;
            Ok(v)
        }
    }
}

fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is live; the buffer is sized as NVRTC reported and NUL-terminated by it.
    unsafe {
        if nv::nvrtcGetProgramLogSize(prog, &mut size) != nv::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return String::new();
        }
        let mut v = vec![0u8; size];
        if nv::nvrtcGetProgramLog(prog, v.as_mut_ptr().cast()) != nv::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        CStr::from_bytes_until_nul(&v).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
    }
}

/// Threads per block of every kernel launch (`ops.rs` launches them; the occupancy of
/// [`Kernels`] is measured for it).
pub const BLOCK: u32 = 512;

/// The kernels loaded into one context, one module per [`Unit`] loaded on first use, each entry
/// point with the number of its blocks of [`BLOCK`] threads one SM holds
/// at once (from the driver's occupancy calculator: ptxas reports 18-96 registers per thread
/// across types and architectures, so this is 1-3, not a fixed guess).
pub struct Kernels {
    cc: (i32, i32),
    loaded: Mutex<Loaded>,
}

#[derive(Default)]
struct Loaded {
    funcs: HashMap<String, (sys::CUfunction, u32)>,
    /// Kept loaded for the process (the functions point into them).
    _modules: Vec<sys::CUmodule>,
    /// The driver refused a cubin: every unit is loaded from PTX.
    ptx: bool,
}

// SAFETY: module and function handles are immutable and usable from any thread (the caller
// makes the owning context current before launching); the table is behind a mutex.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

impl Kernels {
    /// Sets up the kernels of a GPU of compute capability `cc`, compiling (or taking from the
    /// cache) and loading the smallest unit into the current context: proof that NVRTC and the
    /// driver work here. Other units are compiled when first looked up.
    pub(crate) fn load(cc: (i32, i32)) -> Result<Kernels> {
        let k = Kernels { cc, loaded: Mutex::new(Loaded::default()) };
        k.entry(&PROBE.names()[0])?;
        Ok(k)
    }

    /// Compiles (or takes from the cache) and loads `unit` into the current context.
    fn load_unit(&self, l: &mut Loaded, unit: Unit) -> Result<()> {
        let img = image(self.cc, l.ptx, unit)?;
        let module = match load_checked(&img) {
            Ok(m) => m,
            Err(e) if img.cubin => {
                // PTX helps only where the driver can compile this NVRTC's PTX: an NVRTC newer
                // than the driver writes PTX of a newer ISA too, which the driver refuses as well.
                let (nvrtc, driver) = (nvrtc_version()?, driver_version()?);
                if nvrtc > driver {
                    return Err(Error::new(
                        e.kind(),
                        format!(
                            "the driver (CUDA {}.{}) refused the {} built by NVRTC {}.{} ({}); PTX from an \
                             NVRTC newer than the driver is refused too: put an NVRTC no newer than \
                             CUDA {}.{} first on LD_LIBRARY_PATH (e.g. the nvidia-cuda-nvrtc wheel of that \
                             release), or update the driver",
                            driver.0,
                            driver.1,
                            img.what,
                            nvrtc.0,
                            nvrtc.1,
                            e.message(),
                            driver.0,
                            driver.1
                        ),
                    ));
                }
                crate::warn!(
                    "the driver rejected the {} ({}); loading PTX instead (compiled by the driver at \
                     every load)",
                    img.what,
                    e.message()
                );
                l.ptx = true;
                load_checked(&*image(self.cc, true, unit)?)
                    .map_err(|p| p.context(format!("after the driver rejected the {} ({})", img.what, e.message())))?
            }
            Err(e) => return Err(e),
        };
        l._modules.push(module);
        for name in unit.names() {
            let c = CString::new(name.clone()).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: `module` was just loaded; `c` is NUL-terminated.
            check(
                unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
                &format!("cuModuleGetFunction({name})"),
            )?;
            let mut per_sm = 0;
            // SAFETY: `f` was just looked up; writes one int.
            let r = unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, BLOCK as i32, 0) };
            check(r, &format!("cuOccupancyMaxActiveBlocksPerMultiprocessor({name})"))?;
            l.funcs.insert(name, (f, per_sm.max(1) as u32));
        }
        Ok(())
    }

    /// The entry point `name`.
    pub fn get(&self, name: &str) -> Result<sys::CUfunction> {
        self.entry(name).map(|e| e.0)
    }

    /// The entry point `name` and how many of its blocks one SM holds at once; its unit is
    /// compiled and loaded into the current context on first use (the context must be current,
    /// [`Gpu::enter`](super::Gpu::enter)).
    pub fn entry(&self, name: &str) -> Result<(sys::CUfunction, u32)> {
        let mut l = crate::sync::lock(&self.loaded);
        if let Some(e) = l.funcs.get(name) {
            return Ok(*e);
        }
        let unit = Unit::of(name).ok_or_else(|| Error::internal(format!("kernel {name} is not in cuda/reduce.cu")))?;
        self.load_unit(&mut l, unit)?;
        l.funcs.get(name).copied().ok_or_else(|| Error::internal(format!("kernel {name} is not in its unit {unit}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_cover_every_type_and_op() {
        let names = all_names();
        assert_eq!(names.len(), 12 * 17);
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert_eq!(reduce_name(DataType::Bfloat16, ReduceOp::Avg), "oxccl_reduce_bf16_avg");
        assert_eq!(scale_name(DataType::Float8e4m3), "oxccl_scale_e4m3");
        // Every name belongs to exactly the unit that lists it.
        let mut listed = 0;
        for u in Unit::all() {
            for n in u.names() {
                assert_eq!(Unit::of(&n), Some(u), "{n}");
                listed += 1;
            }
        }
        assert_eq!(listed, names.len());
        assert_eq!(ll_name(DataType::Float16, ReduceOp::Avg), "oxccl_ll_f16_avg");
        assert_eq!(Unit::of("oxccl_ll_f32_sum").map(|u| (u.ll, u.op)), Some((true, Some(ReduceOp::Sum))));
        assert_eq!(Unit::of("oxccl_reduce_f33_sum"), None);
        assert_eq!(Unit::of("oxccl_fold_f32_mean"), None);
        // Every type tag is instantiated by the source's OX_TYPE list.
        for t in DataType::ALL {
            assert!(SOURCE.contains(&format!("OX_TYPE({})", type_tag(t))), "{}", type_tag(t));
        }
    }

    #[test]
    fn nvrtc_missing_message_names_the_library() {
        let e = nvrtc_missing_error();
        assert_eq!(e.kind(), ErrorKind::UnhandledCuda);
        assert!(e.message().contains("libnvrtc.so") && e.message().contains("LD_LIBRARY_PATH"));
    }
}
