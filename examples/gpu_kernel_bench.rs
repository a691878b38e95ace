//! Times the reduce-copy kernel (`dst = a + b`; f32, bf16, e4m3, e5m2) against a device-to-device
//! copy of the same output bytes on GPU 0, with CUDA events. Bandwidth counts every byte read or
//! written: a copy moves 2 × size, a reduce-copy 3 × size. Each type runs with its three buffers
//! 0, 2 and 4 bytes past a 256-byte boundary (offsets that are whole elements; the kernel peels an
//! unaligned head, cuda/reduce.cu), and the 1- and 2-byte types also mutually misaligned
//! (`0/2/4`: dst, a and b at +0, +2 and +4 bytes, the element-wise path). The copy runs at the
//! same offsets. Run by the GPU check kit (docs/GPU.md):
//!
//! ```text
//! cargo run --release --example gpu_kernel_bench [MAX_BYTES]
//! ```
//!
//! Sizes run from 1 MiB (or MAX_BYTES when smaller) to MAX_BYTES (default 1 GiB) by factors of 4.

use cudarc::driver::{result, sys};
use oxccl::{device, DataType, ReduceOp};

fn main() {
    if !device::available() {
        eprintln!("gpu_kernel_bench: no CUDA device");
        std::process::exit(2);
    }
    let gpu = device::gpu(0).expect("GPU 0");
    let _ctx = gpu.enter().expect("context");
    let max = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => 1usize << 30,
        Some(Ok(n)) if n >= 16 => n,
        Some(_) => {
            eprintln!("gpu_kernel_bench: MAX_BYTES must be a number of bytes >= 16");
            std::process::exit(2);
        }
    };
    // SAFETY: three allocations of `max` + 256 bytes, freed at the end; all launches stay inside
    // them (at most `max` bytes from an offset below 256).
    unsafe {
        let alloc = max + 256;
        let (a, b, d) = (
            result::malloc_sync(alloc).unwrap(),
            result::malloc_sync(alloc).unwrap(),
            result::malloc_sync(alloc).unwrap(),
        );
        result::memset_d8_sync(a, 0, alloc).unwrap();
        result::memset_d8_sync(b, 0, alloc).unwrap();
        // The synchronous memsets are asynchronous to the host, ordered on the legacy stream
        // only: wait for them before timing on a non-blocking stream.
        result::ctx::synchronize().unwrap();
        let s = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        let (e0, e1) = (
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap(),
            result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap(),
        );
        let time = |f: &dyn Fn()| -> f64 {
            f(); // warm-up (and NVRTC compile on the first call)
            result::stream::synchronize(s).unwrap();
            let iters = 20;
            result::event::record(e0, s).unwrap();
            for _ in 0..iters {
                f();
            }
            result::event::record(e1, s).unwrap();
            result::event::synchronize(e1).unwrap();
            f64::from(result::event::elapsed(e0, e1).unwrap()) / 1e3 / iters as f64
        };
        println!(
            "# reduce-copy kernel vs device-to-device copy, GPU 0 (cc {}.{}, {} SMs)",
            gpu.cc.0, gpu.cc.1, gpu.sm_count
        );
        println!(
            "# {:>12} {:>8} {:>7} {:>12} {:>14} {:>8}",
            "bytes", "type", "offset", "d2d GB/s", "reduce GB/s", "ratio"
        );
        for dt in [DataType::Float32, DataType::Bfloat16, DataType::Float8e4m3, DataType::Float8e5m2] {
            // (dst, a, b) byte offsets.
            let mut offsets: Vec<[u64; 3]> =
                [0, 2, 4].into_iter().filter(|o| o % dt.size() as u64 == 0).map(|o| [o; 3]).collect();
            if dt.size() <= 2 {
                offsets.push([0, 2, 4]);
            }
            for off in offsets {
                let label = if off[0] == off[1] { format!("+{}", off[0]) } else { "0/2/4".to_string() };
                let mut size = max.min(1 << 20);
                while size <= max {
                    let n = (size / dt.size()) as u64;
                    let (pd, pa, pb) = (d + off[0], a + off[1], b + off[2]);
                    let copy = time(&|| device::ops::copy(pd, pa, size, s).unwrap());
                    let red = time(&|| device::ops::reduce(&gpu, pd, pa, pb, n, dt, ReduceOp::Sum, 1, s).unwrap());
                    let (cbw, rbw) = (2.0 * size as f64 / copy / 1e9, 3.0 * size as f64 / red / 1e9);
                    println!(
                        "  {:>12} {:>8} {:>7} {:>12.1} {:>14.1} {:>7.1}%",
                        size,
                        dt.name(),
                        label,
                        cbw,
                        rbw,
                        100.0 * rbw / cbw
                    );
                    size *= 4;
                }
            }
        }
        for p in [a, b, d] {
            result::free_sync(p).unwrap();
        }
    }
}
