//! Multi-process all-reduce over TCP (loopback): 1..5 ranks, every type × op, counts
//! 0, 1, 7, nranks-1 and a prime above 1M, in place and out of place, each result checked
//! against a reference computed here in f64 from every rank's inputs.

mod common;
use oxccl::{Communicator, DataType, ReduceOp};
use std::time::Duration;

use common::eps;

fn unsigned(t: DataType) -> bool {
    matches!(t, DataType::Uint8 | DataType::Uint32 | DataType::Uint64)
}

/// Expected value and allowed error for element `i`.
fn reference(t: DataType, op: ReduceOp, n: usize, i: usize, seed: usize) -> (f64, f64) {
    let xs: Vec<f64> = (0..n).map(|r| common::input(r, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
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

fn check_case(comm: &Communicator, t: DataType, op: ReduceOp, count: usize, in_place: bool, seed: usize) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let vals: Vec<f64> = (0..count).map(|i| common::input(rank, i, seed, unsigned(t), op == ReduceOp::Prod)).collect();
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

#[test]
fn child_all_reduce() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    let counts = [0, 1, 7, n.saturating_sub(1), 1_000_003];
    let mut seed = 0;
    for &count in &counts {
        for t in DataType::ALL {
            for op in ReduceOp::ALL {
                for in_place in [false, true] {
                    seed += 1;
                    if let Err(e) = check_case(&comm, t, op, count, in_place, seed) {
                        panic!("{e}");
                    }
                }
            }
        }
    }
}

#[test]
fn tcp_all_reduce_1_to_5_ranks() {
    if common::child_role().is_some() {
        return;
    }
    let env = [("OXCCL_SOCKET_IFNAME", "lo".to_string()), ("OXCCL_TIMEOUT_MS", "60000".to_string())];
    for n in 1..=5 {
        let res = common::run_ranks("child_all_reduce", n, &env, Duration::from_secs(300));
        common::assert_all_ok(&res);
    }
}

#[test]
fn in_memory_all_reduce_matches_reference() {
    if common::child_role().is_some() {
        return;
    }
    for n in [1, 2, 3, 7, 16] {
        let comms = Communicator::in_memory(n);
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let mut seed = 0;
                    for count in [0, 1, n, 1001] {
                        for t in DataType::ALL {
                            for op in ReduceOp::ALL {
                                seed += 1;
                                check_case(c, t, op, count, seed % 2 == 0, seed).unwrap();
                            }
                        }
                    }
                });
            }
        });
    }
}
