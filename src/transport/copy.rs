//! The byte copy of the shared-memory paths (rings, forwards): a 256-bit load/store loop on
//! x86-64 CPUs with AVX for copies from [`VECTOR_MIN`] bytes while the calling thread's
//! operation is small enough to live in the caches ([`set_vector`]), `copy_from_slice`
//! (glibc's `memcpy`) otherwise.
//!
//! glibc copies blocks of these sizes with `rep movsb` on CPUs that advertise fast string
//! moves. On the 2-vCPU Intel VM of docs/PERFORMANCE.md (\[P\] round 6) that ran 5-10 % slower
//! than the vector loop in a 2-process all-reduce through shared slots, and oxccl's 2-rank
//! all-reduce gained ~10 % in place at 256 KiB-4 MiB with the loop; from 16 MiB on, where the
//! buffers stream from memory, `rep movsb` was as fast or faster (in place at 64 MiB: 3.5
//! against 3.0 GB/s), so large operations keep it.

/// Shortest copy that takes the vector loop.
pub const VECTOR_MIN: usize = 2048;

/// Largest operation (bytes of the caller's receive buffers) whose copies take the vector loop.
pub const VECTOR_OP_MAX: usize = 8 << 20;

thread_local! {
    /// Whether this thread's copies may take the vector loop (the engine sets it per operation).
    static VECTOR: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// Lets this thread's copies take the vector loop (`on`) or not, until set again; returns the
/// previous setting.
pub fn set_vector(on: bool) -> bool {
    VECTOR.with(|v| v.replace(on))
}

/// Copies `src` into `dst` (the shorter length of the two).
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if n >= VECTOR_MIN && VECTOR.with(|v| v.get()) && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked just above).
        unsafe { x86::copy(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};

    /// Copies `src` into `dst` (equal lengths) with unaligned 256-bit loads and stores, four
    /// at a time.
    ///
    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn copy(dst: &mut [u8], src: &[u8]) {
        debug_assert_eq!(dst.len(), src.len());
        let n = dst.len().min(src.len());
        let whole = n - n % 128;
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut i = 0;
        while i < whole {
            // SAFETY: bytes i..i + 128 lie inside both slices (i + 128 <= whole <= n); unaligned
            // loads and stores accept any address; the slices do not overlap (a `&mut` and a
            // `&` borrow).
            unsafe {
                let a = _mm256_loadu_si256(s.add(i) as *const __m256i);
                let b = _mm256_loadu_si256(s.add(i + 32) as *const __m256i);
                let c = _mm256_loadu_si256(s.add(i + 64) as *const __m256i);
                let e = _mm256_loadu_si256(s.add(i + 96) as *const __m256i);
                _mm256_storeu_si256(d.add(i) as *mut __m256i, a);
                _mm256_storeu_si256(d.add(i + 32) as *mut __m256i, b);
                _mm256_storeu_si256(d.add(i + 64) as *mut __m256i, c);
                _mm256_storeu_si256(d.add(i + 96) as *mut __m256i, e);
            }
            i += 128;
        }
        dst[whole..n].copy_from_slice(&src[whole..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_length_and_offset() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 127, 128, 129, VECTOR_MIN - 1, VECTOR_MIN, VECTOR_MIN + 77, 4096, 19_000] {
            for off in [0, 1, 31, 33] {
                let mut dst = vec![0xAAu8; len + 2 * off + 2];
                copy(&mut dst[off + 1..off + 1 + len], &src[off..off + len]);
                assert_eq!(&dst[off + 1..off + 1 + len], &src[off..off + len], "len {len} off {off}");
                assert!(dst[..off + 1].iter().chain(&dst[off + 1 + len..]).all(|&b| b == 0xAA), "len {len}: outside");
            }
        }
        // With the vector loop off, the same.
        let was = set_vector(false);
        let mut dst = vec![0u8; 5000];
        copy(&mut dst, &src[7..5007]);
        assert_eq!(&dst[..], &src[7..5007]);
        assert!(!set_vector(was));
        // Unequal lengths copy the shorter.
        let mut dst = [0u8; 3000];
        copy(&mut dst, &src[..2500]);
        assert_eq!(&dst[..2500], &src[..2500]);
        assert!(dst[2500..].iter().all(|&b| b == 0));
    }
}
