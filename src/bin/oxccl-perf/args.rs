//! Command-line parsing (hand-written, nccl-tests' flag names) and the size sweep.

use crate::colls::{self, Collective};
use oxccl::{Algo, DataType, ReduceOp};
use std::path::PathBuf;
use std::time::Duration;

/// How the size grows between steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Multiply by this.
    Factor(u64),
    /// Add this many bytes.
    Bytes(u64),
}

/// The parsed command line.
pub struct Opts {
    /// The collective to run.
    pub coll: &'static Collective,
    /// First size of the sweep (`-b`).
    pub min_bytes: u64,
    /// Last size, inclusive (`-e`).
    pub max_bytes: u64,
    /// Growth between sizes (`-f` / `-i`).
    pub step: Step,
    /// Timed calls per size (`-n`).
    pub iters: usize,
    /// Warm-up calls per size (`-w`).
    pub warmup: usize,
    /// Verify results (`-c`).
    pub check: bool,
    /// Print a hash of each size's result (`--hash`).
    pub hash: bool,
    /// Data types to run (`-d`).
    pub dtypes: Vec<DataType>,
    /// Reductions to run (`-o`).
    pub ops: Vec<ReduceOp>,
    /// Root rank (`-r`).
    pub root: usize,
    /// Local ranks to start without a launcher (`--ranks`).
    pub ranks: usize,
    /// Whether `--ranks` was given.
    pub ranks_given: bool,
    /// Where rank 0 writes JSON rows (`--json`).
    pub json: Option<PathBuf>,
    /// Wall-clock bound on the ranks started here (`-T`).
    pub timeout: Option<Duration>,
    /// The quick default run (no sweep or iteration flag given).
    pub quick: bool,
    /// Algorithms to compare side by side (`--algo`; `None` is the cost model's choice);
    /// empty: the library's default choice, one row per size.
    pub algos: Vec<Option<Algo>>,
    /// Per entry of `algos`: whether it runs with fixed-order reductions (`det` in `--algo`:
    /// the default choice with `OXCCL_DETERMINISTIC` on for this communicator).
    pub det: Vec<bool>,
    /// Rounds of the side-by-side comparison (`--rounds`).
    pub rounds: usize,
    /// Wire encoding between hosts (`--compress`; `None`: `OXCCL_COMPRESS`).
    pub compress: Option<oxccl::reduce::codec::Encoding>,
    /// Where the buffers live (`--mem host|cuda`).
    pub mem: Mem,
    /// How a size's timed iterations become its time (`--stat mean|median`).
    pub stat: Stat,
    /// Times are this process's CPU time (every thread), not wall-clock time (`-C 1`,
    /// nccl-tests' `--report_cputime`; host memory only).
    pub cputime: bool,
    /// Whether ranks started here are pinned, one CPU each (`--bind`).
    pub bind: Bind,
    /// Where rank 0 writes the run as one JSON object with its metadata (`-J`/`--output_file`).
    pub output_file: Option<PathBuf>,
    /// Host buffers from shareable host memory, as `ncclMemAlloc` allocates them (`-R 1` or
    /// `2`): the host arena (`OXCCL_ARENA`) reads them where they lie.
    pub register: bool,
    /// nccl-tests flags accepted that do not apply to oxccl: one note each, printed by rank 0.
    pub notes: Vec<String>,
}

/// `--bind`: how ranks started by `oxccl-perf` itself are placed on CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// The default, as mpirun's: one CPU per rank when there are no more ranks than allowed
    /// CPUs, no binding otherwise (Open MPI binds to none when oversubscribed).
    Auto,
    /// Always one CPU per rank (the k-th rank on the k-th allowed CPU, modulo their number).
    Cpu,
    /// No binding.
    None,
}

impl Bind {
    /// Whether `ranks` ranks are pinned when the parent may use `cpus` CPUs.
    pub fn pins(self, ranks: usize, cpus: usize) -> bool {
        match self {
            Bind::Auto => ranks <= cpus,
            Bind::Cpu => true,
            Bind::None => false,
        }
    }
}

