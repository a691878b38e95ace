//! The table of collectives oxccl-perf knows: buffer sizing and bus-bandwidth factor as
//! nccl-tests defines them, how to run one call, and what each output element must hold.

use crate::data::{Case, Expect};
use oxccl::{Collective as Coll, Communicator, DataType, ReduceOp};

/// One rank's buffer sizes in elements, as nccl-tests' `getCollByteCount` computes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    /// Elements in the send buffer.
    pub send: usize,
    /// Elements in the receive buffer.
    pub recv: usize,
    /// The `count` argument of the call.
    pub param: usize,
    /// In place, rank r's send data starts at `recv + send_ip_off * r` elements.
    pub send_ip_off: usize,
    /// In place, rank r's receive data starts at `recv + recv_ip_off * r` elements.
    pub recv_ip_off: usize,
}

/// The arguments of one call.
pub struct Call {
    /// Send buffer.
    pub send: *const u8,
    /// Receive buffer (may equal `send`).
    pub recv: *mut u8,
    /// The count argument (`Counts::param`).
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (ignored by data-movement collectives).
    pub op: ReduceOp,
    /// Root rank (ignored by collectives without one).
    pub root: usize,
}

/// How a table entry runs: one library collective (built from the root), or nccl-tests'
/// sendrecv (a grouped send to `rank+1` and receive from `rank-1`).
#[derive(Clone, Copy)]
pub enum Kind {
    /// A collective call.
    Coll(fn(usize) -> Coll),
    /// Grouped send to the next rank and receive from the previous one.
    SendRecv,
}

/// The expected value of receive element `i` on `rank` (`None`: not checked on this rank).
pub type ExpectFn = fn(c: &Case, counts: &Counts, rank: usize, root: usize, i: usize) -> Option<Expect>;

/// A collective's entry in the table.
pub struct Collective {
    /// Name as given on the command line (nccl-tests' binary name without `_perf`).
    pub name: &'static str,
    /// Takes a reduction operator (`-o` applies).
    pub has_op: bool,
    /// Takes a root rank (`-r` applies).
    pub has_root: bool,
    /// busbw = algbw × factor(nranks).
    pub bus_factor: fn(usize) -> f64,
    /// Buffer sizing from the element count of one size step and the number of ranks.
    pub counts: fn(usize, usize) -> Counts,
    /// How to run it.
    pub kind: Kind,
    /// Expected output.
    pub expected: ExpectFn,
}

fn factor_allreduce(n: usize) -> f64 {
    2.0 * (n as f64 - 1.0) / n as f64
}
fn factor_ring(n: usize) -> f64 {
    (n as f64 - 1.0) / n as f64
}
fn factor_one(_: usize) -> f64 {
    1.0
}

fn counts_same(count: usize, _: usize) -> Counts {
    Counts { send: count, recv: count, param: count, send_ip_off: 0, recv_ip_off: 0 }
}
fn counts_gather(count: usize, n: usize) -> Counts {
    let base = count / n.max(1);
    Counts { send: base, recv: base * n, param: base, send_ip_off: base, recv_ip_off: 0 }
}
fn counts_scatter(count: usize, n: usize) -> Counts {
    let base = count / n.max(1);
    Counts { send: base * n, recv: base, param: base, send_ip_off: 0, recv_ip_off: base }
}
fn counts_alltoall(count: usize, n: usize) -> Counts {
    let base = count / n.max(1);
    Counts { send: base * n, recv: base * n, param: base, send_ip_off: 0, recv_ip_off: 0 }
}

impl Collective {
    /// Runs one call.
    ///
    /// # Safety
    /// The buffers in `c` must be valid for the collective's counts (see [`Counts`]).
    pub unsafe fn run(&self, comm: &Communicator, c: &Call) -> oxccl::Result<()> {
        match self.kind {
            // SAFETY: forwarded from this function's contract.
            Kind::Coll(make) => unsafe { comm.run_raw(make(c.root), c.send, c.recv, c.count, c.dtype, c.op) },
            Kind::SendRecv => {
                let (rank, n) = (comm.rank(), comm.size());
                let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
                let null = std::ptr::null_mut();
                // SAFETY: forwarded; the send reads `c.send`, the receive writes `c.recv`.
                let (s, r) = unsafe {
                    let s = comm.prepare(Coll::Send { peer: next }, c.send, null, c.count, c.dtype, c.op)?;
                    (s, comm.prepare(Coll::Recv { peer: prev }, null, c.recv, c.count, c.dtype, c.op)?)
                };
                oxccl::group::run(vec![(comm, s), (comm, r)])
            }
        }
    }
}

