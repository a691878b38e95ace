//! Drives collective tests on one rank's communicator through oxccl-perf's table of
//! collectives (`src/bin/oxccl-perf/colls.rs`: sizing, in-place layouts, how to call each one)
//! and checks every output element against its reference (`data.rs`): inputs are a
//! deterministic function of (rank, index, seed), and each rank computes the expected result of
//! every element in f64 from all ranks' inputs, with its own element codec, independent of the
//! library's. Test binaries using this declare `mod data` and `mod colls` (by `#[path]`) at
//! their root.
#![allow(dead_code)]

use crate::colls::{Call, Collective as Entry, Counts, Kind, COLLECTIVES};
use crate::data;
use oxccl::{Algo, AlgoSet, Communicator, DataType, Overrides, ReduceOp};

/// One collective call to test.
#[derive(Clone, Debug)]
pub struct Case {
    /// Entry of the collective in oxccl-perf's table.
    pub coll: &'static Entry,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (for the collectives that reduce).
    pub op: Option<ReduceOp>,
    /// The count argument (per rank).
    pub count: usize,
    /// Root rank (rooted collectives).
    pub root: usize,
    /// NCCL's in-place layout.
    pub in_place: bool,
    /// Forced algorithm (`None`: the cost model's choice).
    pub algo: Option<Algo>,
    /// Forced chunk size in bytes.
    pub chunk: Option<usize>,
    /// Varies the data between cases.
    pub seed: u64,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// The table entry of a collective by name.
pub fn coll(name: &str) -> &'static Entry {
    crate::colls::find(name).expect("collective in the table")
}

/// Algorithms a table entry can run (one `None` entry: sendrecv has no algorithm choice).
pub fn algorithms(e: &Entry) -> Vec<Option<Algo>> {
    match e.kind {
        Kind::Coll(make) => make(0).algorithms().iter().map(|&a| Some(a)).collect(),
        Kind::SendRecv => vec![None],
    }
}

/// Buffer sizes of a case (the table sizes from a per-size count; find the one whose count
/// argument is `count`).
pub fn counts_for(e: &Entry, count: usize, n: usize) -> Counts {
    let k = (e.counts)(count, n);
    if k.param == count {
        k
    } else {
        (e.counts)(count * n, n)
    }
}

/// Runs one case on this rank and checks its result. `Err` means the call itself failed (the
/// communicator is then unusable); wrong elements are reported in `Ok(Some(text))`.
pub fn run_case(comm: &Communicator, c: &Case) -> Result<Option<String>, String> {
    let (rank, n) = (comm.rank(), comm.size());
    comm.set_tuning(Overrides { algos: c.algo.map(AlgoSet::only), chunk: c.chunk, ..Default::default() });
    let k = counts_for(c.coll, c.count, n);
    let ts = c.dtype.size();
    let reference = data::Case::new(c.dtype, c.op, n, c.seed);
    let recv_elems = if c.in_place {
        k.recv.max(k.send_ip_off * (n - 1) + k.send).max(k.recv_ip_off * (n - 1) + k.recv)
    } else {
        k.recv
    };
    let mut recv = vec![0xA5u8; recv_elems * ts];
    let mut send = vec![0u8; k.send * ts];
    let send_off = if c.in_place { k.send_ip_off * rank } else { 0 };
    let recv_off = if c.in_place { k.recv_ip_off * rank } else { 0 };
    {
        let dst = if c.in_place { &mut recv[send_off * ts..(send_off + k.send) * ts] } else { &mut send[..] };
        for j in 0..k.send {
            data::write_elem(c.dtype, dst, j, reference.input(rank, j));
        }
    }
    let call = Call {
        send: if c.in_place { recv.as_ptr().wrapping_add(send_off * ts) } else { send.as_ptr() },
        recv: recv.as_mut_ptr().wrapping_add(recv_off * ts),
        count: k.param,
        dtype: c.dtype,
        op: c.op.unwrap_or(ReduceOp::Sum),
        root: c.root,
    };
    // SAFETY: the buffers are sized for this collective's counts and layout (as oxccl-perf
    // sizes them) and are not touched by anything else during the call.
    unsafe { c.coll.run(comm, &call) }.map_err(|e| format!("rank {rank}: {c:?}: {e}"))?;
    let out = &recv[recv_off * ts..(recv_off + k.recv) * ts];
    let mut bad = Vec::new();
    for i in 0..k.recv {
        if let Some(e) = (c.coll.expected)(&reference, &k, rank, c.root, i) {
            let got = data::read_elem(c.dtype, out, i);
            if !e.accepts(got) {
                bad.push(format!("[{i}] = {got}, want {} (±{})", e.value, e.tol));
            }
        }
    }
    if !c.in_place {
        if let Some(j) = (0..k.send).find(|&j| data::read_elem(c.dtype, &send, j) != reference.input(rank, j)) {
            bad.push(format!("send buffer [{j}] was modified"));
        }
    }
    Ok((!bad.is_empty()).then(|| {
        let shown: Vec<String> = bad.iter().take(6).cloned().collect();
        format!("rank {rank}: {c:?}: {} wrong: {}", bad.len(), shown.join(", "))
    }))
}