/// How the timed iterations of one size are summarised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// nccl-tests' way: the slowest rank's total time divided by the iterations.
    Mean,
    /// Each iteration timed on every rank; the median over iterations of the slowest rank's
    /// time, so that a few preempted iterations do not move the figure.
    Median,
}

/// Buffer memory of the benchmark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mem {
    /// Host memory (the default).
    Host,
    /// CUDA device memory of GPU `local_rank % GPUs`; timed with CUDA events.
    Cuda,
}

pub enum Parsed {
    /// `-h`/`--help`.
    Help,
    /// `--version`.
    Version,
    /// Run with these options.
    Run(Box<Opts>),
}

/// Flag values as given, before defaults and validation.
#[derive(Default)]
struct Raw {
    coll: Option<String>,
    min: Option<u64>,
    max: Option<u64>,
    factor: Option<u64>,
    step: Option<u64>,
    iters: Option<usize>,
    warmup: Option<usize>,
    check: Option<usize>,
    hash: Option<usize>,
    register: Option<usize>,
    dtype: Option<String>,
    op: Option<String>,
    root: Option<usize>,
    ranks: Option<usize>,
    json: Option<PathBuf>,
    timeout: Option<u64>,
    mem: Option<Mem>,
    algos: Option<String>,
    rounds: Option<usize>,
    compress: Option<oxccl::reduce::codec::Encoding>,
    stat: Option<Stat>,
    cputime: Option<usize>,
    bind: Option<Bind>,
    output_file: Option<PathBuf>,
    notes: Vec<String>,
}

/// Short flags and their long names (nccl-tests' getopt table, plus `-T`).
const FLAGS: [(char, &str); 24] = [
    ('b', "minbytes"),
    ('e', "maxbytes"),
    ('f', "stepfactor"),
    ('i', "stepbytes"),
    ('n', "iters"),
    ('w', "warmup_iters"),
    ('c', "check"),
    ('d', "datatype"),
    ('o', "op"),
    ('r', "root"),
    ('a', "average"),
    ('t', "nthreads"),
    ('g', "ngpus"),
    ('T', "timeout"),
    ('G', "cudagraph"),
    ('z', "blocking"),
    ('p', "parallel_init"),
    ('m', "agg_iters"),
    ('N', "run_cycles"),
    ('C', "report_cputime"),
    ('R', "local_register"),
    ('M', "memory_report"),
    ('S', "report_timestamps"),
    ('J', "output_file"),
];

/// nccl-tests flags that do not apply to oxccl: (long name, value that changes nothing, why).
/// Any value is accepted; a note is printed when the value is not the harmless one.
const NO_OPS: [(&str, &str, &str); 7] = [
    ("cudagraph", "0", "CUDA graphs do not apply: each call is launched directly"),
    ("blocking", "1", "oxccl's calls complete before returning (blocking)"),
    ("parallel_init", "0", "ranks are processes here; each initialises itself"),
    ("agg_iters", "1", "one call per iteration (no aggregation in a group)"),
    ("run_cycles", "1", "the sweep runs once"),
    ("memory_report", "0", "no memory report"),
    ("report_timestamps", "0", "no timestamps"),
];
const LONG_ONLY: [&str; 9] = ["ranks", "json", "mem", "algo", "rounds", "stat", "bind", "hash", "compress"];