fn exp_all_reduce(c: &Case, _: &Counts, _: usize, _: usize, i: usize) -> Option<Expect> {
    Some(c.reduced(i))
}
fn exp_all_gather(c: &Case, k: &Counts, _: usize, _: usize, i: usize) -> Option<Expect> {
    Some(c.copied(i / k.param.max(1), i % k.param.max(1)))
}
fn exp_reduce_scatter(c: &Case, k: &Counts, rank: usize, _: usize, i: usize) -> Option<Expect> {
    Some(c.reduced(rank * k.param + i))
}
fn exp_broadcast(c: &Case, _: &Counts, _: usize, root: usize, i: usize) -> Option<Expect> {
    Some(c.copied(root, i))
}
fn exp_reduce(c: &Case, _: &Counts, rank: usize, root: usize, i: usize) -> Option<Expect> {
    (rank == root).then(|| c.reduced(i))
}
fn exp_alltoall(c: &Case, k: &Counts, rank: usize, _: usize, i: usize) -> Option<Expect> {
    let p = k.param.max(1);
    Some(c.copied(i / p, rank * k.param + i % p))
}
fn exp_gather(c: &Case, k: &Counts, rank: usize, root: usize, i: usize) -> Option<Expect> {
    (rank == root).then(|| exp_all_gather(c, k, rank, root, i)).flatten()
}
fn exp_scatter(c: &Case, k: &Counts, rank: usize, root: usize, i: usize) -> Option<Expect> {
    Some(c.copied(root, rank * k.param + i))
}
/// nccl-tests' sendrecv: every rank sends to rank+1 and receives from rank-1.
fn exp_sendrecv(c: &Case, _: &Counts, rank: usize, _: usize, i: usize) -> Option<Expect> {
    Some(c.copied((rank + c.nranks - 1) % c.nranks.max(1), i))
}

macro_rules! coll {
    ($name:literal, $op:expr, $root:expr, $factor:ident, $counts:ident, $kind:expr, $exp:ident) => {
        Collective {
            name: $name,
            has_op: $op,
            has_root: $root,
            bus_factor: $factor,
            counts: $counts,
            kind: $kind,
            expected: $exp,
        }
    };
}

/// Every collective, in nccl-tests' order.
pub static COLLECTIVES: [Collective; 9] = [
    coll!("all_reduce", true, false, factor_allreduce, counts_same, Kind::Coll(|_| Coll::AllReduce), exp_all_reduce),
    coll!("all_gather", false, false, factor_ring, counts_gather, Kind::Coll(|_| Coll::AllGather), exp_all_gather),
    coll!(
        "reduce_scatter",
        true,
        false,
        factor_ring,
        counts_scatter,
        Kind::Coll(|_| Coll::ReduceScatter),
        exp_reduce_scatter
    ),
    coll!(
        "broadcast",
        false,
        true,
        factor_one,
        counts_same,
        Kind::Coll(|root| Coll::Broadcast { root }),
        exp_broadcast
    ),
    coll!("reduce", true, true, factor_one, counts_same, Kind::Coll(|root| Coll::Reduce { root }), exp_reduce),
    coll!("alltoall", false, false, factor_ring, counts_alltoall, Kind::Coll(|_| Coll::AllToAll), exp_alltoall),
    coll!("sendrecv", false, false, factor_one, counts_same, Kind::SendRecv, exp_sendrecv),
    coll!("gather", false, true, factor_ring, counts_gather, Kind::Coll(|root| Coll::Gather { root }), exp_gather),
    coll!("scatter", false, true, factor_ring, counts_scatter, Kind::Coll(|root| Coll::Scatter { root }), exp_scatter),
];

/// Finds a collective by name; accepts `all_reduce`, `allreduce`, `all-reduce`, `all_reduce_perf`.
pub fn find(name: &str) -> Option<&'static Collective> {
    let norm = |s: &str| s.to_ascii_lowercase().trim_end_matches("_perf").replace(['_', '-'], "");
    let want = norm(name);
    COLLECTIVES.iter().find(|c| norm(c.name) == want)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizing_matches_nccl_tests() {
        let c = find("all_gather_perf").map(|c| (c.counts)(10, 3));
        assert_eq!(c, Some(Counts { send: 3, recv: 9, param: 3, send_ip_off: 3, recv_ip_off: 0 }));
        let c = find("reduce-scatter").map(|c| (c.counts)(10, 3));
        assert_eq!(c, Some(Counts { send: 9, recv: 3, param: 3, send_ip_off: 0, recv_ip_off: 3 }));
        assert_eq!(find("AllReduce").map(|c| (c.bus_factor)(4)), Some(1.5));
        assert!(find("bogus").is_none());
    }

    #[test]
    fn data_movement_expectations_point_at_the_right_source() {
        let case = Case::new(DataType::Int32, None, 3, 5);
        let k = counts_alltoall(12, 3);
        // Rank 1's receive element 2*4+1 comes from rank 2's send element 1*4+1.
        assert_eq!(exp_alltoall(&case, &k, 1, 0, 9), Some(case.copied(2, 5)));
        assert_eq!(exp_sendrecv(&case, &k, 0, 0, 3), Some(case.copied(2, 3)));
        assert_eq!(exp_gather(&case, &counts_gather(12, 3), 1, 0, 0), None);
    }
}