/// Runs every case in order (all ranks must get the same list); returns the failures. Stops at
/// the first call that fails outright (its communicator is unusable after that).
pub fn run_all(comm: &Communicator, cases: &[Case]) -> Vec<String> {
    let mut failures = Vec::new();
    for c in cases {
        match run_case(comm, c) {
            Ok(None) => {}
            Ok(Some(wrong)) => failures.push(wrong),
            Err(e) => {
                failures.push(e);
                break;
            }
        }
    }
    failures
}

/// Runs `cases` on this process's rank of `comm`, prints how long they took, and panics
/// listing (up to 20 of) the failures if any case went wrong.
pub fn run_all_or_panic(comm: &Communicator, cases: &[Case]) {
    let (rank, n) = (comm.rank(), comm.size());
    let t = std::time::Instant::now();
    let failures = run_all(comm, cases);
    eprintln!("rank {rank} of {n}: {} cases in {:.2?}", cases.len(), t.elapsed());
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Runs `cases` on `n` in-memory ranks (threads) and returns every rank's failures.
pub fn run_in_memory(n: usize, cases: &[Case]) -> Vec<String> {
    let mut comms = Communicator::in_memory(n);
    for c in &mut comms {
        c.set_timeout(std::time::Duration::from_secs(60));
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(move || run_all(c, cases))).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|_| vec!["a rank panicked".into()])).collect()
    })
}

fn dedup(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}

/// How much of the matrix to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Every type × op at small counts, every algorithm, root, placement (up to 9 ranks).
    Full,
    /// Two type/op pairs, every algorithm, root and placement (16, 64, 256 ranks).
    Thin,
    /// Between the two, for multi-process runs.
    Process,
}

const SMALL_TYPES: [(DataType, ReduceOp); 2] = [(DataType::Float32, ReduceOp::Sum), (DataType::Int32, ReduceOp::Max)];

/// One count of a matrix: (count, types × ops to run, chunk).
type CountCases = (usize, Vec<(DataType, ReduceOp)>, Option<usize>);

/// The cases for `n` ranks at `level`, over the collectives named in `only` (all when empty).
pub fn matrix(n: usize, level: Level, only: &[&str]) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut seed = 0;
    for e in COLLECTIVES.iter().filter(|e| only.is_empty() || only.contains(&e.name)) {
        let roots = if e.has_root { dedup(vec![0, n - 1, n / 2]) } else { vec![0] };
        let blocked = (e.counts)(n, n).param != n;
        // Per count: (types × ops to run, chunk).
        let mut counts: Vec<CountCases> = Vec::new();
        let all: Vec<(DataType, ReduceOp)> = DataType::ALL
            .iter()
            .flat_map(|&t| ReduceOp::ALL.iter().map(move |&o| (t, o)))
            .filter(|&(_, o)| e.has_op || o == ReduceOp::Sum)
            .collect();
        match level {
            Level::Full => {
                counts.push((0, SMALL_TYPES.to_vec(), None));
                counts.push((1, all.clone(), Some(8)));
                counts.push((n - 1, SMALL_TYPES.to_vec(), Some(4)));
                counts.push((13, all.clone(), Some(16)));
                let mid = [
                    (DataType::Float32, ReduceOp::Avg),
                    (DataType::Bfloat16, ReduceOp::Sum),
                    (DataType::Int64, ReduceOp::Prod),
                    (DataType::Uint8, ReduceOp::Min),
                ];
                counts.push((1031, mid.to_vec(), Some(256)));
                counts.push((if blocked { 20_011 } else { 100_003 }, vec![(DataType::Float32, ReduceOp::Sum)], None));
            }
            Level::Thin => {
                counts.push((1, SMALL_TYPES.to_vec(), Some(4)));
                counts.push((13, SMALL_TYPES.to_vec(), None));
                if !blocked {
                    counts.push((n - 1, SMALL_TYPES.to_vec(), Some(64)));
                    counts.push((1031, vec![(DataType::Float32, ReduceOp::Avg)], Some(1024)));
                }
            }
            Level::Process => {
                counts.push((0, SMALL_TYPES.to_vec(), None));
                counts.push((1, SMALL_TYPES.to_vec(), None));
                counts.push((13, all.clone(), Some(16)));
                counts.push((
                    1031,
                    vec![(DataType::Float16, ReduceOp::Sum), (DataType::Float64, ReduceOp::Min)],
                    Some(512),
                ));
                counts.push((
                    if blocked { 200_003 } else { 1_000_003 },
                    vec![(DataType::Float32, ReduceOp::Sum)],
                    None,
                ));
            }
        }
        let mut seen = Vec::new();
        counts.retain(|c| {
            !seen.contains(&c.0) && {
                seen.push(c.0);
                true
            }
        });
        let algos: Vec<Option<Algo>> = match algorithms(e) {
            one if one.len() == 1 => one,
            many => many.into_iter().chain([None]).collect(),
        };
        for (count, types, chunk) in counts {
            for &(dtype, op) in &types {
                for &root in &roots {
                    for in_place in [false, true] {
                        for &algo in &algos {
                            seed += 1;
                            let op = e.has_op.then_some(op);
                            cases.push(Case { coll: e, dtype, op, count, root, in_place, algo, chunk, seed });
                        }
                    }
                }
            }
        }
    }
    cases
}