pub fn usage() -> String {
    let names: Vec<&str> = colls::COLLECTIVES.iter().map(|c| c.name).collect();
    let types: Vec<&str> = DataType::ALL.iter().map(|t| t.name()).collect();
    let ops: Vec<&str> = ReduceOp::ALL.iter().map(|o| o.name()).collect();
    format!(
        "Usage: oxccl-perf [COLLECTIVE] [options]\n\
         \n\
         Benchmarks an oxccl collective the way nccl-tests does, and checks its results.\n\
         COLLECTIVE: {} (default all_reduce)\n\
         \n\
         Options:\n\
         \x20 -b, --minbytes SIZE      smallest size in bytes, K/M/G suffixes allowed (default 8)\n\
         \x20 -e, --maxbytes SIZE      largest size (default 32M)\n\
         \x20 -f, --stepfactor N       multiply the size by N each step (default 2; 4 in the quick run)\n\
         \x20 -i, --stepbytes SIZE     add SIZE each step instead (when -f is not given)\n\
         \x20 -n, --iters N            timed calls per size (default 20)\n\
         \x20 -w, --warmup_iters N     warm-up calls per size, repeated until 20 ms passed (default 5)\n\
         \x20 -c, --check 0|1          verify results (default 1)\n\
         \x20     --hash               print a hash of each size's result, out of place and in place\n\
         \x20                          (the same input at every size: see OXCCL_DETERMINISTIC)\n\
         \x20 -R, --local_register 0|1 host buffers from ncclMemAlloc's shareable memory, which the\n\
         \x20                          host arena (OXCCL_ARENA) reads in place (default 0; 2 = 1)\n\
         \x20 -d, --datatype TYPE|all  {} (default float)\n\
         \x20 -o, --op OP|all          {} (default sum)\n\
         \x20 -r, --root N             root rank of rooted collectives (default 0)\n\
         \x20 -a, --average N          accepted for compatibility (time is the max over ranks)\n\
         \x20 -t, --nthreads 1, -g, --ngpus 1   accepted for compatibility (one rank per process)\n\
         \x20 -T, --timeout SECS       kill the ranks started here after SECS seconds (default: none)\n\
         \x20     --ranks N            ranks to start on this host without a launcher (default 2)\n\
         \x20     --json FILE          rank 0 writes the result rows to FILE as JSON\n\
         \x20     --mem host|cuda      buffers in host memory (default) or on the GPU (CUDA events time it)\n\
         \x20     --algo LIST          compare algorithms side by side, e.g. ring,tree,rd,auto: per size,\n\
         \x20                          (det: the default choice with OXCCL_DETERMINISTIC on)\n\
         \x20                          --rounds times each in turn; one row per algorithm (median round)\n\
         \x20     --rounds N           rounds of the comparison (default 3)\n\
         \x20     --compress MODE      off|bf16|fp8|int8: f32 sum/avg all-reduces cross between hosts in\n\
         \x20                          MODE (default: OXCCL_COMPRESS; docs/COMPRESSION.md)\n\
         \x20     --stat mean|median   a size's time: total/iterations of the slowest rank (mean, the\n\
         \x20                          default), or the median over iterations of the slowest rank's\n\
         \x20                          per-iteration time (median; host memory only)\n\
         \x20     --bind auto|cpu|none pin the k-th rank started here to the k-th allowed CPU (modulo\n\
         \x20                          their number): auto (the default, as mpirun) pins when ranks\n\
         \x20                          <= allowed CPUs and binds none when oversubscribed\n\
         \x20 -J, --output_file FILE   rank 0 writes the run as JSON with its metadata (version, hosts,\n\
         \x20                          ranks, environment, iterations, statistic) and every row\n\
         \x20 -C, --report_cputime 0|1  1: a call's time is each rank's process CPU time (every\n\
         \x20                          thread; the max over ranks), not wall time (host memory only)\n\
         \x20 -G -z -p -m -N -M -S N   nccl-tests flags accepted for compatibility; a note says\n\
         \x20                          when a value does not apply to oxccl\n\
         \x20     --version            print the version\n\
         \x20 -h, --help               print this text\n\
         \n\
         Named all_reduce_perf, broadcast_perf, ... (e.g. a symlink), it runs that collective, as\n\
         nccl-tests' binaries do. `oxccl-perf plot FILE.json... -o busbw.png` draws busbw against\n\
         size from --json or -J files (`oxccl-perf plot --help`).\n\
         \n\
         Quick default: with none of -b -e -f -i -n -w, sizes 8B..32M step x4, each size capped at\n\
         128 MiB moved per placement. Under torchrun/mpirun/srun each process is one rank; otherwise\n\
         --ranks copies are started on this host over loopback.\n\
         Exit status: 0 ok, 1 wrong results or an error, 2 bad usage.\n",
        names.join(", "),
        types.join(" "),
        ops.join(" ")
    )
}

