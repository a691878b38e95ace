//! Data-parallel SGD with oxccl: every rank holds a shard of the data and a full copy of the
//! model; after each local gradient step the ranks average their gradients with an all-reduce,
//! so every copy of the model takes the same step.
//!
//! ```text
//! cargo run --release --example data_parallel_sgd              # 4 ranks as threads of this process
//! cargo run --release --example data_parallel_sgd -- 8         # 8 ranks as threads
//! torchrun --nproc-per-node 4 target/release/examples/data_parallel_sgd   # one process per rank
//! ```
//!
//! The model is a linear regression `y = w . x + b` on synthetic data drawn around known
//! weights. Rank 0 initialises the model and broadcasts it; each epoch every rank computes the
//! mean-squared-error gradient on its own shard, `all_reduce_in_place(.., Avg)` turns the
//! per-rank gradients into the global one, and every rank applies it. At the end the ranks
//! check with an all-gather that their models are bit-identical, and rank 0 prints the loss
//! and how far the weights are from the true ones.

use oxccl::{Collectives, Communicator, ReduceOp};

/// Features per sample.
const DIM: usize = 16;
/// Samples per rank.
const SAMPLES: usize = 512;
/// Passes over the data.
const EPOCHS: usize = 200;
/// Learning rate.
const LR: f32 = 0.05;

/// The weights the data is drawn around (the last entry is the bias).
fn true_weights() -> Vec<f32> {
    (0..=DIM).map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0).collect()
}

/// A small deterministic generator (xorshift), so the example needs no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// This rank's shard: `SAMPLES` rows of `DIM` features, and their targets (with noise).
fn shard(rank: usize) -> (Vec<f32>, Vec<f32>) {
    let w = true_weights();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (rank as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let x: Vec<f32> = (0..SAMPLES * DIM).map(|_| rng.next()).collect();
    let y = x
        .chunks(DIM)
        .map(|row| row.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() + w[DIM] + 0.01 * rng.next())
        .collect();
    (x, y)
}

/// Mean-squared error of `model` on a shard, and its gradient.
fn loss_and_grad(model: &[f32], x: &[f32], y: &[f32]) -> (f32, Vec<f32>) {
    let mut grad = vec![0f32; DIM + 1];
    let mut loss = 0f32;
    for (row, &target) in x.chunks(DIM).zip(y) {
        let err = row.iter().zip(model).map(|(a, b)| a * b).sum::<f32>() + model[DIM] - target;
        loss += err * err;
        for (g, a) in grad.iter_mut().zip(row) {
            *g += 2.0 * err * a;
        }
        grad[DIM] += 2.0 * err;
    }
    let n = y.len() as f32;
    grad.iter_mut().for_each(|g| *g /= n);
    (loss / n, grad)
}

/// Trains on this rank's shard; returns (final global loss, model).
fn train(comm: &Communicator) -> oxccl::Result<(f32, Vec<f32>)> {
    let (x, y) = shard(comm.rank());
    // Rank 0's initial model wins: everyone starts from the same weights.
    let mut model: Vec<f32> = if comm.rank() == 0 { vec![0.1; DIM + 1] } else { vec![0.0; DIM + 1] };
    comm.broadcast_in_place(&mut model, 0)?;
    let mut loss = [0f32];
    for _ in 0..EPOCHS {
        let (l, mut grad) = loss_and_grad(&model, &x, &y);
        comm.all_reduce_in_place(&mut grad, ReduceOp::Avg)?;
        for (w, g) in model.iter_mut().zip(&grad) {
            *w -= LR * g;
        }
        loss[0] = l;
    }
    comm.all_reduce_in_place(&mut loss, ReduceOp::Avg)?;
    // Every copy of the model must be bit-identical.
    let mut all = vec![0f32; comm.size() * (DIM + 1)];
    comm.all_gather(&model, &mut all)?;
    if all.chunks(DIM + 1).any(|m| m.iter().zip(&model).any(|(a, b)| a.to_bits() != b.to_bits())) {
        return Err(oxccl::Error::internal("the ranks' models diverged"));
    }
    Ok((loss[0], model))
}

/// Runs the example on `n` ranks as threads; returns rank 0's result.
fn run_threads(n: usize) -> oxccl::Result<(f32, Vec<f32>)> {
    let comms = Communicator::in_memory(n);
    let results: Vec<oxccl::Result<(f32, Vec<f32>)>> = std::thread::scope(|s| {
        comms
            .iter()
            .map(|c| s.spawn(move || train(c)))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    results.into_iter().collect::<oxccl::Result<Vec<_>>>().map(|mut v| v.swap_remove(0))
}

/// Largest distance between a weight and its true value.
fn error(model: &[f32]) -> f32 {
    model.iter().zip(true_weights()).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn main() -> oxccl::Result<()> {
    let launched = oxccl::bootstrap::env::detect()?.is_some();
    let (rank, (loss, model)) = if launched {
        let comm = Communicator::from_env()?;
        (comm.rank(), train(&comm)?)
    } else {
        let n = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4);
        println!("{n} ranks as threads (start under torchrun/mpirun for one process per rank)");
        (0, run_threads(n)?)
    };
    if rank == 0 {
        println!("after {EPOCHS} epochs: loss {loss:.6}, largest weight error {:.4}", error(&model));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn converges_to_the_true_weights_on_every_rank_count() {
        for n in [1, 3, 4] {
            let (loss, model) = super::run_threads(n).expect("training runs");
            assert!(loss < 1e-3, "{n} ranks: loss {loss}");
            assert!(super::error(&model) < 0.02, "{n} ranks: weight error {}", super::error(&model));
        }
    }
}
