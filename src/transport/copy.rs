//! The byte copy of the shared-memory paths (rings, forwards): a 256-bit load/store loop on
//! x86-64 CPUs with AVX for copies from [`VECTOR_MIN`] bytes, `copy_from_slice` (glibc's
//! `memcpy`) otherwise.
//!
//! glibc copies blocks of these sizes with `rep movsb` on CPUs that advertise fast string
//! moves. On the 2-vCPU Intel VM of docs/PERFORMANCE.md that ran 5-10 % slower than the vector
//! loop in a 2-process all-reduce through shared slots at 256 KiB-4 MiB (\[P\] round 6). Round
//! 6 kept `memcpy` for operations over 8 MiB, where it was as fast or faster then; in round 9
//! the loop was faster there too (2-rank all-reduce 16-128 MiB: +5-10 %; copies in 32 KiB
//! pieces between a 128 MiB buffer and a cached one: 10.1-10.8 against 8.5-9.7 GB/s out of
//! memory, 7.7-8.3 against 5.2-6.4 into it), so every size takes it.

/// Shortest copy that takes the vector loop.
pub const VECTOR_MIN: usize = 2048;

/// Copies `src` into `dst` (the shorter length of the two).
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if n >= VECTOR_MIN && std::arch::is_x86_feature_detected!("avx") {
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
        // Unequal lengths copy the shorter.
        let mut dst = [0u8; 3000];
        copy(&mut dst, &src[..2500]);
        assert_eq!(&dst[..2500], &src[..2500]);
        assert!(dst[2500..].iter().all(|&b| b == 0));
    }
}
