//! Stream-ordered launches of the kernels in `cuda/reduce.cu` and copies, on raw device
//! addresses. Every function enqueues work on `stream` and returns without waiting; the
//! caller must have made the GPU's context current ([`Gpu::enter`](super::Gpu::enter)).

use super::{check, kernels, Gpu};
use crate::error::Result;
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::ffi::c_void;

/// Threads per block (defined with the kernels, whose occupancy is measured for it).
pub use super::kernels::BLOCK;
/// 16-byte packs each thread keeps in flight (`UNROLL` in `cuda/reduce.cu`).
const UNROLL: u64 = 4;

/// Grid size for `bytes` of work: enough blocks for one round of `UNROLL` packs per thread, at
/// most one full wave (`sm_count` × `per_sm` resident blocks, the kernel's occupancy; the
/// kernels are grid-stride loops), at least one.
pub fn grid_for(bytes: u64, sm_count: u32, per_sm: u32) -> u32 {
    let packs = bytes.div_ceil(16);
    let blocks = packs.div_ceil(u64::from(BLOCK) * UNROLL);
    blocks.clamp(1, u64::from(sm_count.max(1)) * u64::from(per_sm.max(1))) as u32
}

/// Launches kernel `name` of `gpu` with `args` (each a pointer to the argument's value) over
/// `n` elements of `dtype` ([`grid_for`] their bytes at the kernel's occupancy); nothing when
/// `n` is 0.
///
/// # Safety
/// `args` must match the kernel's parameter list; the device addresses in them must be valid
/// for the elements the kernel touches until the work completes.
unsafe fn launch(
    gpu: &Gpu,
    name: &str,
    n: u64,
    dtype: DataType,
    args: &mut [*mut c_void],
    stream: sys::CUstream,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (f, per_sm) = gpu.kernels()?.entry(name)?;
    let grid = grid_for(n * dtype.size() as u64, gpu.sm_count, per_sm);
    // SAFETY: forwarded from this function's contract.
    check(
        unsafe { sys::cuLaunchKernel(f, grid, 1, 1, BLOCK, 1, 1, 0, stream, args.as_mut_ptr(), std::ptr::null_mut()) },
        &format!("cuLaunchKernel({name})"),
    )
}

/// `dst[i] = a[i] op b[i]` for `n` elements; for `Avg`, the sum is divided by `div` when
/// `div > 1` (pass 1 for an intermediate step).
///
/// # Safety
/// `dst`, `a`, `b` must be device-accessible addresses of `n` elements of `dtype` on `gpu`,
/// valid until the work completes; `dst` may equal `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce(
    gpu: &Gpu,
    dst: u64,
    a: u64,
    b: u64,
    n: u64,
    dtype: DataType,
    op: ReduceOp,
    div: u32,
    stream: sys::CUstream,
) -> Result<()> {
    let (mut dst, mut a, mut b, mut n2, mut div) = (dst, a, b, n, div);
    let mut args: [*mut c_void; 5] = [
        (&mut dst as *mut u64).cast(),
        (&mut a as *mut u64).cast(),
        (&mut b as *mut u64).cast(),
        (&mut n2 as *mut u64).cast(),
        (&mut div as *mut u32).cast(),
    ];
    // SAFETY: the argument list matches `oxccl_reduce_*(T*, const T*, const T*, u64, u32)`;
    // the addresses are valid per this function's contract.
    unsafe { launch(gpu, &kernels::reduce_name(dtype, op), n, dtype, &mut args, stream) }
}

/// The fold of a window plan (`oxccl_fold_*`): every one of the `ndst` destinations listed in
/// the device table at `table` after its `nsrc` sources gets the sources' element-wise fold, in
/// table order; for `Avg` the sum is divided by `div` when `div > 1`.
///
/// With `guarded` the table is guarded (`cuda/reduce.cu`): its entries are the addresses of
/// board words holding each rank's published buffer, followed by the offset added to them and
/// the device address of a 32-bit fault word, which the kernel sets (writing nothing else) when
/// the boards named disagree.
///
/// # Safety
/// `table` must hold `nsrc + ndst` device addresses (guarded: of board words holding them,
/// then the offset and the fault word's address),
/// each of `n` elements of `dtype` on `gpu`, valid (table and boards included) until the work
/// completes; a destination may equal a source, and must otherwise not overlap any source or
/// another destination.
#[allow(clippy::too_many_arguments)]
pub unsafe fn fold(
    gpu: &Gpu,
    table: u64,
    n: u64,
    nsrc: u32,
    ndst: u32,
    dtype: DataType,
    op: ReduceOp,
    div: u32,
    guarded: bool,
    stream: sys::CUstream,
) -> Result<()> {
    let (mut table, mut n2, mut nsrc, mut ndst, mut div) = (table, n, nsrc, ndst, div);
    let mut guarded = u32::from(guarded);
    let mut args: [*mut c_void; 6] = [
        (&mut table as *mut u64).cast(),
        (&mut n2 as *mut u64).cast(),
        (&mut nsrc as *mut u32).cast(),
        (&mut ndst as *mut u32).cast(),
        (&mut div as *mut u32).cast(),
        (&mut guarded as *mut u32).cast(),
    ];
    // SAFETY: the argument list matches `oxccl_fold_*(const u64*, u64, u32, u32, u32, u32)`;
    // the addresses are valid per this function's contract.
    unsafe { launch(gpu, &kernels::fold_name(dtype, op), n, dtype, &mut args, stream) }
}

