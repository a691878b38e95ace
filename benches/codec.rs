//! Throughput of the wire encodings (`oxccl::reduce::codec`): encode and decode of `f32` data,
//! bytes of `f32` per second, one core. docs/PERFORMANCE.md records the figures.
//!
//! Time is the benchmark thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), not wall time: the
//! figure is the speed per core even on a machine shared with other work (which only steals
//! wall time). `CODEC_BENCH_WALL=1` measures wall time instead.
use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use oxccl::reduce::codec::Encoding;
use std::time::Duration;

/// CPU time of the calling thread.
struct ThreadCpu;

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Measurement for ThreadCpu {
    type Intermediate = Duration;
    type Value = Duration;
    fn start(&self) -> Duration {
        thread_cpu()
    }
    fn end(&self, i: Duration) -> Duration {
        thread_cpu() - i
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, v: &Duration) -> f64 {
        v.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        WallTime.formatter()
    }
}

fn codec<M: Measurement>(c: &mut Criterion<M>) {
    let n = 1 << 20;
    let x: Vec<u8> = (0..n).flat_map(|i| ((i as f32 * 0.37).sin() * 1e3).to_le_bytes()).collect();
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes(4 * n as u64));
    for enc in [Encoding::Bf16, Encoding::Fp8, Encoding::Int8] {
        let mut wire = vec![0u8; enc.size(n)];
        let mut out = vec![0u8; 4 * n];
        g.bench_with_input(BenchmarkId::new("encode", enc.name()), &enc, |b, e| b.iter(|| e.encode(&x, &mut wire)));
        enc.encode(&x, &mut wire);
        g.bench_with_input(BenchmarkId::new("decode", enc.name()), &enc, |b, e| b.iter(|| e.decode(&wire, &mut out)));
        g.bench_with_input(BenchmarkId::new("decode_add", enc.name()), &enc, |b, e| {
            b.iter(|| e.decode_add(&wire, &mut out))
        });
    }
    g.finish();
}

fn cpu_time() -> Criterion<ThreadCpu> {
    Criterion::default().with_measurement(ThreadCpu)
}

criterion_group! { name = on_cpu; config = cpu_time(); targets = codec }
criterion_group!(on_wall, codec);

fn main() {
    if std::env::var_os("CODEC_BENCH_WALL").is_some() {
        on_wall();
    } else {
        on_cpu();
    }
    Criterion::default().configure_from_args().final_summary();
}
