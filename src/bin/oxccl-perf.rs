//! `oxccl-perf`: nccl-tests' `*_perf` benchmarks for oxccl, in one binary.
//!
//! ```text
//! oxccl-perf [COLLECTIVE] [-b MIN] [-e MAX] [-f FACTOR | -i STEP] [-n ITERS] [-w WARMUP]
//!            [-c 0|1] [-d TYPE|all] [-o OP|all] [-r ROOT] [--ranks N] [--json FILE] [-T SECS]
//! ```
//!
//! `COLLECTIVE` is one of all_reduce (default), all_gather, reduce_scatter, broadcast, reduce,
//! alltoall, sendrecv, gather, scatter (see `colls.rs`). Flags keep nccl-tests' names and
//! meanings; `oxccl-perf -h` lists them. `OXCCL_ALGO` / `OXCCL_CHUNK_SIZE` force the
//! algorithm and chunk size as for any oxccl program.
//!
//! **Processes.** Under a launcher (torchrun, mpirun, srun, or `OXCCL_RANK`/`OXCCL_NRANKS`)
//! every process is one rank and joins with `Communicator::from_env()`. Started by hand, the
//! process is a parent: it creates a `UniqueId`, starts `--ranks` copies of itself with
//! `OXCCL_UNIQUE_ID`, `OXCCL_RANK`, `OXCCL_NRANKS`, `OXCCL_LOCAL_RANK` (and
//! `OXCCL_SOCKET_IFNAME=lo` unless an interface is set), waits for them, and exits with the first
//! non-zero status; when one rank fails the others get a few seconds, then are killed.
//!
//! **Measurement** (per size, out-of-place then in-place): `-w` warm-up calls, `-n` timed calls
//! back to back, time = elapsed / n on each rank, reported time = max over ranks (nccl-tests
//! averages; the max is the conservative choice). algbw = bytes / time (1 GB = 1e9 B), bytes
//! being the larger of one rank's send and receive buffer; busbw = algbw × the collective's
//! factor (nccl-tests': all_reduce 2(n-1)/n; all_gather, reduce_scatter, alltoall, gather,
//! scatter (n-1)/n; broadcast, reduce, sendrecv 1). With `-c 1` a separate, untimed call on fresh data is checked
//! element by element against a reference every rank computes itself (see `data.rs`); `#wrong`
//! is the count of bad elements summed over ranks.
//!
//! **Quick default.** With none of `-b -e -f -i -n -w` given, sizes go from 8 B to 32 MiB by ×4
//! and each placement of each size moves at most 128 MiB (iterations scaled down, warm-ups to a
//! quarter of that), so a bare `oxccl-perf` finishes in seconds. Any of those flags gives
//! nccl-tests' fixed counts.
//!
//! **Exit status**: 0 all good, 1 wrong results or a library/system error, 2 bad usage.

#[path = "oxccl-perf/args.rs"]
mod args;
#[path = "oxccl-perf/buf.rs"]
mod buf;
#[path = "oxccl-perf/colls.rs"]
mod colls;
#[path = "oxccl-perf/cuda.rs"]
mod cuda;
#[path = "oxccl-perf/data.rs"]
mod data;
#[path = "oxccl-perf/parent.rs"]
mod parent;
#[path = "oxccl-perf/plot.rs"]
mod plot;
#[path = "oxccl-perf/report.rs"]
mod report;

use args::{parse_args, sizes, usage, Mem, Opts, Parsed, Stat, Step};
use buf::AlignedBuf;
use colls::{Call, Counts, Kind};
use data::Case;
use oxccl::bootstrap::env::Launch;
use oxccl::{AlgoSet, Communicator, DataType, Overrides, ReduceOp};
use parent::{binding_note, own_cpus, parent_main};
use report::{Half, Row};
use std::path::Path;

use std::sync::Arc;
use std::time::{Duration, Instant};

/// Least warm-up time per size, in seconds (see `Bench::warm_up`).
const WARM_MIN: f64 = 0.02;
/// Bytes each placement of each size may move in the quick default run.
const QUICK_BYTES: usize = 128 << 20;
/// How long the other ranks may take to exit after one failed, before they are killed.
const GRACE: Duration = Duration::from_secs(5);