/// Host-to-device copy of `bytes` from page-locked memory, in stream order.
///
/// # Safety
/// `src` must be page-locked host memory of `bytes` bytes left unchanged until the copy has
/// run; `dst` device memory of `bytes` bytes.
pub unsafe fn upload(dst: u64, src: *const u8, bytes: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: per the contract.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream) }, "cuMemcpyHtoDAsync(fold table)")
}

/// `dst[i] = src[i] / div` (the end of an average; `div <= 1` copies).
///
/// # Safety
/// As [`reduce`], for `dst` and `src`.
pub unsafe fn divide(
    gpu: &Gpu,
    dst: u64,
    src: u64,
    n: u64,
    dtype: DataType,
    div: u32,
    stream: sys::CUstream,
) -> Result<()> {
    if div <= 1 && dst == src {
        return Ok(());
    }
    // SAFETY: `oxccl_divide_*(T*, const T*, u64, u32)`; addresses per the contract.
    unsafe { map(gpu, &kernels::divide_name(dtype), dst, src, n, dtype, div, stream) }
}

/// `dst[i] = src[i] * factor` (PreMulSum scaling).
///
/// # Safety
/// As [`reduce`], for `dst` and `src`.
pub unsafe fn scale(
    gpu: &Gpu,
    dst: u64,
    src: u64,
    n: u64,
    dtype: DataType,
    factor: f64,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: `oxccl_scale_*(T*, const T*, u64, double)`; addresses per the contract.
    unsafe { map(gpu, &kernels::scale_name(dtype), dst, src, n, dtype, factor, stream) }
}

/// Launches the unary kernel `name(T* dst, const T* src, u64 n, X x)`.
///
/// # Safety
/// `X` must be the kernel's last parameter type; addresses as in [`reduce`].
#[allow(clippy::too_many_arguments)]
unsafe fn map<X: Copy>(
    gpu: &Gpu,
    name: &str,
    dst: u64,
    src: u64,
    n: u64,
    dtype: DataType,
    x: X,
    stream: sys::CUstream,
) -> Result<()> {
    let (mut dst, mut src, mut n2, mut x) = (dst, src, n, x);
    let mut args: [*mut c_void; 4] = [
        (&mut dst as *mut u64).cast(),
        (&mut src as *mut u64).cast(),
        (&mut n2 as *mut u64).cast(),
        (&mut x as *mut X).cast(),
    ];
    // SAFETY: the argument list matches the kernel per this function's contract.
    unsafe { launch(gpu, name, n, dtype, &mut args, stream) }
}

/// Device-to-device copy of `bytes` (skipped when empty or onto itself).
///
/// # Safety
/// Both ranges must be valid device-accessible memory until the copy completes.
pub unsafe fn copy(dst: u64, src: u64, bytes: usize, stream: sys::CUstream) -> Result<()> {
    if bytes == 0 || dst == src {
        return Ok(());
    }
    // SAFETY: per the contract.
    check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) }, "cuMemcpyDtoDAsync")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_is_bounded_and_covers_the_work() {
        assert_eq!(grid_for(8, 132, 2), 1);
        assert_eq!(grid_for(0, 132, 2), 1);
        // One block handles BLOCK * UNROLL packs of 16 bytes per round.
        let per_block = u64::from(BLOCK) * UNROLL * 16;
        assert_eq!(grid_for(per_block, 132, 2), 1);
        assert_eq!(grid_for(per_block + 1, 132, 2), 2);
        // At most one wave of the kernel's occupancy.
        assert_eq!(grid_for(1 << 30, 132, 1), 132);
        assert_eq!(grid_for(1 << 30, 132, 3), 396);
        assert_eq!(grid_for(1 << 30, 0, 0), 1);
    }
}
