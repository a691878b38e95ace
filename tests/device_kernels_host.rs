//! The device kernels of `cuda/reduce.cu`, compiled as host C++ (with `cuda/host_shim.h`) and
//! run thread by thread on the CPU, checked element by element against the library's host
//! reductions (`oxccl::reduce`), for every type (e4m3 and e5m2 included), operator, divide and
//! scale, in and out of place, with every buffer at a byte offset of 0, 2, 4 or 8 from a
//! 16-byte boundary (where that is a whole number of elements): all at one offset (an unaligned
//! head, the 16-byte body, a tail) and at mutually misaligned offsets (the element-wise path); the fold through
//! guarded tables of board words (the direct all-reduce of ranks sharing a process): the same
//! result at an offset, and when the boards disagree, the fault word set and nothing written.
//!
//! This runs on every machine (no GPU): it verifies the arithmetic and the loop structure of
//! the exact source NVRTC compiles on a GPU machine. The f16 conversion on the GPU uses the
//! hardware `cvt` instructions instead of the software path checked here (same rounding).

use oxccl::device::kernels::{all_names, divide_name, fold_name, reduce_name, scale_name};
use oxccl::reduce;
use oxccl::{DataType, ReduceOp};
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

type ReduceFn = unsafe extern "C" fn(*mut c_void, *const c_void, *const c_void, u64, u32);
type FoldFn = unsafe extern "C" fn(*const u64, u64, u32, u32, u32, u32);
type DivideFn = unsafe extern "C" fn(*mut c_void, *const c_void, u64, u32);
type ScaleFn = unsafe extern "C" fn(*mut c_void, *const c_void, u64, f64);
type SetThreadFn = unsafe extern "C" fn(u32, u32, u32, u32);

/// Simulated launch shape: odd sizes so that grid-stride and unroll boundaries are exercised.
const GRID: u32 = 3;
const BLOCK: u32 = 7;

/// Compiles the kernels into a shared library once and dlopens it.
fn library() -> usize {
    static LIB: OnceLock<usize> = OnceLock::new();
    *LIB.get_or_init(|| {
        let root = env!("CARGO_MANIFEST_DIR");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("liboxccl_kernels_host.so");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let st = Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas", "-shared", "-fPIC"])
            .arg("-include")
            .arg(format!("{root}/cuda/host_shim.h"))
            .args(["-x", "c++"])
            .arg(format!("{root}/cuda/reduce.cu"))
            .arg("-o")
            .arg(&out)
            .status()
            .expect("run the C++ compiler (install g++)");
        assert!(st.success(), "compiling cuda/reduce.cu as host C++ failed");
        let path = CString::new(out.to_str().expect("utf-8 path")).unwrap();
        // SAFETY: loads the library just built; it has no constructors besides the C++ runtime's.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!h.is_null(), "dlopen {}", out.display());
        h as usize
    })
}

/// Address of symbol `name` in the host-compiled kernels.
fn sym(name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: the handle is a live dlopen handle; `c` is NUL-terminated.
    let p = unsafe { libc::dlsym(library() as *mut c_void, c.as_ptr()) };
    assert!(!p.is_null(), "kernel {name} missing from cuda/reduce.cu");
    p
}

/// Runs `body` once per simulated thread of a GRID x BLOCK launch.
fn launch(mut body: impl FnMut()) {
    // SAFETY: the symbol has this signature (cuda/host_shim.h).
    let set: SetThreadFn = unsafe { std::mem::transmute::<*mut c_void, SetThreadFn>(sym("oxccl_host_set_thread")) };
    for b in 0..GRID {
        for t in 0..BLOCK {
            // SAFETY: sets the simulated thread indices.
            unsafe { set(b, t, BLOCK, GRID) };
            body();
        }
    }
}

/// 16-byte aligned storage with `elems` elements of `dt` starting `shift` elements in.
struct Buf {
    words: Vec<u128>,
    shift: usize,
    len: usize,
}