/// Splits `--name[=value]`, `-x`, `-xVALUE` into the long name and an inline value.
fn split_flag(arg: &str) -> Result<(&'static str, Option<String>), String> {
    if let Some(long) = arg.strip_prefix("--") {
        let (name, val) = match long.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (long, None),
        };
        let known = FLAGS.iter().map(|f| f.1).chain(LONG_ONLY).find(|k| *k == name);
        return known.map(|k| (k, val)).ok_or_else(|| format!("unknown option '{arg}'"));
    }
    let mut chars = arg.chars().skip(1);
    let c = chars.next().ok_or_else(|| format!("unknown option '{arg}'"))?;
    let rest: String = chars.collect();
    let long = FLAGS.iter().find(|f| f.0 == c).map(|f| f.1).ok_or_else(|| format!("unknown option '{arg}'"))?;
    Ok((long, (!rest.is_empty()).then_some(rest)))
}

fn parse_num(flag: &str, v: &str) -> Result<usize, String> {
    v.trim().parse::<usize>().map_err(|_| format!("--{flag}: '{v}' is not a non-negative integer"))
}

fn parse_bytes(flag: &str, v: &str) -> Result<u64, String> {
    oxccl::config::parse_size(v).ok_or_else(|| format!("--{flag}: '{v}' is not a size (e.g. 8, 64K, 32M, 1G)"))
}

/// Records one flag's value.
fn apply(raw: &mut Raw, key: &str, v: &str) -> Result<(), String> {
    match key {
        "minbytes" => raw.min = Some(parse_bytes(key, v)?),
        "maxbytes" => raw.max = Some(parse_bytes(key, v)?),
        "stepfactor" => raw.factor = Some(parse_num(key, v)? as u64),
        "stepbytes" => raw.step = Some(parse_bytes(key, v)?),
        "iters" => raw.iters = Some(parse_num(key, v)?),
        "warmup_iters" => raw.warmup = Some(parse_num(key, v)?),
        "check" => raw.check = Some(parse_num(key, v)?),
        "compress" => {
            raw.compress = Some(
                oxccl::reduce::codec::Encoding::parse(v)
                    .ok_or_else(|| format!("--compress {v}: not one of off, bf16, fp8, int8"))?,
            )
        }
        "hash" => raw.hash = Some(parse_num(key, v)?),
        "local_register" => raw.register = Some(parse_num(key, v)?),
        "datatype" => raw.dtype = Some(v.to_string()),
        "op" if v.eq_ignore_ascii_case("mulsum") || v.eq_ignore_ascii_case("premulsum") => {
            return Err("-o mulsum (ncclPreMulSum) is not supported by oxccl-perf yet: the library has it \
                        through the C API (ncclRedOpCreatePreMulSum) only"
                .into())
        }
        "op" => raw.op = Some(v.to_string()),
        "root" => raw.root = Some(parse_num(key, v)?),
        "average" => {
            parse_num(key, v)?;
        }
        "nthreads" | "ngpus" => {
            if parse_num(key, v)? != 1 {
                return Err(format!("--{key}: only 1 is supported (one rank per process; use --ranks)"));
            }
        }
        "timeout" => raw.timeout = Some(parse_num(key, v)? as u64),
        "report_cputime" => raw.cputime = Some(parse_num(key, v)?),
        "output_file" => raw.output_file = Some(PathBuf::from(v)),
        k if NO_OPS.iter().any(|n| n.0 == k) => {
            let (flag, harmless, why) = NO_OPS.iter().find(|n| n.0 == k).copied().unwrap_or(("", "", ""));
            let n = parse_num(key, v)?;
            if n.to_string() != harmless {
                let short = FLAGS.iter().find(|f| f.1 == flag).map_or(' ', |f| f.0);
                raw.notes.push(format!("-{short} {n} (--{flag}) does not apply: {why}"));
            }
        }
        "ranks" => raw.ranks = Some(parse_num(key, v)?),
        "json" => raw.json = Some(PathBuf::from(v)),
        "mem" => {
            raw.mem = Some(match v.to_ascii_lowercase().as_str() {
                "host" => Mem::Host,
                "cuda" | "device" | "gpu" => Mem::Cuda,
                _ => return Err(format!("--mem: expected host or cuda, got '{v}'")),
            })
        }
        "algo" => raw.algos = Some(v.to_string()),
        "rounds" => raw.rounds = Some(parse_num(key, v)?),
        "bind" => {
            raw.bind = Some(match v.to_ascii_lowercase().as_str() {
                "cpu" | "core" => Bind::Cpu,
                "none" => Bind::None,
                "auto" => Bind::Auto,
                _ => return Err(format!("--bind: expected auto, cpu or none, got '{v}'")),
            })
        }
        "stat" => {
            raw.stat = Some(match v.to_ascii_lowercase().as_str() {
                "mean" | "avg" => Stat::Mean,
                "median" => Stat::Median,
                _ => return Err(format!("--stat: expected mean or median, got '{v}'")),
            })
        }
        _ => return Err(format!("unknown option '--{key}'")),
    }
    Ok(())
}

