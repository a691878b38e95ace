//! Throughput of the host reduction kernels (`oxccl::reduce::reduce_into`) on 4 MiB buffers,
//! beside a plain `copy_from_slice` of the same size as a memory-bandwidth yardstick.
//!
//! Throughput is reported per buffer byte (`len`), not per byte moved (a reduction reads two
//! buffers and writes one). Run with
//! `cargo bench --bench reduce -- --warm-up-time 1 --measurement-time 2`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use oxccl::reduce::{from_f64, reduce_into, reduce_to};
use oxccl::{DataType, ReduceOp};

const LEN: usize = 4 << 20;

/// A `LEN`-byte buffer (8-byte aligned, so the typed fast path applies) of small values.
fn buffer(dtype: DataType, seed: u64) -> Vec<u64> {
    let n = LEN / dtype.size();
    let vals: Vec<f64> = (0..n as u64).map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 17) as f64 - 8.0).collect();
    let mut buf = vec![0u64; LEN / 8];
    from_f64(dtype, &vals, bytemuck::cast_slice_mut(&mut buf));
    buf
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce_into_4MiB");
    g.throughput(Throughput::Bytes(LEN as u64));

    let src = vec![1u64; LEN / 8];
    let mut dst = vec![0u64; LEN / 8];
    g.bench_function("copy_from_slice", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));

    let cases = [
        ("f32_sum", DataType::Float32, ReduceOp::Sum),
        ("f64_sum", DataType::Float64, ReduceOp::Sum),
        ("i32_sum", DataType::Int32, ReduceOp::Sum),
        ("f16_sum", DataType::Float16, ReduceOp::Sum),
        ("bf16_sum", DataType::Bfloat16, ReduceOp::Sum),
        ("f8e4m3_sum", DataType::Float8e4m3, ReduceOp::Sum),
        ("f32_max", DataType::Float32, ReduceOp::Max),
    ];
    for (name, dtype, op) in cases {
        let src = buffer(dtype, 1);
        let mut acc = buffer(dtype, 2);
        g.bench_function(name, |b| {
            b.iter(|| {
                reduce_into(dtype, op, bytemuck::cast_slice_mut(&mut acc), black_box(bytemuck::cast_slice(&src)));
            })
        });
    }
    // The three-operand form the engine uses when it reduces straight out of a shared-memory
    // ring (dst = own input op incoming).
    let (a, b) = (buffer(DataType::Float32, 1), buffer(DataType::Float32, 2));
    let mut out = vec![0u64; LEN / 8];
    g.bench_function("f32_sum_to", |bench| {
        bench.iter(|| {
            reduce_to(DataType::Float32, ReduceOp::Sum, bytemuck::cast_slice_mut(&mut out), black_box(bytemuck::cast_slice(&a)), black_box(bytemuck::cast_slice(&b)));
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
