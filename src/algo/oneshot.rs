//! One-shot all-reduce for two ranks: each rank sends its whole buffer to the other and reduces
//! what it receives with its own input, chunk by chunk.
//!
//! The ring needs two dependent transfers per chunk (reduce-scatter, then all-gather); this
//! needs one, which halves the latency of small messages. Both ranks compute `mine op theirs`,
//! i.e. the two operands in opposite order, so the schedule is used only where the operator is
//! exactly commutative ([`exact_commutative`]): integer types, and floating-point sum, product
//! and average (IEEE `a + b == b + a` and `a * b == b * a` bit for bit; only the payload of a NaN
//! made from two NaNs may differ). Floating-point max/min keep the ring, since `max(+0, -0)`
//! may depend on operand order.

use super::{chunks, Action, Plan, Region, Step};
use crate::types::{DataType, ReduceOp};

/// Whether `a op b` and `b op a` have the same bits for this type and operator.
pub fn exact_commutative(dtype: DataType, op: ReduceOp) -> bool {
    !dtype.is_float() || matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg)
}

/// Builds rank `rank`'s plan (of 2 ranks) for `count` elements of `elem` bytes, in chunks of at
/// most `chunk_bytes`.
pub fn all_reduce(rank: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    debug_assert!(rank < 2, "the one-shot schedule is for two ranks");
    let mut plan = Plan::default();
    let peer = 1 - rank;
    let parts: Vec<(usize, usize)> =
        chunks(count, (chunk_bytes / elem).max(1)).map(|(f, l)| (f * elem, l * elem)).collect();
    let sends: Vec<usize> =
        parts.iter().map(|&(off, len)| plan.push(Step::Send { peer, src: Region::send(off, len) }, vec![])).collect();
    for (&(off, len), send) in parts.iter().zip(sends) {
        // In place, the chunk must have gone out before its result overwrites it.
        let with = Region::send(off, len);
        plan.push(Step::Recv { peer, dst: Region::recv(off, len), action: Action::ReduceFinal { with } }, vec![send]);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_everything_and_reduces_everything() {
        let p = all_reduce(1, 1001, 4, 1000);
        let sent: usize = p
            .nodes
            .iter()
            .filter_map(|n| if let Step::Send { peer: 0, src } = n.step { Some(src.len) } else { None })
            .sum();
        let reduced: usize = p
            .nodes
            .iter()
            .filter_map(|n| if let Step::Recv { peer: 0, dst, .. } = n.step { Some(dst.len) } else { None })
            .sum();
        assert_eq!((sent, reduced), (4004, 4004));
        assert!(exact_commutative(DataType::Float32, ReduceOp::Sum));
        assert!(exact_commutative(DataType::Int8, ReduceOp::Max));
        assert!(!exact_commutative(DataType::Float16, ReduceOp::Min));
    }
}