pub fn parse_args(args: &[String]) -> Result<Parsed, String> {
    let mut raw = Raw::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            return Ok(Parsed::Help);
        }
        if a == "--version" {
            return Ok(Parsed::Version);
        }
        if a == "--hash" {
            raw.hash = Some(1);
            continue;
        }
        if !a.starts_with('-') || a == "-" {
            if raw.coll.is_some() {
                return Err(format!("unexpected argument '{a}'"));
            }
            raw.coll = Some(a.clone());
            continue;
        }
        let (key, inline) = split_flag(a)?;
        let val = match inline {
            Some(v) => v,
            None => it.next().cloned().ok_or_else(|| format!("option '{a}' needs a value"))?,
        };
        apply(&mut raw, key, &val)?;
    }
    finish(raw).map(|o| Parsed::Run(Box::new(o)))
}

fn parse_list<T: Copy>(
    v: Option<&str>,
    default: T,
    all: &[T],
    parse: fn(&str) -> Option<T>,
    what: &str,
) -> Result<Vec<T>, String> {
    match v {
        None => Ok(vec![default]),
        Some(s) if s.eq_ignore_ascii_case("all") => Ok(all.to_vec()),
        Some(s) => parse(s).map(|t| vec![t]).ok_or_else(|| format!("unknown {what} '{s}'")),
    }
}

