//! `OXCCL_DETERMINISTIC=1`: every reduction gives the left fold of the ranks' inputs in rank
//! order, bit for bit, whatever the algorithm settings, chunk size, message size, links and
//! placement. One process per rank; each rank runs the case list under every forced algorithm
//! and two chunk sizes, checks f32/f64 against the rank-order fold computed here from the
//! inputs, checks that a short call gives the prefix of a long one, and prints a hash of every
//! f16/bf16 result, which the parent compares across configurations (shared memory, TCP, two
//! fake hosts; 3 and 4 ranks). The same matrix with the switch off must show a difference, so
//! the inputs are hard enough.

mod common;

use oxccl::{AlgoSet, Communicator, DataType, Overrides, ReduceOp, UniqueId};
use std::collections::BTreeMap;
use std::time::Duration;

const SMALL: [usize; 3] = [1, 1000, 65537];
const LARGE: [usize; 2] = [(1 << 20) + 3, 4 << 20];

/// Rank `rank`'s input element `i`: both signs, magnitudes 2^-span..2^span, so that the sum
/// depends on the order of the operands.
fn input(rank: usize, i: usize, span: i32) -> f64 {
    let h = (i.wrapping_mul(2654435761) ^ rank.wrapping_mul(40503).wrapping_add(17)) % (2 * span as usize + 1);
    let sign = if (i * 5 + rank) % 3 == 0 { -1.0 } else { 1.0 };
    sign * 2f64.powi(h as i32 - span) * (1.0 + ((i * 7 + rank * 3) % 97) as f64 / 97.0)
}

fn span(dtype: DataType) -> i32 {
    match dtype {
        DataType::Float16 => 6,
        DataType::Bfloat16 => 20,
        _ => 30,
    }
}

/// The input as the element type stores it.
fn bytes(dtype: DataType, rank: usize, count: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..count).map(|i| input(rank, i, span(dtype))).collect();
    let mut out = vec![0u8; count * dtype.size()];
    oxccl::reduce::from_f64(dtype, &vals, &mut out);
    out
}

/// The left fold in rank order, `((x0 + x1) + x2) + ...`, in the type's own precision
/// (`avg`: divided by n afterwards), for element indices `from..from + count`.
fn reference(dtype: DataType, n: usize, from: usize, count: usize, avg: bool) -> Vec<u8> {
    let ins: Vec<Vec<u8>> = (0..n).map(|r| bytes(dtype, r, from + count)).collect();
    fold(dtype, &ins, from, count, avg)
}

/// [`reference`] of the stored inputs `ins` (one per rank).
fn fold(dtype: DataType, ins: &[Vec<u8>], from: usize, count: usize, avg: bool) -> Vec<u8> {
    let n = ins.len();
    let ins: Vec<Vec<f64>> = ins
        .iter()
        .map(|b| oxccl::reduce::to_f64(dtype, &b[from * dtype.size()..(from + count) * dtype.size()]))
        .collect();
    (0..count)
        .flat_map(|i| {
            if dtype == DataType::Float32 {
                let mut acc = ins[0][i] as f32;
                ins[1..].iter().for_each(|x| acc += x[i] as f32);
                if avg {
                    acc /= n as f32;
                }
                acc.to_le_bytes().to_vec()
            } else {
                let mut acc = ins[0][i];
                ins[1..].iter().for_each(|x| acc += x[i]);
                if avg {
                    acc /= n as f64;
                }
                acc.to_le_bytes().to_vec()
            }
        })
        .collect()
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100000001b3))
}

fn all_reduce(comm: &Communicator, dtype: DataType, send: &[u8], count: usize, op: ReduceOp) -> Vec<u8> {
    let mut recv = vec![0u8; send.len()];
    // SAFETY: both buffers hold `count` elements of `dtype`.
    unsafe { comm.all_reduce_raw(send.as_ptr(), recv.as_mut_ptr(), count, dtype, op) }.expect("all_reduce");
    recv
}

