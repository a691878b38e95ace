//! Host reduction kernels: elementwise `Sum`/`Prod`/`Max`/`Min`/`Avg` over raw element bytes
//! of every [`DataType`], with NVIDIA NCCL's device-side semantics.
//!
//! # Buffers
//!
//! Every function takes raw **little-endian** element bytes whose length should be a multiple
//! of [`DataType::size`]. Slices may have **any alignment**: when they are suitably aligned for
//! the element type (and the host is little-endian) the kernels run on typed slices obtained
//! with `bytemuck` casts, whose straight-line loops auto-vectorise; otherwise they stage blocks
//! through stack buffers, decoding with `from_le_bytes`. Both paths give identical results.
//! On x86-64 the kernels are also compiled for AVX2 + F16C and selected at run time; that
//! dispatch (and the F16C f16 conversion) is the only `unsafe` code, each call guarded by CPU
//! feature detection.
//!
//! Mismatched lengths are a caller bug, checked by `debug_assert!` only: in release builds the
//! functions never panic; they process the common prefix of whole elements and leave the rest
//! of the destination untouched.
//!
//! # Semantics
//!
//! * Integers (`i8`, `u8`, `i32`, `u32`, `i64`, `u64`): `Sum` and `Prod` wrap modulo 2^bits;
//!   `Max`/`Min` as usual.
//! * `f32`/`f64`: native IEEE arithmetic. `Max`/`Min` follow C `fmaxf`/`fminf` (Rust's
//!   `f32::max`): if one operand is NaN the other is returned (NaN only if both are); for
//!   `+0` vs `-0` either may be returned, as in C.
//! * f16, bf16 and the fp8 formats: each element is widened exactly to `f32`, the operation is
//!   done in `f32`, and the result is rounded once back (round to nearest, ties to even). For
//!   one binary operation of these narrow types this equals the correctly rounded result.
//!   f16/bf16 overflow to ±infinity; fp8 narrowing saturates as CUDA's `__NV_SATFINITE` (see
//!   [`fp8`]).
//! * `Avg` is `Sum` in [`reduce_into`]/[`reduce_to`]; the caller finishes it with [`divide`].

pub mod codec;
mod convert;
pub mod fp8;
mod kernels;
mod minifloat;
mod narrow;
#[cfg(test)]
mod tests;

use crate::types::{DataType, ReduceOp};
use kernels::{MaxOp, MinOp, ProdOp, SumOp};
use narrow::{Via32, BF16, E4M3, E5M2, F16};

/// Runs `$body` with `$K` bound to the `kernels::Codec` of `$dtype`.
macro_rules! with_codec {
    ($dtype:expr, $K:ident => $body:expr) => {
        match $dtype {
            DataType::Int8 => {
                type $K = i8;
                $body
            }
            DataType::Uint8 => {
                type $K = u8;
                $body
            }
            DataType::Int32 => {
                type $K = i32;
                $body
            }
            DataType::Uint32 => {
                type $K = u32;
                $body
            }
            DataType::Int64 => {
                type $K = i64;
                $body
            }
            DataType::Uint64 => {
                type $K = u64;
                $body
            }
            DataType::Float16 => {
                type $K = Via32<F16>;
                $body
            }
            DataType::Float32 => {
                type $K = f32;
                $body
            }
            DataType::Float64 => {
                type $K = f64;
                $body
            }
            DataType::Bfloat16 => {
                type $K = Via32<BF16>;
                $body
            }
            DataType::Float8e4m3 => {
                type $K = Via32<E4M3>;
                $body
            }
            DataType::Float8e5m2 => {
                type $K = Via32<E5M2>;
                $body
            }
        }
    };
}

/// Runs `$body` with `$O` bound to the operator type of `$op` (`Avg` → `Sum`).
macro_rules! with_op {
    ($op:expr, $O:ident => $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                type $O = SumOp;
                $body
            }
            ReduceOp::Prod => {
                type $O = ProdOp;
                $body
            }
            ReduceOp::Max => {
                type $O = MaxOp;
                $body
            }
            ReduceOp::Min => {
                type $O = MinOp;
                $body
            }
        }
    };
}

/// Length in bytes of the whole elements common to all of `lens`.
fn common_len(dtype: DataType, lens: &[usize]) -> usize {
    let size = dtype.size();
    let min = lens.iter().copied().min().unwrap_or(0);
    debug_assert!(lens.iter().all(|&l| l == min), "reduce: slice lengths differ: {lens:?}");
    debug_assert!(min % size == 0, "reduce: length {min} is not a multiple of {size}");
    min - min % size
}

/// `acc[i] = acc[i] op src[i]` for every element. `Avg` is treated as `Sum` here (the division
/// happens in [`divide`]).
///
/// Both slices are little-endian element bytes of any alignment (see the module docs); they
/// should have the same length, a multiple of `dtype.size()`; otherwise only the common whole
/// elements are reduced (debug builds assert).
pub fn reduce_into(dtype: DataType, op: ReduceOp, acc: &mut [u8], src: &[u8]) {
    let n = common_len(dtype, &[acc.len(), src.len()]);
    let (Some(acc), Some(src)) = (acc.get_mut(..n), src.get(..n)) else { return };
    with_codec!(dtype, K => with_op!(op, O => kernels::binary::<K, O>(acc, None, src)))
}