/// Applies defaults and checks the values that do not depend on the number of ranks.
fn finish(raw: Raw) -> Result<Opts, String> {
    let name = raw.coll.as_deref().unwrap_or("all_reduce");
    let coll = colls::find(name).ok_or_else(|| format!("unknown collective '{name}'"))?;
    let quick = raw.min.is_none()
        && raw.max.is_none()
        && raw.factor.is_none()
        && raw.step.is_none()
        && raw.iters.is_none()
        && raw.warmup.is_none();
    let min_bytes = raw.min.unwrap_or(8);
    let max_bytes = raw.max.unwrap_or(min_bytes.max(32 << 20));
    if min_bytes > max_bytes {
        return Err(format!("minbytes {min_bytes} is larger than maxbytes {max_bytes}"));
    }
    let step = match (raw.step, raw.factor) {
        (Some(0), None | Some(0 | 1)) => return Err("--stepbytes must be at least 1".into()),
        (Some(b), None | Some(0 | 1)) => Step::Bytes(b),
        (_, Some(f)) if f < 2 => return Err("--stepfactor must be at least 2 (or give --stepbytes)".into()),
        (_, f) => Step::Factor(f.unwrap_or(if quick { 4 } else { 2 })),
    };
    let iters = raw.iters.unwrap_or(20);
    if iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if raw.ranks == Some(0) {
        return Err("--ranks must be at least 1".into());
    }
    let mem = raw.mem.unwrap_or(Mem::Host);
    let algos = raw.algos.as_deref().map(parse_algos).transpose()?.unwrap_or_default();
    let stat = raw.stat.unwrap_or(Stat::Mean);
    if stat == Stat::Median && mem == Mem::Cuda {
        return Err("--stat median needs --mem host (device calls are timed as a whole with CUDA events)".into());
    }
    let cputime = raw.cputime.is_some_and(|c| c > 0);
    if cputime && mem == Mem::Cuda {
        return Err("-C 1 (CPU time) needs --mem host (device calls are timed with CUDA events)".into());
    }
    Ok(Opts {
        coll,
        min_bytes,
        max_bytes,
        step,
        iters,
        warmup: raw.warmup.unwrap_or(5),
        compress: raw.compress,
        check: raw.check.is_none_or(|c| c > 0),
        hash: raw.hash.is_some_and(|h| h > 0),
        register: raw.register.is_some_and(|r| r > 0),
        dtypes: parse_list(raw.dtype.as_deref(), DataType::Float32, &DataType::ALL, DataType::parse, "data type")?,
        ops: parse_list(raw.op.as_deref(), ReduceOp::Sum, &ReduceOp::ALL, ReduceOp::parse, "reduction op")?,
        root: raw.root.unwrap_or(0),
        ranks: raw.ranks.unwrap_or(2),
        ranks_given: raw.ranks.is_some(),
        json: raw.json,
        timeout: raw.timeout.filter(|&t| t > 0).map(Duration::from_secs),
        quick,
        mem,
        stat,
        cputime,
        bind: raw.bind.unwrap_or(Bind::Auto),
        output_file: raw.output_file,
        notes: raw.notes,
        algos: algos.iter().map(|a| a.0).collect(),
        det: algos.iter().map(|a| a.1).collect(),
        rounds: raw.rounds.unwrap_or(3).max(1),
    })
}

/// Parses `--algo ring,tree,auto` (`auto`: the cost model's choice).
/// `--algo`'s entries: (algorithm, whether fixed-order reductions are on).
fn parse_algos(v: &str) -> Result<Vec<(Option<Algo>, bool)>, String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            "auto" => Ok((None, false)),
            "det" => Ok((None, true)),
            _ => Algo::parse(s)
                .map(|a| (Some(a), false))
                .ok_or_else(|| format!("--algo: unknown algorithm '{s}' (ring, tree, rd, direct, auto, det)")),
        })
        .collect()
}