/// One rank: every case under every forced algorithm and two chunk sizes. With the switch on,
/// asserts the f32/f64 results against the reference and the f16/bf16 results identical across
/// the settings, and prints `DETHASH` lines; off, prints `DETDIFF` for results that differ from
/// the reference or between settings.
#[test]
fn child_det() {
    let Some((rank, n, id)) = common::child_role() else { return };
    if let Ok(hosts) = std::env::var("DET_HOSTS") {
        let host: Vec<&str> = hosts.split(',').collect();
        std::env::set_var("OXCCL_HOSTID", format!("det-fake-host-{}", host[rank]));
    }
    let on = std::env::var("OXCCL_DETERMINISTIC").is_ok_and(|v| v == "1");
    let large = std::env::var("DET_LARGE").is_ok();
    let comm = Communicator::init_rank(n, &UniqueId::from_hex(&id).unwrap(), rank).expect("init");
    assert_eq!(comm.deterministic(), on);
    if let Ok(hosts) = std::env::var("DET_HOSTS") {
        let distinct: std::collections::BTreeSet<&String> = comm.hosts().iter().collect();
        assert_eq!(distinct.len(), 2, "fake hosts {hosts}: {:?}", comm.hosts());
    }
    let settings: Vec<Overrides> = [None, Some("ring"), Some("tree"), Some("rd"), Some("direct")]
        .into_iter()
        .flat_map(|a| {
            [None, Some(4096)].into_iter().map(move |chunk| Overrides {
                algos: a.map(|a| AlgoSet::parse(a).0),
                chunk,
                deterministic: None,
                compress: None,
            })
        })
        .collect();
    let mut diffs = 0;
    let mut report = |what: String, same: bool| {
        if !same {
            diffs += 1;
            if on {
                panic!("rank {rank}: {what}");
            }
        }
    };
    let mut hashes: BTreeMap<(String, usize), u64> = BTreeMap::new();
    let mut longest: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    // Per (type, count): every rank's input, and the reference sum and average.
    type Inputs = (Vec<Vec<u8>>, Option<Vec<u8>>, Option<Vec<u8>>);
    let mut inputs: BTreeMap<(usize, usize), Inputs> = BTreeMap::new();
    let counts: Vec<usize> = SMALL.into_iter().chain(if large { LARGE.to_vec() } else { vec![] }).collect();
    for &count in &counts {
        // The large counts only under the default settings: CI stays fast.
        let these = if count > 65537 { &settings[..1] } else { &settings[..] };
        for t in these {
            comm.set_tuning(*t);
            let dtypes: &[DataType] = if count > 65537 {
                &[DataType::Float32, DataType::Float16]
            } else {
                &[DataType::Float32, DataType::Float64, DataType::Float16, DataType::Bfloat16]
            };
            for &dtype in dtypes {
                let ops: &[ReduceOp] =
                    if dtype == DataType::Float32 { &[ReduceOp::Sum, ReduceOp::Avg] } else { &[ReduceOp::Sum] };
                let ins = inputs.entry((dtype as usize, count)).or_insert_with(|| {
                    let ins: Vec<Vec<u8>> = (0..n).map(|r| bytes(dtype, r, count)).collect();
                    let want = |avg| {
                        matches!(dtype, DataType::Float32 | DataType::Float64).then(|| fold(dtype, &ins, 0, count, avg))
                    };
                    let (sum, avg) = (want(false), if dtype == DataType::Float32 { want(true) } else { None });
                    (ins, sum, avg)
                });
                for &op in ops {
                    let got = all_reduce(&comm, dtype, &ins.0[rank], count, op);
                    let key = format!("{dtype:?}/{op:?}");
                    let want = if op == ReduceOp::Avg { &ins.2 } else { &ins.1 };
                    if let Some(want) = want {
                        report(format!("{key} count {count} {t:?}: not the rank-order fold"), &got == want);
                    }
                    let h = fnv(&got);
                    match hashes.get(&(key.clone(), count)) {
                        Some(&first) => report(format!("{key} count {count} {t:?}: hash differs"), first == h),
                        None => {
                            hashes.insert((key.clone(), count), h);
                        }
                    }
                    // Element i of a short call equals element i of a longer one.
                    if let Some(prev) = longest.get(&key) {
                        let k = prev.len().min(got.len());
                        report(format!("{key} count {count}: prefix differs"), prev[..k] == got[..k]);
                    }
                    if longest.get(&key).is_none_or(|p| p.len() < got.len()) {
                        longest.insert(key, got);
                    }
                }
            }
            // Reduce-scatter and reduce: the same fold.
            let dt = DataType::Float32;
            let rs_count = count.min(1000);
            let send = bytes(dt, rank, n * rs_count);
            let mut recv = vec![0u8; rs_count * 4];
            // SAFETY: the send buffer holds n * rs_count elements, the receive buffer rs_count.
            unsafe { comm.reduce_scatter_raw(send.as_ptr(), recv.as_mut_ptr(), rs_count, dt, ReduceOp::Sum) }
                .expect("reduce_scatter");
            let want = reference(dt, n, rank * rs_count, rs_count, false);
            report(format!("reduce_scatter count {rs_count} {t:?}"), recv == want);
            let ins = &inputs[&(dt as usize, count)];
            let mut recv = vec![0u8; count * 4];
            let root = n - 1;
            // SAFETY: both buffers hold `count` elements.
            unsafe { comm.reduce_raw(ins.0[rank].as_ptr(), recv.as_mut_ptr(), count, dt, ReduceOp::Sum, root) }
                .expect("reduce");
            if rank == root {
                report(format!("reduce count {count} {t:?}"), Some(&recv) == ins.1.as_ref());
            }
        }
    }
    for ((key, count), h) in &hashes {
        eprintln!("DETHASH {key} {count} {h:016x}");
    }
    eprintln!("DETDIFF {diffs}");
}