/// `dst[i] = a[i] op b[i]` for every element. `Avg` is treated as `Sum`.
///
/// Same buffer rules as [`reduce_into`].
pub fn reduce_to(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    let n = common_len(dtype, &[dst.len(), a.len(), b.len()]);
    let (Some(dst), Some(a), Some(b)) = (dst.get_mut(..n), a.get(..n), b.get(..n)) else { return };
    with_codec!(dtype, K => with_op!(op, O => kernels::binary::<K, O>(dst, Some(a), b)))
}

/// Finalises an average: `buf[i] = buf[i] / n`.
///
/// * Integers: truncating (toward zero) division of the already wrapped sum, as NCCL does for
///   integer `ncclAvg` (`-7 / 2 == -3`).
/// * `f32`, f16, bf16, fp8: computed in `f32` (`x / n as f32`) and rounded once to the type;
///   `f64`: computed in `f64`.
///
/// `n == 0` is a caller bug (debug builds assert) and leaves `buf` unchanged; `n == 1` is a
/// no-op. (NCCL itself implements float `ncclAvg` as a pre-multiplication of each input by
/// `1/n`; dividing the final sum once is at least as accurate but may differ in the last bit.)
pub fn divide(dtype: DataType, buf: &mut [u8], n: usize) {
    debug_assert!(n > 0, "reduce::divide by zero ranks");
    if n <= 1 {
        return;
    }
    let len = common_len(dtype, &[buf.len()]);
    let Some(buf) = buf.get_mut(..len) else { return };
    let small_int = matches!(dtype, DataType::Int8 | DataType::Uint8 | DataType::Int32 | DataType::Uint32);
    if small_int && n < kernels::F64_EXACT_DIVISOR {
        // The choice made once, outside the loop, so that the loop vectorizes.
        let d = n as f64;
        with_codec!(dtype, K => kernels::map::<K, _>(buf, |x| kernels::Arith::div_f64(x, d)))
    } else {
        with_codec!(dtype, K => kernels::map::<K, _>(buf, |x| kernels::Arith::div_count(x, n)))
    }
}

/// The fixed-order reduction of `parts` pieces: `src` holds them end to end, `dst.len()` bytes
/// each, in rank order; `dst[i] = ((p0[i] op p1[i]) op p2[i]) ... op p(parts-1)[i]`.
///
/// `f32`/`f64` fold in their own precision; f16, bf16 and fp8 widen every piece to `f32`, fold
/// there and round once; integers are exact. `Avg` divides the fold by `parts` before that one
/// rounding (as [`divide`] does for the other reductions). The result depends only on the
/// pieces and their order, never on how a call was cut up.
pub fn fold(dtype: DataType, op: ReduceOp, dst: &mut [u8], src: &[u8], parts: usize) {
    let len = common_len(dtype, &[dst.len()]);
    debug_assert!(src.len() >= parts * dst.len(), "reduce::fold: {} bytes for {parts} pieces", src.len());
    if parts == 0 || src.len() < parts * len {
        return;
    }
    let srcs: Vec<*const u8> = src.chunks(len.max(1)).take(parts).map(<[u8]>::as_ptr).collect();
    // SAFETY: `dst` is a unique view of `len` bytes; each source is a `len`-byte piece of `src`,
    // which cannot overlap `dst` (a shared and a unique borrow).
    unsafe { fold_ptrs(dtype, op, dst.as_mut_ptr(), &srcs, len) }
}

/// [`fold`] of the pieces at `srcs` (rank order, `len` bytes each) into `dst`.
///
/// # Safety
/// `dst` must be writable and every source readable for `len` bytes; a source is either `dst`
/// itself (its bytes are read before they are overwritten) or does not overlap it; nothing else
/// writes these bytes during the call.
pub unsafe fn fold_ptrs(dtype: DataType, op: ReduceOp, dst: *mut u8, srcs: &[*const u8], len: usize) {
    let len = len - len % dtype.size();
    let parts = srcs.len();
    if parts >= 2 && !widens(dtype) {
        // SAFETY: forwarded from this function's contract.
        unsafe { fold_pairwise(dtype, op, dst, srcs, len) };
        return;
    }
    let avg = op == ReduceOp::Avg && parts > 1;
    let small_int = matches!(dtype, DataType::Int8 | DataType::Uint8 | DataType::Int32 | DataType::Uint32);
    // SAFETY (every arm): forwarded from this function's contract.
    with_codec!(dtype, K => with_op!(op, O => unsafe {
        if !avg {
            kernels::fold::<K, O, _>(dst, srcs, len, |x| x)
        } else if small_int && parts < kernels::F64_EXACT_DIVISOR {
            let d = parts as f64;
            kernels::fold::<K, O, _>(dst, srcs, len, |x| kernels::Arith::div_f64(x, d))
        } else {
            kernels::fold::<K, O, _>(dst, srcs, len, |x| kernels::Arith::div_count(x, parts))
        }
    }))
}

