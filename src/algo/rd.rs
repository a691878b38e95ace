//! Recursive-doubling all-reduce: the latency-optimised path for small messages.
//!
//! With `p` the largest power of two not above `n` and `rem = n - p`, the first `2 * rem` ranks
//! pair up: each even one sends its input to the odd one after it and waits for the final
//! result. The remaining `p` ranks ("virtual ranks") then run `log2(p)` rounds; in the round of
//! bit `m`, virtual rank `v` exchanges its whole partial result with `v ^ m` and reduces. Every
//! rank combines the same operands in the same tree, so all end with identical bits. Cost:
//! `log2(p)` (+2 when `n` is not a power of two) message latencies instead of the ring's
//! `2(n-1)`, for `log2(p)` times the data per rank.
//!
//! Each exchange is cut into chunks so that large messages still pipeline: chunk `k` of round
//! `m + 1` goes out as soon as chunk `k` of round `m` is reduced.

use super::{byte_chunks, trivial_reduction, Action, Plan, Region, Step};

/// Rank `rank`'s recursive-doubling all-reduce plan.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if let Some(p) = trivial_reduction(n, count, total, 0) {
        return p;
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    let pieces = byte_chunks(count, elem, chunk_bytes);
    // Per chunk: the step that last wrote it into the receive buffer (None: still in `send`).
    let mut last: Vec<Option<usize>> = vec![None; pieces.len()];
    let src = |l: Option<usize>, off, len| if l.is_some() { Region::recv(off, len) } else { Region::send(off, len) };
    if rank < 2 * rem && rank % 2 == 0 {
        // Folded away: hand the input over, then receive the result.
        let sent: Vec<usize> = pieces
            .iter()
            .map(|&(off, len)| plan.push(Step::Send { peer: rank + 1, src: Region::send(off, len) }, vec![]))
            .collect();
        for (&(off, len), s) in pieces.iter().zip(sent) {
            plan.push(Step::Recv { peer: rank + 1, dst: Region::recv(off, len), action: Action::Store }, vec![s]);
        }
        return plan;
    }
    if rank < 2 * rem {
        for (c, &(off, len)) in pieces.iter().enumerate() {
            let action = Action::Reduce { with: Region::send(off, len) };
            last[c] = Some(plan.push(Step::Recv { peer: rank - 1, dst: Region::recv(off, len), action }, vec![]));
        }
    }
    let vrank = if rank < 2 * rem { rank / 2 } else { rank - rem };
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
    let mut mask = 1;
    while mask < p {
        let partner = real(vrank ^ mask);
        let final_round = mask * 2 == p;
        for (c, &(off, len)) in pieces.iter().enumerate() {
            let with = src(last[c], off, len);
            let s = plan.push(Step::Send { peer: partner, src: with }, last[c].into_iter().collect());
            // The reduction overwrites what was just sent: it waits for the send (the bytes
            // wait in staging meanwhile).
            let action = if final_round { Action::ReduceFinal { with } } else { Action::Reduce { with } };
            let deps = std::iter::once(s).chain(last[c]).collect();
            last[c] = Some(plan.push(Step::Recv { peer: partner, dst: Region::recv(off, len), action }, deps));
        }
        mask *= 2;
    }
    if rank < 2 * rem {
        for (c, &(off, len)) in pieces.iter().enumerate() {
            plan.push(Step::Send { peer: rank - 1, src: Region::recv(off, len) }, last[c].into_iter().collect());
        }
    }
    plan
}

/// Number of message rounds on the critical path for `n` ranks.
pub fn rounds(n: usize) -> usize {
    if n <= 1 {
        return 0;
    }
    let log = (usize::BITS - 1 - n.leading_zeros()) as usize;
    log + if n.is_power_of_two() { 0 } else { 2 }
}