fn main() {
    // Like nccl-tests and other C tools, end quietly when the reader of stdout goes away
    // (`oxccl-perf ... | head`) instead of panicking on a failed print. The library's own
    // sockets write with MSG_NOSIGNAL, so a dead peer still shows up as an error.
    // SAFETY: restores a signal's default disposition before any other thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let mut args: Vec<String> = match std::env::args_os().skip(1).map(|a| a.into_string()).collect() {
        Ok(a) => a,
        Err(bad) => usage_error(&format!("argument {bad:?} is not valid UTF-8")),
    };
    if args.first().map(String::as_str) == Some("plot") {
        std::process::exit(plot::main(&args[1..]));
    }
    // Called as all_reduce_perf, broadcast_perf, ...: that collective, as nccl-tests' binaries.
    let program =
        std::env::args_os().next().map(|p| Path::new(&p).file_name().map(|f| f.to_string_lossy().into_owned()));
    if let Some(coll) = program.flatten().as_deref().and_then(|p| p.strip_suffix("_perf")) {
        if colls::find(coll).is_none() {
            usage_error(&format!("program name '{coll}_perf' names no collective this tool runs"));
        }
        match args.iter().find(|a| colls::find(a).is_some()) {
            Some(given) if colls::find(given).map(|c| c.name) != colls::find(coll).map(|c| c.name) => {
                usage_error(&format!("'{given}' given, but the program name says {coll}"));
            }
            Some(_) => {}
            None => args.insert(0, coll.to_string()),
        }
    }
    let opts = match parse_args(&args) {
        Ok(Parsed::Help) => {
            print!("{}", usage());
            std::process::exit(0);
        }
        Ok(Parsed::Version) => {
            println!(
                "oxccl-perf {} (oxccl {}, NCCL API {}.{}.{})",
                env!("CARGO_PKG_VERSION"),
                env!("CARGO_PKG_VERSION"),
                oxccl::NCCL_MAJOR,
                oxccl::NCCL_MINOR,
                oxccl::NCCL_PATCH
            );
            std::process::exit(0);
        }
        Ok(Parsed::Run(o)) => *o,
        Err(msg) => usage_error(&msg),
    };
    if opts.mem == Mem::Cuda && !oxccl::device::available() {
        eprintln!("oxccl-perf: no CUDA device: --mem cuda needs a GPU");
        std::process::exit(2);
    }
    let code = match oxccl::bootstrap::env::detect() {
        Ok(Some(launch)) => rank_main(&opts, &launch),
        Ok(None) => parent_main(&opts, &args),
        Err(e) => {
            eprintln!("oxccl-perf: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn usage_error(msg: &str) -> ! {
    eprintln!("oxccl-perf: {msg}\n");
    eprint!("{}", usage());
    std::process::exit(2);
}

// ---------------------------------------------------------------------------------------------
// A rank: join, run the sweep, report.
// ---------------------------------------------------------------------------------------------

fn rank_fail(rank: usize, msg: &str) -> i32 {
    // Library errors often name the rank already; don't say it twice.
    let prefix = format!("rank {rank}: ");
    eprintln!("oxccl-perf: {prefix}{}", msg.strip_prefix(&prefix).unwrap_or(msg));
    1
}

fn rank_main(opts: &Opts, launch: &Launch) -> i32 {
    let comm = match Communicator::from_env() {
        Ok(c) => Arc::new(c),
        Err(e) => return rank_fail(launch.rank, &e.to_string()),
    };
    let (rank, n) = (comm.rank(), comm.size());
    if opts.coll.has_root && opts.root >= n {
        if rank == 0 {
            eprintln!("oxccl-perf: --root {} is not below the number of ranks {n}", opts.root);
        }
        return 2;
    }
    let code = match Bench::new(opts, &comm, launch.local_rank).and_then(|mut b| b.run_all(launch)) {
        Ok(code) => code,
        Err(msg) => rank_fail(rank, &msg),
    };
    drop(comm);
    code
}

/// One rank's benchmark state.
struct Bench<'a> {
    opts: &'a Opts,
    comm: &'a Arc<Communicator>,
    rank: usize,
    nranks: usize,
    send: AlignedBuf,
    recv: AlignedBuf,
    rows: Vec<Row>,
    /// Seed of the next correctness check.
    rep: u64,
    /// Device copies of `send`/`recv` with `--mem cuda`.
    dev: Option<cuda::DevBufs>,
    /// Where the wall clock of [`Bench::clock`] starts.
    started: Instant,
}

/// The hostname, for the device list.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Every rank's (pid, hostname), gathered with a sum all-reduce of disjoint byte slots.
fn gather_hosts(comm: &Communicator) -> Result<Vec<(u64, String)>, String> {
    const SLOT: usize = 64;
    let (rank, n) = (comm.rank(), comm.size());
    let mut mine = vec![0u8; n * SLOT];
    let slot = &mut mine[rank * SLOT..(rank + 1) * SLOT];
    slot[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    let host = hostname();
    let len = host.len().min(SLOT - 8);
    slot[8..8 + len].copy_from_slice(&host.as_bytes()[..len]);
    let mut all = vec![0u8; n * SLOT];
    comm.all_reduce(&mine, &mut all, ReduceOp::Sum).map_err(|e| format!("exchanging host names: {e}"))?;
    let info = all.chunks(SLOT).map(|s| {
        let mut pid = [0u8; 8];
        pid.copy_from_slice(&s[..8]);
        let host = String::from_utf8_lossy(&s[8..]).trim_end_matches('\0').to_string();
        (u64::from_le_bytes(pid), host)
    });
    Ok(info.collect())
}

impl<'a> Bench<'a> {
    fn new(opts: &'a Opts, comm: &'a Arc<Communicator>, local_rank: usize) -> Result<Bench<'a>, String> {
        let n = comm.size();
        if let Some(enc) = opts.compress {
            comm.set_compression(enc);
        }
        // Sized for the largest step with 1-byte elements, which bounds every type.
        let max = usize::try_from(opts.max_bytes).map_err(|_| "--maxbytes does not fit in memory".to_string())?;
        let k = (opts.coll.counts)(max, n);
        let recv = k.recv.max(k.send_ip_off * (n - 1) + k.send).max(k.recv_ip_off * (n - 1) + k.recv);
        let dev = match opts.mem {
            Mem::Cuda => Some(cuda::DevBufs::new(local_rank, k.send, recv)?),
            Mem::Host => None,
        };
        Ok(Bench {
            opts,
            comm,
            rank: comm.rank(),
            nranks: n,
            send: AlignedBuf::new(k.send, opts.register)?,
            recv: AlignedBuf::new(recv, opts.register)?,
            rows: Vec::new(),
            rep: 0,
            dev,
            started: Instant::now(),
        })
    }

    fn print_preamble(&self, launch: &Launch, hosts: &[(u64, String)]) {
        let o = self.opts;
        let (step, kind) = match o.step {
            Step::Factor(f) => (f, "factor"),
            Step::Bytes(b) => (b, "bytes"),
        };
        println!(
            "# oxccl {} (NCCL API {}), ranks started by {}",
            oxccl::OXCCL_VERSION,
            oxccl::NCCL_VERSION_CODE,
            launch.launcher
        );
        println!(
            "# oxccl-perf {}: nranks {}, minBytes {}, maxBytes {}, step: {step}({kind}), warmup iters: {} (and at least {} ms per size), iters: {}, check: {}",
            o.coll.name,
            self.nranks,
            o.min_bytes,
            o.max_bytes,
            o.warmup,
            (WARM_MIN * 1e3) as u32,
            o.iters,
            u8::from(o.check)
        );
        let enc = self.comm.compression();
        if enc.lossy() {
            let hosts = self.comm.hosts().iter().collect::<std::collections::BTreeSet<_>>().len();
            println!(
                "# compress: {} between hosts ({hosts} host(s){}): f32 sum/avg all-reduces, reduce-scatters and reduces, {} bytes per element on the wire; checks accept docs/COMPRESSION.md's bound",
                enc.name(),
                if hosts == 1 { ", so nothing is compressed" } else { "" },
                enc.size(1 << 20) as f64 / f64::from(1 << 20)
            );
        }
        if o.cputime {
            println!("# time: CPU time of each rank's process (every thread), not wall time (-C 1)");
        }
        if o.stat == Stat::Median {
            println!("# time: median over iterations of the slowest rank's per-iteration time (--stat median)");
        }
        println!(
            "# binding: {} (--bind {}; rank 0 may run on {} CPU(s))",
            binding_note(o),
            format!("{:?}", o.bind).to_lowercase(),
            own_cpus()
        );
        if o.register && o.mem == Mem::Host {
            println!("# buffers: shareable host memory, as ncclMemAlloc returns it (-R 1): on one host the other ranks read them where they lie");
        }
        if o.quick {
            println!("# quick default run: each size moves at most {} MiB per placement (iterations scaled down); give -n/-w/-b/-e for fixed counts", QUICK_BYTES >> 20);
        }
        for note in &o.notes {
            println!("# note: {note}");
        }
        if o.ranks_given && launch.launcher != "oxccl" && o.ranks != self.nranks {
            println!("# note: --ranks {} ignored, {} set {} ranks", o.ranks, launch.launcher, self.nranks);
        }
        println!("#\n# Using devices");
        let mem = match &self.dev {
            Some(d) => format!("device memory (CUDA GPU {} of the rank's host)", d.ordinal),
            None => "host memory".into(),
        };
        for (r, (pid, host)) in hosts.iter().enumerate() {
            println!("#  Rank {r:2} Pid {pid:6} on {host:>10} {mem}");
        }
        print!("{}", report::table_header(!o.algos.is_empty()));
    }

    fn run_all(&mut self, launch: &Launch) -> Result<i32, String> {
        let hosts = gather_hosts(self.comm)?;
        if self.rank == 0 {
            self.print_preamble(launch, &hosts);
        }
        let ops: Vec<Option<ReduceOp>> =
            if self.opts.coll.has_op { self.opts.ops.iter().map(|&o| Some(o)).collect() } else { vec![None] };
        for &dt in &self.opts.dtypes {
            for &op in &ops {
                for size in sizes(self.opts) {
                    for row in self.bench_rows(dt, op, size as usize)? {
                        if self.rank == 0 {
                            println!("{}", report::row_line(&row));
                            if let Some(h) = report::hash_line(&row) {
                                println!("{h}");
                            }
                        }
                        self.rows.push(row);
                    }
                }
            }
        }
        let halves = || self.rows.iter().flat_map(|r| [r.oop, r.ip]);
        let wrong: u64 = halves().filter_map(|h| h.wrong).sum();
        let count = halves().count().max(1);
        let avg_bw = halves().map(|h| h.busbw).sum::<f64>() / count as f64;
        if self.rank == 0 {
            print!("{}", report::footer(wrong, avg_bw, &format!("oxccl-perf {}", self.opts.coll.name)));
            if let Some(path) = &self.opts.json {
                std::fs::write(path, report::json(&self.rows))
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                println!("# JSON results written to {}", path.display());
            }
            if let Some(path) = &self.opts.output_file {
                let meta = report::Meta {
                    program: format!("oxccl-perf {}", self.opts.coll.name),
                    version: env!("CARGO_PKG_VERSION"),
                    hosts: &hosts,
                    iters: self.opts.iters,
                    warmup: self.opts.warmup,
                    stat: match self.opts.stat {
                        Stat::Mean => "mean",
                        Stat::Median => "median",
                    },
                    quick: self.opts.quick,
                    mem: if self.dev.is_some() { "cuda" } else { "host" },
                };
                std::fs::write(path, report::json_run(&meta, &self.rows))
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                println!("# JSON run written to {}", path.display());
            }
        }
        Ok(if wrong > 0 { 1 } else { 0 })
    }

    /// The rows of one size: one, or with `--algo` one per algorithm, measured in
    /// `--rounds` interleaved rounds (each algorithm in turn), each row the median round.
    fn bench_rows(&mut self, dt: DataType, op: Option<ReduceOp>, size: usize) -> Result<Vec<Row>, String> {
        let counts = (self.opts.coll.counts)(size / dt.size(), self.nranks);
        if self.opts.algos.is_empty() {
            let oop = self.bench_half(dt, op, &counts, false)?;
            let ip = self.bench_half(dt, op, &counts, true)?;
            return Ok(vec![self.row(dt, op, &counts, oop, ip, None)]);
        }
        let algos = self.opts.algos.clone();
        let mut runs: Vec<Vec<(Half, Half)>> = vec![Vec::new(); algos.len()];
        for _ in 0..self.opts.rounds {
            for (i, a) in algos.iter().enumerate() {
                // "auto" is what a program gets with nothing forced (all-reduce's one-shot and
                // hierarchical paths included), so it leaves the algorithms unset; "det" is
                // that with fixed-order reductions.
                self.comm.set_tuning(Overrides {
                    algos: a.map(AlgoSet::only),
                    chunk: oxccl::config::process().chunk,
                    deterministic: self.opts.det[i].then_some(true),
                    compress: self.opts.compress,
                });
                let oop = self.bench_half(dt, op, &counts, false)?;
                runs[i].push((oop, self.bench_half(dt, op, &counts, true)?));
            }
        }
        self.comm.set_tuning(Overrides::default());
        let mut rows = Vec::new();
        for (i, (a, mut r)) in algos.iter().zip(runs).enumerate() {
            r.sort_by(|x, y| (x.0.time_us + x.1.time_us).total_cmp(&(y.0.time_us + y.1.time_us)));
            let (oop, ip) = r[r.len() / 2];
            let label = match (a, self.opts.coll.kind) {
                _ if self.opts.det[i] => "det".to_string(),
                (Some(a), _) => a.name().to_string(),
                (None, Kind::Coll(make)) => {
                    let route = self.comm.route(make(self.opts.root), counts.param, dt, op.unwrap_or(ReduceOp::Sum));
                    format!("auto:{}", route.name())
                }
                (None, Kind::SendRecv) => "auto".to_string(),
            };
            rows.push(self.row(dt, op, &counts, oop, ip, Some(label)));
        }
        Ok(rows)
    }

    fn row(
        &self,
        dt: DataType,
        op: Option<ReduceOp>,
        counts: &Counts,
        oop: Half,
        ip: Half,
        algo: Option<String>,
    ) -> Row {
        let coll = self.opts.coll;
        Row {
            collective: coll.name,
            size: counts.send.max(counts.recv) * dt.size(),
            count: counts.param,
            dtype: dt.name(),
            redop: op.map_or("none", |o| o.name()),
            root: if coll.has_root { self.opts.root as i64 } else { -1 },
            nranks: self.nranks,
            oop,
            ip,
            algo,
        }
    }

    /// (warm-up, timed) call counts for a step moving `bytes` (see "Quick default").
    fn iterations(&self, bytes: usize) -> (usize, usize) {
        let o = self.opts;
        if !o.quick {
            return (o.warmup, o.iters);
        }
        let budget = QUICK_BYTES / bytes.max(1);
        (o.warmup.min((budget / 4).max(1)), o.iters.min(budget.max(1)))
    }

    fn bench_half(
        &mut self,
        dt: DataType,
        op: Option<ReduceOp>,
        counts: &Counts,
        in_place: bool,
    ) -> Result<Half, String> {
        let bytes = counts.send.max(counts.recv) * dt.size();
        let (warm, iters) = self.iterations(bytes);
        let call = self.call(dt, op, counts, in_place);
        self.fill_input(&Case::new(dt, op, self.nranks, 0), counts, in_place)?;
        self.warm_up(&call, warm)?;
        let secs = match (&self.dev, self.opts.stat) {
            (Some(d), _) => {
                let elapsed = d.time(|| (0..iters).try_for_each(|_| self.run(&call)))?;
                self.max_over_ranks(elapsed / iters as f64)?
            }
            (None, Stat::Mean) => {
                let t0 = self.clock();
                for _ in 0..iters {
                    self.run(&call)?;
                }
                self.max_over_ranks((self.clock() - t0) / iters as f64)?
            }
            (None, Stat::Median) => {
                let mut times = Vec::with_capacity(iters);
                for _ in 0..iters {
                    let t = self.clock();
                    self.run(&call)?;
                    times.push(self.clock() - t);
                }
                self.median_of_slowest(&times)?
            }
        };
        let wrong = if self.opts.check { Some(self.check(dt, op, counts, in_place, &call)?) } else { None };
        let algbw = if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 };
        let hash = if self.opts.hash { Some(self.hash(dt, op, counts, in_place, &call)?) } else { None };
        let busbw = algbw * (self.opts.coll.bus_factor)(self.nranks);
        Ok(Half { time_us: secs * 1e6, algbw, busbw, wrong, hash })
    }

    /// The call's buffers: out of place `send`/`recv`; in place both inside `recv` at the
    /// collective's per-rank offsets. All offsets stay inside the buffers sized in `new`.
    fn call(&self, dt: DataType, op: Option<ReduceOp>, k: &Counts, in_place: bool) -> Call {
        let ts = dt.size();
        // Device buffers mirror the host ones: same offsets from the device bases.
        let (send_base, base) = match &self.dev {
            Some(d) => (d.send as *mut u8, d.recv as *mut u8),
            None => (self.send.ptr(), self.recv.ptr()),
        };
        let (send, recv) = if in_place {
            (
                base.wrapping_add(k.send_ip_off * self.rank * ts) as *const u8,
                base.wrapping_add(k.recv_ip_off * self.rank * ts),
            )
        } else {
            (send_base as *const u8, base)
        };
        Call { send, recv, count: k.param, dtype: dt, op: op.unwrap_or(ReduceOp::Sum), root: self.opts.root }
    }

    fn run(&self, call: &Call) -> Result<(), String> {
        if let Some(d) = &self.dev {
            // SAFETY: `call` points into the device buffers, sized in `new` like the host ones.
            return unsafe { d.run(self.comm, self.opts.coll.kind, call) }.map_err(|e| e.to_string());
        }
        // SAFETY: `call` points into `self.send`/`self.recv`, sized in `new` for the largest
        // step of this collective, and no Rust reference to them is live during the call.
        unsafe { self.opts.coll.run(self.comm, call) }.map_err(|e| e.to_string())
    }

    /// Writes this rank's input where the collective reads it (send buffer, or in place), and
    /// copies both buffers to the GPU with `--mem cuda`.
    fn fill_input(&mut self, case: &Case, k: &Counts, in_place: bool) -> Result<(), String> {
        let rank = self.rank;
        self.fill_with(case.dtype, k, in_place, |j| case.input(rank, j))
    }

    /// [`Bench::fill_input`] with the values `value(index)`.
    fn fill_with(
        &mut self,
        dt: DataType,
        k: &Counts,
        in_place: bool,
        value: impl Fn(usize) -> f64,
    ) -> Result<(), String> {
        let ts = dt.size();
        let (buf, off) = if in_place {
            (self.recv.as_mut_slice(), k.send_ip_off * self.rank * ts)
        } else {
            (self.send.as_mut_slice(), 0)
        };
        let dst = &mut buf[off..off + k.send * ts];
        for j in 0..k.send {
            data::write_elem(dt, dst, j, value(j));
        }
        match &self.dev {
            Some(d) => d.upload(self.send.as_slice(), self.recv.as_slice()),
            None => Ok(()),
        }
    }

    /// Fills the part of the receive buffer a call of `k` may write (in place: with the input
    /// slot inside it) with 0xA5, so that unwritten output shows up; returns the offset, in
    /// elements of `ts` bytes, of this rank's output in it.
    fn poison_output(&mut self, k: &Counts, in_place: bool, ts: usize) -> usize {
        let rank = self.rank;
        let recv_off = if in_place { k.recv_ip_off * rank } else { 0 };
        let end = if in_place { (k.send_ip_off * rank + k.send).max(recv_off + k.recv) } else { k.recv };
        self.recv.as_mut_slice()[..end * ts].fill(0xA5);
        recv_off
    }

    /// One untimed call on fresh data; returns the wrong elements summed over ranks.
    fn check(
        &mut self,
        dt: DataType,
        op: Option<ReduceOp>,
        k: &Counts,
        in_place: bool,
        call: &Call,
    ) -> Result<u64, String> {
        self.rep += 1;
        let case = Case::new(dt, op, self.nranks, self.rep);
        let case = match self.comm.compression() {
            // docs/COMPRESSION.md: rel * sum of |x| + abs * block maximum (inputs here are at
            // most `amp` in magnitude, so the block maximum of the sum is at most n * amp).
            e if dt == DataType::Float32 && e.lossy() => {
                let (rel, abs) = match e {
                    oxccl::reduce::codec::Encoding::Bf16 => (2f64.powi(-7) + 2f64.powi(-14), 0.0),
                    oxccl::reduce::codec::Encoding::Fp8 => (2f64.powi(-3) + 2f64.powi(-7), 2f64.powi(-16)),
                    _ => (0.0, 1.01 / 126.0),
                };
                case.with_wire(rel, abs)
            }
            _ => case,
        };
        let ts = dt.size();
        let (rank, root) = (self.rank, self.opts.root);
        let recv_off = self.poison_output(k, in_place, ts);
        self.fill_input(&case, k, in_place)?;
        self.run(call)?;
        if let Some(d) = &self.dev {
            d.download(self.recv.as_mut_slice())?;
        }
        let out = &self.recv.as_slice()[recv_off * ts..(recv_off + k.recv) * ts];
        let expected = self.opts.coll.expected;
        let wrong = (0..k.recv)
            .filter(|&i| expected(&case, k, rank, root, i).is_some_and(|e| !e.accepts(data::read_elem(dt, out, i))))
            .count();
        self.sum_over_ranks(wrong as u64)
    }

    /// `--hash`: one untimed call on the timed input (every size and placement gets the same
    /// values at the same index); the FNV-1a hash of each rank's result, summed over ranks with
    /// each rank's hash rotated by its rank.
    fn hash(
        &mut self,
        dt: DataType,
        op: Option<ReduceOp>,
        k: &Counts,
        in_place: bool,
        call: &Call,
    ) -> Result<u64, String> {
        let ts = dt.size();
        let rank = self.rank;
        let recv_off = self.poison_output(k, in_place, ts);
        // Float sums get values over many magnitudes (whose sum depends on the order of the
        // operands); everything else the checked input.
        let case = Case::new(dt, op, self.nranks, 0);
        let spread = dt.is_float() && matches!(op, Some(ReduceOp::Sum | ReduceOp::Avg));
        let span = match dt {
            DataType::Float32 | DataType::Float64 | DataType::Bfloat16 => 40,
            DataType::Float16 => 12,
            _ => 4,
        };
        self.fill_with(dt, k, in_place, |j| {
            let x = case.input(rank, j);
            if !spread {
                return x;
            }
            let h = (j as u64 ^ (rank as u64).wrapping_mul(0x9e37_79b9)).wrapping_mul(0xff51_afd7_ed55_8ccd) >> 40;
            x * (1.0 + (h % 1000) as f64 / 1000.0) * 2f64.powi((h % span) as i32 - span as i32 / 2)
        })?;
        self.run(call)?;
        if let Some(d) = &self.dev {
            d.download(self.recv.as_mut_slice())?;
        }
        let out = &self.recv.as_slice()[recv_off * ts..(recv_off + k.recv) * ts];
        let h = out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        self.sum_over_ranks(h.rotate_left(rank as u32))
    }

    /// The median over iterations of the slowest rank's time of each iteration (`--stat median`).
    fn median_of_slowest(&self, times: &[f64]) -> Result<f64, String> {
        let mut slowest = vec![0f64; times.len()];
        self.comm.all_reduce(times, &mut slowest, ReduceOp::Max).map_err(|e| format!("reducing timings: {e}"))?;
        slowest.sort_by(f64::total_cmp);
        let m = slowest.len() / 2;
        Ok(if slowest.len() % 2 == 1 { slowest[m] } else { (slowest[m - 1] + slowest[m]) / 2.0 })
    }

    /// Runs `warm` warm-up calls, then more in batches of `warm` until every rank has warmed
    /// up for [`WARM_MIN`] (all ranks agree on when to stop: the least time over ranks decides).
    /// Tiny calls would otherwise be timed within milliseconds of the ranks' start, while the
    /// scheduler still separates unbound ranks that began on one CPU (docs/perf-log/2026-11.md,
    /// \[P\] round 3). `-w 0` and `--quick` warm up by count only.
    fn warm_up(&mut self, call: &Call, warm: usize) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            for _ in 0..warm {
                self.run(call)?;
            }
            if warm == 0 || self.opts.quick || -self.max_over_ranks(-t0.elapsed().as_secs_f64())? >= WARM_MIN {
                return Ok(());
            }
        }
    }

    /// Seconds on the clock calls are timed with: wall time since the runner began, or with
    /// `-C 1` this process's CPU time (every thread).
    fn clock(&self) -> f64 {
        if !self.opts.cputime {
            return self.started.elapsed().as_secs_f64();
        }
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec for the call's duration.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        if rc != 0 {
            return 0.0;
        }
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    fn max_over_ranks(&self, v: f64) -> Result<f64, String> {
        let mut out = [0f64];
        self.comm.all_reduce(&[v], &mut out, ReduceOp::Max).map_err(|e| format!("reducing timings: {e}"))?;
        Ok(out[0])
    }

    fn sum_over_ranks(&self, v: u64) -> Result<u64, String> {
        let mut out = [0u64];
        self.comm.all_reduce(&[v], &mut out, ReduceOp::Sum).map_err(|e| format!("summing wrong counts: {e}"))?;
        Ok(out[0])
    }
}