/// Whether [`fold`] widens `dtype` to `f32` (f16, bf16, fp8) rather than folding in the type.
fn widens(dtype: DataType) -> bool {
    matches!(dtype, DataType::Float16 | DataType::Bfloat16 | DataType::Float8e4m3 | DataType::Float8e5m2)
}

/// Bytes [`fold_pairwise`] reduces at a time: a block of every source and of `dst` stays in
/// the core's first-level cache between the steps of the chain.
const FOLD_BLOCK: usize = 8 << 10;

/// [`fold_ptrs`] for a type folded in its own precision, with the pairwise kernels
/// ([`reduce_to`], [`reduce_into`], [`divide`]): per block, `dst = p0 op p1`, then `dst op= pk`
/// for k = 2.., then the average's division. The same operations in the same order as the
/// element-wise fold, so the same bits, without its decode and encode passes.
///
/// # Safety
/// As [`fold_ptrs`], with at least two sources.
unsafe fn fold_pairwise(dtype: DataType, op: ReduceOp, dst: *mut u8, srcs: &[*const u8], len: usize) {
    let step = FOLD_BLOCK - FOLD_BLOCK % dtype.size();
    // A source that is `dst` itself, past the first, is read from a copy of its block (the chain
    // overwrites `dst` before it reaches that source).
    let mut own = [0u8; FOLD_BLOCK];
    let mut off = 0;
    while off < len {
        let b = step.min(len - off);
        // SAFETY: every source is readable and `dst` writable for `len` bytes, `off + b <= len`;
        // a source is `dst` or disjoint from it (contract): `dst` as a source is read through the
        // copy `own`, or (as the first source) by `reduce_into` on `dst` itself.
        unsafe {
            let d = dst.add(off);
            if srcs[1..].contains(&dst.cast_const()) {
                std::ptr::copy_nonoverlapping(d, own.as_mut_ptr(), b);
            }
            let view = |k: usize| -> &[u8] {
                if k > 0 && srcs[k] == dst.cast_const() {
                    &own[..b]
                } else {
                    std::slice::from_raw_parts(srcs[k].add(off), b)
                }
            };
            let (s1, rest) = (view(1), 2..srcs.len());
            if srcs[0] == dst.cast_const() {
                reduce_into(dtype, op, std::slice::from_raw_parts_mut(d, b), s1);
            } else {
                let s0 = std::slice::from_raw_parts(srcs[0].add(off), b);
                reduce_to(dtype, op, std::slice::from_raw_parts_mut(d, b), s0, s1);
            }
            for k in rest {
                reduce_into(dtype, op, std::slice::from_raw_parts_mut(d, b), view(k));
            }
            if op == ReduceOp::Avg {
                divide(dtype, std::slice::from_raw_parts_mut(d, b), srcs.len());
            }
        }
        off += b;
    }
}

/// `buf[i] = buf[i] * factor` (for `PreMulSum`).
///
/// * Floats: `f32`, f16, bf16 and fp8 compute `x * (factor as f32)` in `f32` and round once to
///   the type; `f64` computes in `f64`.
/// * Signed integers: wrapping multiplication by `factor as i64` (Rust's saturating,
///   truncating-toward-zero cast; NaN → 0), truncated to the element width.
/// * Unsigned integers: wrapping multiplication by `factor as u64` (negative factors → 0).
pub fn scale(dtype: DataType, buf: &mut [u8], factor: f64) {
    let len = common_len(dtype, &[buf.len()]);
    let Some(buf) = buf.get_mut(..len) else { return };
    with_codec!(dtype, K => kernels::map::<K, _>(buf, |x| kernels::Arith::scale_by(x, factor)))
}

/// Decodes element bytes (little-endian, any alignment) to `f64`, for references and checks.
///
/// Exact for every type except 64-bit integers beyond 2^53, which round to nearest. fp8 NaN
/// codes decode to a NaN. A trailing partial element is ignored.
pub fn to_f64(dtype: DataType, bytes: &[u8]) -> Vec<f64> {
    with_codec!(dtype, K => kernels::decode_f64::<K>(bytes))
}

/// Encodes `f64` values into element bytes: `out[i*size..]` = `vals[i]` rounded once.
///
/// * Integers: Rust `as` cast (truncation toward zero, saturating at the type's range, NaN → 0).
/// * `f32`: `as f32` (nearest, ties to even); `f64`: unchanged.
/// * f16/bf16: correctly rounded straight from `f64` (nearest, ties to even; overflow → ±inf).
/// * fp8: correctly rounded, saturating to ±max finite (also for ±inf), as `__NV_SATFINITE`.
/// * NaN → the type's canonical quiet NaN (`0x7E00` f16, `0x7FC0` bf16, `0x7F` fp8).
///
/// Encodes `min(vals.len(), out.len() / size)` values; the rest of `out` is left untouched.
pub fn from_f64(dtype: DataType, vals: &[f64], out: &mut [u8]) {
    debug_assert!(out.len() == vals.len() * dtype.size(), "reduce::from_f64: output length mismatch");
    with_codec!(dtype, K => kernels::encode_f64::<K>(vals, out))
}