/// The sizes of the sweep, in bytes.
pub fn sizes(o: &Opts) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = o.min_bytes;
    while s <= o.max_bytes {
        v.push(s);
        let next = match o.step {
            Step::Factor(f) => {
                if s == 0 {
                    Some(1)
                } else {
                    s.checked_mul(f)
                }
            }
            Step::Bytes(b) => s.checked_add(b),
        };
        match next {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Opts, String> {
        let args: Vec<String> = s.split_whitespace().map(String::from).collect();
        match parse_args(&args)? {
            Parsed::Run(o) => Ok(*o),
            Parsed::Help | Parsed::Version => Err("help".into()),
        }
    }

    #[test]
    fn defaults_and_quick_run() {
        let o = parse("").unwrap();
        assert_eq!(o.coll.name, "all_reduce");
        assert!(o.quick && o.check);
        assert_eq!((o.min_bytes, o.max_bytes, o.step), (8, 32 << 20, Step::Factor(4)));
        assert_eq!(sizes(&o).len(), 12); // 8 B, 32 B, ..., 32 MiB
        let o = parse("all_reduce -b 8 -e 64M -f 4 --ranks 4 -d float -o sum").unwrap();
        assert!(!o.quick);
        assert_eq!(
            (o.max_bytes, o.ranks, o.dtypes.clone(), o.ops.clone()),
            (64 << 20, 4, vec![DataType::Float32], vec![ReduceOp::Sum])
        );
    }

    #[test]
    fn nccl_tests_flags_accepted_with_notes() {
        let o = parse("-G 0 -z 1 -p 0 -m 1 -N 1 -C 0 -R 0 -M 0 -S 0 -J /tmp/run.json").unwrap();
        assert!(o.notes.is_empty(), "{:?}", o.notes);
        assert_eq!(o.output_file, Some(PathBuf::from("/tmp/run.json")));
        assert!(!parse("-R 0").unwrap().register);
        assert!(!o.cputime && parse("-C 1").unwrap().cputime && parse("--report_cputime=1").unwrap().cputime);
        assert!(parse("-C 1 --mem cuda").is_err(), "CPU time is for host buffers");
        let o = parse("-G 10 --blocking=0 -R1").unwrap();
        assert_eq!(o.notes.len(), 2, "{:?}", o.notes);
        assert!(o.register, "-R 1 asks for shareable buffers");
        assert!(o.notes[0].starts_with("-G 10 (--cudagraph) does not apply"), "{:?}", o.notes);
        assert!(parse("-G x").is_err());
        let e = parse("-o mulsum").err().unwrap();
        assert!(e.contains("ncclPreMulSum"), "{e}");
        assert!(matches!(parse_args(&["--version".into()]), Ok(Parsed::Version)));
    }

    #[test]
    fn flag_spellings() {
        let o = parse("--minbytes=1K --maxbytes 64K -n2 -w 1 -d all -o all --json /tmp/x -c 0 -i 1K").unwrap();
        assert_eq!((o.min_bytes, o.max_bytes, o.iters, o.warmup), (1024, 65536, 2, 1));
        assert_eq!((o.dtypes.len(), o.ops.len(), o.check, o.step), (12, 5, false, Step::Bytes(1024)));
        assert_eq!(sizes(&o).len(), 64);
        let o = parse("--compress int8").unwrap();
        assert_eq!(o.compress, Some(oxccl::reduce::codec::Encoding::Int8));
        assert!(parse("--compress zip").is_err());
        let o = parse("--algo ring,tree,auto,det --rounds 5").unwrap();
        assert_eq!((o.algos, o.rounds), (vec![Some(Algo::Ring), Some(Algo::Tree), None, None], 5));
        assert_eq!(o.det, [false, false, false, true]);
        assert!(matches!(parse_args(&["-h".into()]), Ok(Parsed::Help)));
    }

    #[test]
    fn bad_input_is_rejected() {
        for bad in [
            "--bogus",
            "--algo ring,foo",
            "-x 1",
            "-b",
            "-b 1X",
            "-d quad",
            "-o xor",
            "-b 2K -e 1K",
            "-f 1",
            "foo",
            "all_reduce extra",
            "-n 0",
            "--ranks 0",
            "-g 2",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("all_gather").is_ok());
        assert!(parse("--mem tpu").is_err());
        assert_eq!(parse("--mem cuda").unwrap().mem, Mem::Cuda);
        assert_eq!(parse("").unwrap().mem, Mem::Host);
        assert_eq!(parse("").unwrap().stat, Stat::Mean);
        assert_eq!(parse("--stat median").unwrap().stat, Stat::Median);
        assert_eq!(parse("--stat=mean").unwrap().stat, Stat::Mean);
        assert!(parse("--stat p50").is_err());
        assert!(parse("--stat median --mem cuda").is_err());
        assert_eq!(parse("").unwrap().bind, Bind::Auto);
        assert_eq!(parse("--bind cpu").unwrap().bind, Bind::Cpu);
        assert_eq!(parse("--bind=none").unwrap().bind, Bind::None);
        assert_eq!(parse("--bind auto").unwrap().bind, Bind::Auto);
        // As mpirun: pinned with a CPU per rank, unbound when oversubscribed, unless forced.
        assert!(Bind::Auto.pins(2, 2) && !Bind::Auto.pins(4, 2));
        assert!(Bind::Cpu.pins(4, 2) && !Bind::None.pins(1, 2));
        assert!(parse("--bind socket").is_err());
    }
}
