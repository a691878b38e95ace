//! Property test: random collective, algorithm, rank count, type, operator, count, root,
//! placement and chunk size, on in-memory ranks, checked element by element against the
//! independent f64 reference (tests/harness).

#[path = "../src/bin/oxccl-perf/colls.rs"]
#[allow(dead_code)]
mod colls;
#[path = "../src/bin/oxccl-perf/data.rs"]
#[allow(dead_code)]
mod data;
mod harness;

use colls::COLLECTIVES;
use harness::{algorithms, run_in_memory, Case};
use oxccl::{DataType, ReduceOp};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_shapes_match_the_reference(
        n in 1usize..=12,
        which in 0usize..COLLECTIVES.len(),
        dtype in 0usize..DataType::ALL.len(),
        op in 0usize..ReduceOp::ALL.len(),
        count in prop_oneof![0usize..16, 0usize..3000],
        root in 0usize..64,
        in_place in any::<bool>(),
        algo in 0usize..4,
        chunk in prop_oneof![Just(None), (1usize..4096).prop_map(Some)],
        seed in any::<u64>(),
    ) {
        let e = &COLLECTIVES[which];
        let algos = algorithms(e);
        let case = Case {
            coll: e,
            dtype: DataType::ALL[dtype],
            op: e.has_op.then_some(ReduceOp::ALL[op]),
            count,
            root: root % n,
            in_place,
            algo: algos.get(algo).copied().flatten(),
            chunk,
            seed,
        };
        let failures = run_in_memory(n, std::slice::from_ref(&case));
        prop_assert!(failures.is_empty(), "{case:?} on {n} ranks:\n{}", failures.join("\n"));
    }
}