impl Buf {
    fn new(dt: DataType, elems: usize, shift: usize) -> Buf {
        Buf::at(dt, elems, shift * dt.size())
    }
    /// `elems` elements starting `off` bytes past a 16-byte boundary.
    fn at(dt: DataType, elems: usize, off: usize) -> Buf {
        let len = elems * dt.size();
        Buf { words: vec![0; (len + off).div_ceil(16) + 1], shift: off, len }
    }
    fn bytes(&mut self) -> &mut [u8] {
        let all: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words);
        &mut all[self.shift..self.shift + self.len]
    }
    fn ptr(&mut self) -> *mut c_void {
        self.bytes().as_mut_ptr().cast()
    }
}

/// Deterministic pseudo-random test data: half ordinary small values, half raw random bits
/// (NaNs, infinities, subnormals and huge values for the float types).
fn fill(dt: DataType, out: &mut [u8], seed: u64) {
    let n = out.len() / dt.size();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..n {
        let r = next();
        let e = &mut out[i * dt.size()..(i + 1) * dt.size()];
        if i % 2 == 0 {
            e.copy_from_slice(&r.to_le_bytes()[..dt.size()]);
        } else {
            let v = (r % 41) as f64 - 20.0 + if dt.is_float() { (r >> 40) as f64 / (1u64 << 24) as f64 } else { 0.0 };
            reduce::from_f64(dt, &[v], e);
        }
    }
}

/// Element-wise equality; for float types two NaNs are equal whatever their payload.
fn assert_same(dt: DataType, got: &[u8], want: &[u8], what: &str) {
    assert_same_zeros(dt, got, want, what, false)
}

/// [`assert_same`] for the result of `op`: float max/min may give +0 or -0 when the operands
/// are zeros of both signs (C `fmax`/`fmin`, as src/reduce's own tests allow).
fn assert_same_op(dt: DataType, op: ReduceOp, got: &[u8], want: &[u8], what: &str) {
    assert_same_zeros(dt, got, want, what, dt.is_float() && matches!(op, ReduceOp::Max | ReduceOp::Min))
}

fn assert_same_zeros(dt: DataType, got: &[u8], want: &[u8], what: &str, either_zero: bool) {
    if got == want {
        return;
    }
    let (g, w) = (reduce::to_f64(dt, got), reduce::to_f64(dt, want));
    for i in 0..g.len() {
        let s = dt.size();
        let same_bits = got[i * s..(i + 1) * s] == want[i * s..(i + 1) * s];
        assert!(
            same_bits || (g[i].is_nan() && w[i].is_nan()) || (either_zero && g[i] == 0.0 && w[i] == 0.0),
            "{what}: element {i} of {}: got {} want {}",
            dt.name(),
            g[i],
            w[i]
        );
    }
}

/// Sizes: tiny, not a multiple of any pack, and several vector rounds.
const SIZES: [usize; 3] = [1, 37, 1000];

/// Byte offsets from a 16-byte boundary for `k` buffers of `dt`: every buffer at one offset
/// (0, 2, 4, 8; the packed body after a head), and two mutually misaligned assignments (the
/// element-wise path). Only whole numbers of elements.
fn offsets(dt: DataType, k: usize) -> Vec<Vec<usize>> {
    let base: Vec<usize> = [0, 2, 4, 8].into_iter().filter(|o| o % dt.size() == 0).collect();
    let mut v: Vec<Vec<usize>> = base.iter().map(|&o| vec![o; k]).collect();
    for r in 0..2 {
        v.push((0..k).map(|i| base[(i + r + 1) % base.len()]).collect());
    }
    v
}

#[test]
fn every_kernel_name_the_library_uses_is_defined() {
    let names = all_names();
    assert_eq!(names.len(), DataType::ALL.len() * (3 * ReduceOp::ALL.len() + 2));
    for n in &names {
        sym(n);
    }
}