/// Runs `child_det` on `n` ranks with `env`; rank 0's hashes and the number of differences
/// every rank saw.
fn run(n: usize, env: &[(&str, &str)]) -> (Vec<String>, usize) {
    let mut env: Vec<(&str, String)> = env.iter().map(|(k, v)| (*k, v.to_string())).collect();
    env.push(("OXCCL_TIMEOUT_MS", "120000".into()));
    let res = common::run_ranks("child_det", n, &env, Duration::from_secs(300));
    common::assert_all_ok(&res);
    let hashes = res[0].1.lines().filter(|l| l.starts_with("DETHASH")).map(str::to_string).collect();
    let diffs = res
        .iter()
        .flat_map(|r| r.1.lines().filter_map(|l| l.strip_prefix("DETDIFF ")).map(|d| d.parse::<usize>().unwrap()))
        .sum();
    (hashes, diffs)
}

/// The configurations: shared memory, TCP, two fake hosts (hierarchical), on 3 and 4 ranks; the
/// large counts on two of them.
fn configs(on: &'static str) -> Vec<(usize, Vec<(&'static str, &'static str)>)> {
    let d = ("OXCCL_DETERMINISTIC", on);
    vec![
        (4, vec![d, ("DET_LARGE", "1")]),
        (4, vec![d, ("OXCCL_TRANSPORT", "tcp")]),
        (4, vec![d, ("OXCCL_ARENA", "1")]),
        (4, vec![d, ("OXCCL_ARENA", "0")]),
        (4, vec![d, ("DET_HOSTS", "0,0,1,1"), ("DET_LARGE", "1")]),
        (3, vec![d]),
        (3, vec![d, ("OXCCL_TRANSPORT", "tcp")]),
        (3, vec![d, ("DET_HOSTS", "0,1,1")]),
    ]
}

