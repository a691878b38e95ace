//! Throughput of the wire encodings (`oxccl::reduce::codec`): encode and decode of `f32` data,
//! bytes of `f32` per second, one core. docs/PERFORMANCE.md records the figures.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use oxccl::reduce::codec::Encoding;

fn codec(c: &mut Criterion) {
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

criterion_group!(benches, codec);
criterion_main!(benches);
