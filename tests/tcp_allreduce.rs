//! Multi-process all-reduce over TCP (loopback): 1..5 ranks, every type × op, counts
//! 0, 1, 7, nranks-1 and a prime above 1M, in place and out of place, each result checked
//! against a reference computed here in f64 from every rank's inputs.

mod common;
use common::allreduce::check_case;
use oxccl::{Communicator, DataType, ReduceOp};
use std::time::Duration;

#[test]
fn child_all_reduce() {
    let Some((rank, n, id)) = common::child_role() else { return };
    let comm = Communicator::init_rank(n, &oxccl::UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    let counts = [0, 1, 7, n.saturating_sub(1), 1_000_003];
    if let Err(e) = common::allreduce::check_matrix(&comm, &counts) {
        panic!("{e}");
    }
}

#[test]
fn tcp_all_reduce_1_to_5_ranks() {
    if common::child_role().is_some() {
        return;
    }
    let env = [
        ("OXCCL_SOCKET_IFNAME", "lo".to_string()),
        ("OXCCL_TIMEOUT_MS", "60000".to_string()),
        ("OXCCL_TRANSPORT", "tcp".to_string()),
    ];
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