#[test]
fn deterministic_reductions_are_the_rank_order_fold_everywhere() {
    if common::child_role().is_some() {
        return;
    }
    let mut by_n: BTreeMap<usize, Vec<(String, Vec<String>)>> = BTreeMap::new();
    for (n, env) in configs("1") {
        let t = std::time::Instant::now();
        let (hashes, diffs) = run(n, &env);
        eprintln!("{n} ranks {env:?}: {:.1?}", t.elapsed());
        assert_eq!(diffs, 0, "{n} ranks {env:?}");
        assert!(hashes.len() >= 8, "{hashes:?}");
        by_n.entry(n).or_default().push((format!("{env:?}"), hashes));
    }
    // f16/bf16 (and every other) hash identical across the configurations of a rank count,
    // for the counts they share.
    for (n, runs) in &by_n {
        let (first_env, first) = &runs[0];
        for (env, hashes) in &runs[1..] {
            for h in hashes {
                let key = h.rsplit_once(' ').unwrap().0;
                if let Some(f) = first.iter().find(|x| x.rsplit_once(' ').unwrap().0 == key) {
                    assert_eq!(f, h, "{n} ranks: {first_env} vs {env}");
                }
            }
        }
    }
}

#[test]
fn without_the_switch_the_same_matrix_shows_differences() {
    if common::child_role().is_some() {
        return;
    }
    let mut total = 0;
    for (n, env) in configs("0").into_iter().filter(|(_, e)| !e.contains(&("DET_LARGE", "1"))) {
        total += run(n, &env).1;
    }
    eprintln!("{total} differences with the switch off");
    assert!(total > 0, "no configuration differed from the rank-order fold with the switch off");
}

/// The per-communicator setting in Rust: a `Config` with `deterministic` (ranks as threads over
/// in-memory links), grouped all-reduces (merged plans) and a reduce-scatter beside an
/// all-gather give the rank-order fold; `Overrides::deterministic` turns it off again.
#[test]
fn per_communicator_setting_and_groups_in_one_process() {
    use oxccl::Collectives;
    if common::child_role().is_some() {
        return;
    }
    let n = 4;
    let config = oxccl::config::Config { deterministic: true, ..Default::default() };
    let comms = Communicator::in_memory_with_config(n, config);
    let (a, b) = (1000, 4099);
    let want_a = reference(DataType::Float32, n, 0, a, false);
    let want_b = reference(DataType::Float32, n, 0, b, false);
    let want_rs: Vec<Vec<u8>> = (0..n).map(|r| reference(DataType::Float32, n, r * a, a, false)).collect();
    std::thread::scope(|s| {
        for comm in &comms {
            let (want_a, want_b, want_rs) = (&want_a, &want_b, &want_rs);
            s.spawn(move || {
                let rank = comm.rank();
                assert!(comm.deterministic());
                let f32s = |count| -> Vec<f32> { bytemuck_f32(&bytes(DataType::Float32, rank, count)) };
                let (xa, xb, xrs) = (f32s(a), f32s(b), f32s(n * a));
                let (mut ra, mut rb, mut rrs, mut gathered) =
                    (vec![0f32; a], vec![0f32; b], vec![0f32; a], vec![0f32; n]);
                let mine = [rank as f32];
                comm.group(|g| {
                    g.all_reduce(&xa, &mut ra, ReduceOp::Sum)?;
                    g.all_reduce(&xb, &mut rb, ReduceOp::Sum)?;
                    g.reduce_scatter(&xrs, &mut rrs, ReduceOp::Sum)?;
                    g.all_gather(&mine, &mut gathered)
                })
                .expect("group");
                assert!(f32_bytes(&ra) == *want_a && f32_bytes(&rb) == *want_b, "rank {rank}: grouped all-reduce");
                assert!(f32_bytes(&rrs) == want_rs[rank], "rank {rank}: grouped reduce-scatter");
                assert_eq!(gathered, (0..n).map(|r| r as f32).collect::<Vec<_>>());
                comm.set_tuning(Overrides { deterministic: Some(false), ..Default::default() });
                assert!(!comm.deterministic());
            });
        }
    });
}

fn bytemuck_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