/// The entry-point names in `cuda/reduce.cu` preprocessed with `defines` (None: it failed).
fn selected(defines: &[String]) -> Option<std::collections::BTreeSet<String>> {
    let root = env!("CARGO_MANIFEST_DIR");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args(["-E", "-P", "-x", "c++"])
        .args(defines)
        .arg(format!("{root}/cuda/reduce.cu"))
        .stderr(std::process::Stdio::null())
        .output()
        .expect("run the C++ preprocessor (install g++)");
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names = std::collections::BTreeSet::new();
    for (i, _) in text.match_indices("oxccl_") {
        let word: String = text[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if ["oxccl_reduce_", "oxccl_fold_", "oxccl_divide_", "oxccl_scale_", "oxccl_ll_"]
            .iter()
            .any(|p| word.starts_with(p))
        {
            names.insert(word);
        }
    }
    Some(names)
}

/// The library compiles one unit at a time (src/device/kernels.rs `Unit`): each unit's `-D`
/// options select exactly its entry points, under their usual names; no selection gives all.
#[test]
fn each_unit_selection_holds_exactly_its_entry_points() {
    use oxccl::device::kernels::Unit;
    let all: std::collections::BTreeSet<String> = all_names().into_iter().collect();
    assert_eq!(selected(&[]).as_ref(), Some(&all), "without a selection, every entry point");
    let mut union = std::collections::BTreeSet::new();
    for u in Unit::all() {
        let got = selected(&u.defines()).unwrap_or_else(|| panic!("the selection of {u} does not preprocess"));
        let want: std::collections::BTreeSet<String> = u.names().into_iter().collect();
        assert_eq!(got, want, "unit {u}");
        union.extend(got);
    }
    assert_eq!(union, all, "the units cover every entry point");
    assert_eq!(selected(&["-DOX_SEL_TYPE=f32".into()]), None, "a type alone is refused (#error)");
    assert_eq!(selected(&["-DOX_SEL_LL=1".into(), "-DOX_SEL_TYPE=f32".into()]), None, "LL needs an operator");
}

#[test]
fn reduce_copy_matches_host_reductions() {
    for dt in DataType::ALL {
        for op in ReduceOp::ALL {
            // SAFETY: the symbol has the reduce signature of cuda/reduce.cu.
            let k: ReduceFn = unsafe { std::mem::transmute::<*mut c_void, ReduceFn>(sym(&reduce_name(dt, op))) };
            for (si, &n) in SIZES.iter().enumerate() {
                for (oi, o) in offsets(dt, 3).into_iter().enumerate() {
                    let shift = format!("{o:?}");
                    for div in [1u32, 3] {
                        let seed = (dt as u64) << 20 | (op as u64) << 12 | (si as u64) << 4 | oi as u64;
                        let (mut a, mut b, mut d) = (Buf::at(dt, n, o[1]), Buf::at(dt, n, o[2]), Buf::at(dt, n, o[0]));
                        fill(dt, a.bytes(), seed);
                        fill(dt, b.bytes(), seed + 7);
                        let mut want = vec![0u8; n * dt.size()];
                        reduce::reduce_to(dt, op, &mut want, a.bytes(), b.bytes());
                        if op == ReduceOp::Avg {
                            reduce::divide(dt, &mut want, div as usize);
                        }
                        let (pd, pa, pb) = (d.ptr(), a.ptr(), b.ptr());
                        // SAFETY: each buffer holds `n` elements.
                        launch(|| unsafe { k(pd, pa, pb, n as u64, div) });
                        let what = format!("{} {} n={n} shift={shift} div={div}", reduce_name(dt, op), dt.name());
                        assert_same_op(dt, op, d.bytes(), &want, &what);
                        // In place: dst == a.
                        // SAFETY: as above, dst aliasing a is allowed by the kernel.
                        launch(|| unsafe { k(pa, pa, pb, n as u64, div) });
                        assert_same_op(dt, op, a.bytes(), &want, &format!("{what} in place"));
                    }
                }
            }
        }
    }
}

/// The fold of `srcs` by an independent route: the host's pairwise reductions for the types
/// computed in themselves (integers, f32, f64); for the narrow floats, widened to f32, folded
/// in f32 and rounded once (an average rounds the sum to the type before dividing in f32).
fn fold_reference(dt: DataType, op: ReduceOp, srcs: &[Vec<u8>], div: u32) -> Vec<u8> {
    let narrow = matches!(dt, DataType::Float16 | DataType::Bfloat16 | DataType::Float8e4m3 | DataType::Float8e5m2);
    if !narrow {
        let mut acc = srcs[0].clone();
        for s in &srcs[1..] {
            let a = acc.clone();
            reduce::reduce_to(dt, op, &mut acc, &a, s);
        }
        if op == ReduceOp::Avg {
            reduce::divide(dt, &mut acc, div as usize);
        }
        return acc;
    }
    let wide: Vec<Vec<f32>> =
        srcs.iter().map(|s| reduce::to_f64(dt, s).into_iter().map(|v| v as f32).collect()).collect();
    let round = |v: f32| {
        let mut b = vec![0u8; dt.size()];
        reduce::from_f64(dt, &[f64::from(v)], &mut b);
        b
    };
    let mut out = Vec::new();
    for i in 0..wide[0].len() {
        let mut acc = wide[0][i];
        for w in &wide[1..] {
            acc = match op {
                ReduceOp::Sum | ReduceOp::Avg => acc + w[i],
                ReduceOp::Prod => acc * w[i],
                // NaN-ignoring, and the second operand on a tie (`max(+0, -0)` is -0), the
                // rule the kernel source spells out for its host build.
                ReduceOp::Max if !acc.is_nan() && (w[i].is_nan() || acc > w[i]) => acc,
                ReduceOp::Min if !acc.is_nan() && (w[i].is_nan() || acc < w[i]) => acc,
                ReduceOp::Max | ReduceOp::Min => w[i],
            };
        }
        if op == ReduceOp::Avg && div > 1 {
            acc = reduce::to_f64(dt, &round(acc))[0] as f32 / div as f32;
        }
        out.extend(round(acc));
    }
    out
}

#[test]
fn fold_matches_a_wide_reference_for_every_type_op_and_table() {
    for dt in DataType::ALL {
        for op in ReduceOp::ALL {
            // SAFETY: the symbol has the fold signature of cuda/reduce.cu.
            let k: FoldFn = unsafe { std::mem::transmute::<*mut c_void, FoldFn>(sym(&fold_name(dt, op))) };
            for &n in &SIZES {
                for (nsrc, ndst) in [(2usize, 1usize), (3, 3), (5, 2)] {
                    for o in offsets(dt, nsrc + ndst) {
                        let shift = format!("{o:?}");
                        let div = if op == ReduceOp::Avg { nsrc as u32 } else { 1 };
                        let mut srcs: Vec<Buf> = (0..nsrc).map(|j| Buf::at(dt, n, o[j])).collect();
                        for (j, b) in srcs.iter_mut().enumerate() {
                            fill(dt, b.bytes(), (dt as u64) << 24 | (op as u64) << 16 | (n as u64) << 4 | j as u64);
                        }
                        let want = fold_reference(
                            dt,
                            op,
                            &srcs.iter_mut().map(|b| b.bytes().to_vec()).collect::<Vec<_>>(),
                            div,
                        );
                        let mut dsts: Vec<Buf> = (0..ndst).map(|j| Buf::at(dt, n, o[nsrc + j])).collect();
                        let what =
                            format!("{} n={n} shift={shift} sources={nsrc} destinations={ndst}", fold_name(dt, op));
                        let mut table: Vec<u64> = srcs.iter_mut().map(|b| b.ptr() as u64).collect();
                        table.extend(dsts.iter_mut().map(|b| b.ptr() as u64));
                        let t = table.as_ptr();
                        // SAFETY: every table entry holds `n` elements.
                        launch(|| unsafe { k(t, n as u64, nsrc as u32, ndst as u32, div, 0) });
                        for (j, d) in dsts.iter_mut().enumerate() {
                            assert_same_op(dt, op, d.bytes(), &want, &format!("{what}: destination {j}"));
                        }
                        // In place: the last source is also the first destination.
                        table[nsrc] = table[nsrc - 1];
                        let t = table.as_ptr();
                        // SAFETY: as above; a destination may be a source.
                        launch(|| unsafe { k(t, n as u64, nsrc as u32, ndst as u32, div, 0) });
                        assert_same_op(dt, op, srcs[nsrc - 1].bytes(), &want, &format!("{what} in place"));
                    }
                }
            }
        }
    }
}

/// Boards `[tag, count, send, recv]` (as `cuda/reduce.cu` describes them) for buffers whose
/// first `off` bytes are skipped: a guarded fold gives the plain fold's result at the offset,
/// in place and out of place; a board with another tag or count sets the fault word, and no
/// destination changes.
#[test]
fn guarded_fold_reads_its_addresses_from_the_boards_and_refuses_boards_that_disagree() {
    for (dt, op) in
        [(DataType::Float32, ReduceOp::Sum), (DataType::Bfloat16, ReduceOp::Avg), (DataType::Int64, ReduceOp::Max)]
    {
        // SAFETY: the symbol has the fold signature of cuda/reduce.cu.
        let k: FoldFn = unsafe { std::mem::transmute::<*mut c_void, FoldFn>(sym(&fold_name(dt, op))) };
        let (nranks, n, skip) = (3usize, 1000usize, 48usize);
        let off = (skip * dt.size()) as u64;
        let div = if op == ReduceOp::Avg { nranks as u32 } else { 1 };
        for in_place in [false, true] {
            let mut send: Vec<Buf> = (0..nranks).map(|_| Buf::new(dt, skip + n, 0)).collect();
            for (j, b) in send.iter_mut().enumerate() {
                fill(dt, b.bytes(), 77 + j as u64);
            }
            let srcs: Vec<Vec<u8>> = send.iter_mut().map(|b| b.bytes()[off as usize..].to_vec()).collect();
            let want = fold_reference(dt, op, &srcs, div);
            let mut recv: Vec<Buf> = (0..nranks).map(|_| Buf::new(dt, skip + n, 0)).collect();
            let mut boards: Vec<[u64; 4]> = (0..nranks)
                .map(|q| {
                    let s = send[q].ptr() as u64;
                    let r = if in_place { s } else { recv[q].ptr() as u64 };
                    [7 << 32 | (dt as u64) << 8 | op as u64, (skip + n) as u64, s, r]
                })
                .collect();
            let mut fault = 0u32;
            let fp = &mut fault as *mut u32;
            let table = |boards: &mut Vec<[u64; 4]>| -> Vec<u64> {
                let mut t: Vec<u64> = boards.iter_mut().map(|b| &mut b[2] as *mut u64 as u64).collect();
                t.extend(boards.iter_mut().map(|b| &mut b[3] as *mut u64 as u64));
                t.extend([off, fp as u64]);
                t
            };
            let what = format!("guarded {} in place {in_place}", fold_name(dt, op));
            // A board of an earlier call (another tag): refused, nothing written.
            boards[1][0] -= 1 << 32;
            let t = table(&mut boards);
            let before: Vec<Vec<u8>> = send.iter_mut().chain(recv.iter_mut()).map(|b| b.bytes().to_vec()).collect();
            // SAFETY: every board names a live buffer of skip + n elements.
            launch(|| unsafe { k(t.as_ptr(), n as u64, nranks as u32, nranks as u32, div, 1) });
            // SAFETY: the kernel wrote through `fp`; nothing else holds it now.
            assert_eq!(unsafe { fp.read_volatile() }, 1, "{what}: boards of different calls were not refused");
            let after: Vec<Vec<u8>> = send.iter_mut().chain(recv.iter_mut()).map(|b| b.bytes().to_vec()).collect();
            assert!(before == after, "{what}: a refused fold wrote");
            // Another count: refused too.
            boards[1][0] += 1 << 32;
            boards[2][1] += 1;
            // SAFETY: `fp` points at `fault`, which no kernel runs on now.
            unsafe { fp.write_volatile(0) };
            // SAFETY: as above.
            launch(|| unsafe { k(t.as_ptr(), n as u64, nranks as u32, nranks as u32, div, 1) });
            // SAFETY: as above.
            assert_eq!(unsafe { fp.read_volatile() }, 1, "{what}: boards of different counts were not refused");
            boards[2][1] -= 1;
            // Boards nobody published (zero, as the set-up leaves them): refused.
            let tags: Vec<u64> = boards.iter().map(|b| b[0]).collect();
            boards.iter_mut().for_each(|b| b[0] = 0);
            // SAFETY: as above.
            unsafe { fp.write_volatile(0) };
            // SAFETY: as above.
            launch(|| unsafe { k(t.as_ptr(), n as u64, nranks as u32, nranks as u32, div, 1) });
            // SAFETY: as above.
            assert_eq!(unsafe { fp.read_volatile() }, 1, "{what}: boards nobody published were not refused");
            boards.iter_mut().zip(&tags).for_each(|(b, &t)| b[0] = t);
            // SAFETY: as above.
            unsafe { fp.write_volatile(0) };
            // SAFETY: as above.
            launch(|| unsafe { k(t.as_ptr(), n as u64, nranks as u32, nranks as u32, div, 1) });
            // SAFETY: as above.
            assert_eq!(unsafe { fp.read_volatile() }, 0, "{what}: agreeing boards refused");
            for q in 0..nranks {
                let got = if in_place { send[q].bytes() } else { recv[q].bytes() };
                assert_same(dt, &got[off as usize..], &want, &format!("{what}: rank {q}"));
            }
        }
    }
}

#[test]
fn divide_and_scale_match_host() {
    for dt in DataType::ALL {
        // SAFETY: the symbols have the divide / scale signatures of cuda/reduce.cu.
        let dk: DivideFn = unsafe { std::mem::transmute::<*mut c_void, DivideFn>(sym(&divide_name(dt))) };
        // SAFETY: as above.
        let sk: ScaleFn = unsafe { std::mem::transmute::<*mut c_void, ScaleFn>(sym(&scale_name(dt))) };
        for &n in &SIZES {
            for (oi, o) in offsets(dt, 2).into_iter().enumerate() {
                let shift = format!("{o:?}");
                let (mut s, mut d) = (Buf::at(dt, n, o[1]), Buf::at(dt, n, o[0]));
                fill(dt, s.bytes(), n as u64 * 31 + oi as u64 + dt as u64);
                let (ps, pd) = (s.ptr(), d.ptr());
                for div in [1u32, 2, 7] {
                    let mut want = s.bytes().to_vec();
                    reduce::divide(dt, &mut want, div as usize);
                    // SAFETY: both buffers hold `n` elements.
                    launch(|| unsafe { dk(pd, ps, n as u64, div) });
                    assert_same(dt, d.bytes(), &want, &format!("{} n={n} shift={shift} div={div}", divide_name(dt)));
                }
                for factor in [0.25, -3.0, 3e9, -1e300, f64::NAN] {
                    let mut want = s.bytes().to_vec();
                    reduce::scale(dt, &mut want, factor);
                    // SAFETY: as above.
                    launch(|| unsafe { sk(pd, ps, n as u64, factor) });
                    assert_same(
                        dt,
                        d.bytes(),
                        &want,
                        &format!("{} n={n} shift={shift} factor={factor}", scale_name(dt)),
                    );
                }
            }
        }
    }
}
