//! The all-reduce correctness check shared by the multi-process tests: every rank's input is
//! generated deterministically, the result is compared element by element with a reference
//! computed here in f64 from all ranks' inputs.

use oxccl::{Communicator, DataType, ReduceOp};

/// Relative precision of each type (unit roundoff, doubled for safety on narrow types).
pub fn eps(t: DataType) -> f64 {
    match t {
        DataType::Float8e4m3 => 0.125,
        DataType::Float8e5m2 => 0.25,
        DataType::Float16 => 2f64.powi(-10),
        DataType::Bfloat16 => 2f64.powi(-7),
        DataType::Float32 => 2f64.powi(-23),
        DataType::Float64 => 2f64.powi(-52),
        _ => 0.0,
    }
}

pub fn unsigned(t: DataType) -> bool {
    matches!(t, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

/// Expected value and allowed error for element `i`.
pub fn reference(t: DataType, op: ReduceOp, n: usize, i: usize, seed: usize) -> (f64, f64) {
    let xs: Vec<f64> = (0..n).map(|r| super::input(r, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
    let abs_sum: f64 = xs.iter().map(|x| x.abs()).sum();
    match op {
        ReduceOp::Sum => (xs.iter().sum(), n as f64 * eps(t) * abs_sum),
        ReduceOp::Prod => (xs.iter().product(), 0.0),
        ReduceOp::Max => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
        ReduceOp::Min => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
        ReduceOp::Avg => {
            let s: f64 = xs.iter().sum();
            if t.is_float() {
                (s / n as f64, (n as f64 * eps(t) * abs_sum) / n as f64 + eps(t) * (s / n as f64).abs())
            } else {
                ((s / n as f64).trunc(), 0.0)
            }
        }
    }
}

pub fn check_case(
    comm: &Communicator,
    t: DataType,
    op: ReduceOp,
    count: usize,
    in_place: bool,
    seed: usize,
) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let vals: Vec<f64> = (0..count).map(|i| super::input(rank, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
    let mut send = vec![0u8; count * t.size()];
    oxccl::reduce::from_f64(t, &vals, &mut send);
    let mut recv = if in_place { send.clone() } else { vec![0xA5u8; count * t.size()] };
    let r = if in_place {
        let p = recv.as_mut_ptr();
        // SAFETY: recv holds count elements; in place.
        unsafe { comm.all_reduce_raw(p, p, count, t, op) }
    } else {
        // SAFETY: both buffers hold count elements and do not overlap.
        unsafe { comm.all_reduce_raw(send.as_ptr(), recv.as_mut_ptr(), count, t, op) }
    };
    r.map_err(|e| format!("{t:?} {op:?} count {count}: {e}"))?;
    let got = oxccl::reduce::to_f64(t, &recv);
    for (i, g) in got.iter().enumerate() {
        let (want, tol) = reference(t, op, n, i, seed);
        if (g - want).abs() > tol {
            return Err(format!("rank {rank}: {t:?} {op:?} count {count} in_place {in_place}: element {i} is {g}, want {want} (tolerance {tol})"));
        }
    }
    Ok(())
}

/// Runs the whole type × op matrix, in place and out of place, for each of `counts`.
pub fn check_matrix(comm: &Communicator, counts: &[usize]) -> Result<(), String> {
    let mut seed = 0;
    for &count in counts {
        for t in DataType::ALL {
            for op in ReduceOp::ALL {
                for in_place in [false, true] {
                    seed += 1;
                    check_case(comm, t, op, count, in_place, seed)?;
                }
            }
        }
    }
    Ok(())
}
