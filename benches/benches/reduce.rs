//! The collectives' reduction kernels against a plain copy of the same bytes: a sum
//! reads two vectors and writes one, so at best it runs at about the speed of a copy
//! (which reads one and writes one). f32 and bf16 (widened to f32 in blocks), at sizes
//! in L1, L2 and memory.
//!
//!   cargo bench -p ucxkit-benches --bench reduce

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ucxkit_collectives::reduce::Kernels;
use ucxkit_collectives::{bf16, ReduceOp};

fn kernels(c: &mut Criterion) {
    for bytes in [16usize << 10, 1 << 20, 16 << 20] {
        let mut g = c.benchmark_group(format!("reduce_{}K", bytes >> 10));
        g.throughput(Throughput::Bytes(bytes as u64));
        let n = bytes / 4;
        let (mut acc, other) = (vec![1.0f32; n], vec![2.0f32; n]);
        g.bench_function(BenchmarkId::new("copy", "f32"), |b| b.iter(|| acc.copy_from_slice(&other)));
        g.bench_function(BenchmarkId::new("sum", "f32"), |b| {
            b.iter(|| f32::reduce(ReduceOp::Sum, &mut acc, &other))
        });
        let n = bytes / 2;
        let (mut acc, other) = (vec![bf16::ONE; n], vec![bf16::ONE; n]);
        g.bench_function(BenchmarkId::new("copy", "bf16"), |b| b.iter(|| acc.copy_from_slice(&other)));
        g.bench_function(BenchmarkId::new("sum", "bf16"), |b| {
            b.iter(|| bf16::reduce(ReduceOp::Sum, &mut acc, &other))
        });
        g.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
