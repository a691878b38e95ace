//! End-to-end tests of the `oxccl-perf` binary: a multi-rank sweep over every type and op with
//! result checking and JSON output, and the command-line error paths.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The launcher variables that would make `oxccl-perf` act as one rank of a launched job.
const LAUNCHER_VARS: [&str; 11] = [
    "OXCCL_RANK",
    "OXCCL_NRANKS",
    "OXCCL_UNIQUE_ID",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

/// `cmd` run as the parent that starts its own ranks, even inside a launcher's environment.
fn as_parent(mut cmd: Command) -> Command {
    for v in LAUNCHER_VARS {
        cmd.env_remove(v);
    }
    cmd
}

fn perf(args: &[&str]) -> Output {
    as_parent(Command::new(env!("CARGO_BIN_EXE_oxccl-perf"))).args(args).output().expect("oxccl-perf runs")
}

/// The values of `"key":value` in a flat JSON text, as raw strings.
fn json_values<'a>(json: &'a str, key: &str) -> Vec<&'a str> {
    let pat = format!("\"{key}\":");
    json.match_indices(&pat)
        .map(|(i, _)| {
            let rest = &json[i + pat.len()..];
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            rest[..end].trim()
        })
        .collect()
}

#[test]
fn all_types_and_ops_check_clean_on_three_ranks() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("perf_cli_{}.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let path_str = path.to_str().expect("utf-8 temp path");
    let out = perf(&[
        "--ranks", "3", "-b", "1K", "-e", "64K", "-d", "all", "-o", "all", "-n", "2", "-w", "1", "-T", "300", "--json",
        path_str,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");

    let json = std::fs::read_to_string(&path).expect("JSON file written");
    let _ = std::fs::remove_file(&path);
    let trimmed = json.trim();
    assert!(trimmed.starts_with('[') && trimmed.ends_with(']'), "{json}");
    // 7 sizes (1K..64K by x2) x 12 types x 5 ops.
    let rows = json_values(&json, "collective");
    assert_eq!(rows.len(), 7 * 12 * 5);
    assert!(rows.iter().all(|c| *c == "\"all_reduce\""));
    assert!(json_values(&json, "nranks").iter().all(|n| *n == "3"));
    for key in ["oop_wrong", "ip_wrong"] {
        let wrong = json_values(&json, key);
        assert_eq!(wrong.len(), rows.len());
        assert!(wrong.iter().all(|w| *w == "0"), "{key} not all zero:\n{json}");
    }
    for key in ["oop_time_us", "ip_time_us"] {
        assert!(json_values(&json, key).iter().all(|t| t.parse::<f64>().is_ok_and(|t| t > 0.0)), "{key}");
    }
    // Every type/op combination has its table rows.
    assert_eq!(stdout.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).count(), rows.len());
}

#[test]
fn bad_flag_exits_2_with_usage() {
    let out = perf(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown option '--no-such-flag'"), "{stderr}");
    assert!(stderr.contains("Usage: oxccl-perf"), "{stderr}");

    let out = perf(&["-b", "64K", "-e", "1K"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn help_lists_every_collective() {
    let out = perf(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("--ranks N"));
    for c in [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "reduce",
        "alltoall",
        "sendrecv",
        "gather",
        "scatter",
    ] {
        assert!(text.contains(c), "{c} missing from --help");
    }
}

/// Every collective, briefly, on 3 ranks with a non-zero root, every algorithm it has
/// forced in turn: results checked (`#wrong` 0), table rows for every size and the bus
/// bandwidth factor of nccl-tests applied.
#[test]
fn every_collective_checks_clean() {
    let factors = [
        ("all_reduce", 4.0 / 3.0),
        ("all_gather", 2.0 / 3.0),
        ("reduce_scatter", 2.0 / 3.0),
        ("broadcast", 1.0),
        ("reduce", 1.0),
        ("alltoall", 2.0 / 3.0),
        ("sendrecv", 1.0),
        ("gather", 2.0 / 3.0),
        ("scatter", 2.0 / 3.0),
    ];
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for (coll, factor) in factors {
        let algos: &[&str] = match coll {
            "all_reduce" => &["ring", "tree", "rd"],
            "broadcast" | "reduce" => &["ring", "tree"],
            _ => &["ring"],
        };
        for algo in algos {
            let path = dir.join(format!("perf_cli_{coll}_{algo}_{}.json", std::process::id()));
            let out = Command::new(env!("CARGO_BIN_EXE_oxccl-perf"))
                .args([
                    coll, "--ranks", "3", "-b", "1K", "-e", "256K", "-f", "16", "-n", "2", "-w", "1", "-r", "2", "-o",
                    "all", "-T", "120",
                ])
                .arg("--json")
                .arg(&path)
                .env("OXCCL_ALGO", algo)
                .env_remove("OXCCL_RANK")
                .env_remove("OXCCL_NRANKS")
                .env_remove("OXCCL_UNIQUE_ID")
                .output()
                .expect("oxccl-perf runs");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(out.status.code(), Some(0), "{coll} {algo}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            assert!(stdout.contains("# Out of bounds values : 0 OK"), "{coll}: {stdout}");
            let json = std::fs::read_to_string(&path).expect("JSON written");
            let _ = std::fs::remove_file(&path);
            let ops = if ["all_reduce", "reduce_scatter", "reduce"].contains(&coll) { 5 } else { 1 };
            let rows = json_values(&json, "collective");
            assert_eq!(rows.len(), 3 * ops, "{coll}: 1K, 16K, 256K x ops\n{json}");
            assert!(rows.iter().all(|c| *c == format!("\"{coll}\"")));
            let root = if ["broadcast", "reduce", "gather", "scatter"].contains(&coll) { "2" } else { "-1" };
            assert!(json_values(&json, "root").iter().all(|r| *r == root), "{coll}: {json}");
            for (alg, bus) in json_values(&json, "oop_algbw").iter().zip(json_values(&json, "oop_busbw")) {
                let (alg, bus): (f64, f64) = (alg.parse().unwrap(), bus.parse().unwrap());
                assert!(
                    (bus - alg * factor).abs() <= 1e-9 * alg.max(1.0),
                    "{coll}: busbw {bus} vs algbw {alg} x {factor}"
                );
            }
            assert!(
                json_values(&json, "oop_wrong").iter().chain(&json_values(&json, "ip_wrong")).all(|w| *w == "0"),
                "{coll}: {json}"
            );
        }
    }
}

#[test]
fn median_stat_times_every_iteration_and_checks_clean() {
    let out = perf(&[
        "--ranks", "2", "-b", "8", "-e", "32K", "-f", "8", "-n", "40", "-w", "2", "--stat", "median", "-T", "120",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("median over iterations of the slowest rank's per-iteration time"), "{stdout}");
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    // 8 B, 64 B, 512 B, 4 KiB, 32 KiB; out-of-place and in-place times are columns 5 and 9.
    assert_eq!(rows.len(), 5, "{stdout}");
    for r in &rows {
        for col in [5, 9] {
            let t: f64 = r[col].parse().unwrap_or_else(|_| panic!("time column in {r:?}"));
            assert!(t > 0.0 && t < 1e6, "implausible median time {t} us in {r:?}");
        }
    }
}

/// GB/s from oxccl-iperf's result line (`size time GB/s`), after checking that it is the faster
/// of the two ways of driving the sockets (`# mode threads|poll  T us  G GB/s` lines).
fn iperf_gbps(out: &Output) -> f64 {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "oxccl-iperf failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().last().unwrap_or_default();
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols.len(), 3, "unexpected result line {line:?}");
    assert_eq!(cols[0], "1048576", "size column of {line:?}");
    let result: f64 = cols[2].parse().unwrap_or_else(|_| panic!("GB/s column of {line:?}"));
    let modes: Vec<(String, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# mode "))
        .map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c[0].to_string(), c[3].parse().unwrap_or_else(|_| panic!("GB/s of mode line {l:?}")))
        })
        .collect();
    let names: Vec<&str> = modes.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, ["threads", "poll"], "both modes measured:\n{text}");
    let best = modes.iter().map(|&(_, g)| g).fold(0.0, f64::max);
    assert_eq!(format!("{result:.3}"), format!("{best:.3}"), "the result is the faster mode:\n{text}");
    result
}

/// oxccl-iperf (the raw-TCP ceiling of the multi-host comparison): a full-duplex pair in one
/// process, and a ring of three processes, each sending to the next while receiving from the
/// previous one; every member reports a positive throughput and exits cleanly.
#[test]
fn oxccl_iperf_pair_and_ring_report_throughput() {
    let iperf = env!("CARGO_BIN_EXE_oxccl-iperf");
    let out = Command::new(iperf).args(["--size", "1M", "--iters", "2", "--streams", "2"]).output().unwrap();
    assert!(iperf_gbps(&out) > 0.0);
    // Three free loopback ports (bound, then released for the members to bind).
    let ports: Vec<u16> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect();
    let members: Vec<std::process::Child> = (0..3)
        .map(|i| {
            Command::new(iperf)
                .args(["--size", "1M", "--iters", "2"])
                .args(["--listen", &format!("127.0.0.1:{}", ports[i])])
                .args(["--connect", &format!("127.0.0.1:{}", ports[(i + 1) % 3])])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for m in members {
        let out = m.wait_with_output().unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("ring member"));
        assert!(iperf_gbps(&out) > 0.0);
    }
}

/// A fresh directory under the target's temp dir.
fn temp_dir(tag: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("perf_cli_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs the binary through a symlink named `name` in `dir` (as nccl-tests' binaries are named).
fn perf_as(dir: &std::path::Path, name: &str, args: &[&str]) -> Output {
    let link = dir.join(name);
    if !link.exists() {
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_oxccl-perf"), &link).expect("symlink");
    }
    as_parent(Command::new(&link))
        .args(args)
        .current_dir(dir)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .output()
        .expect("oxccl-perf runs")
}

/// An nccl-tests command line, unchanged, through a link named all_reduce_perf: every flag
/// is accepted, flags that do not apply get a note, results check clean, and `-J` writes the
/// run's metadata (version, ranks and hosts, environment, iterations, statistic) and rows.
#[test]
fn nccl_tests_command_line_runs_unchanged() {
    let dir = temp_dir("nccltests");
    let out = perf_as(
        &dir,
        "all_reduce_perf",
        &[
            "-b", "8", "-e", "4K", "-f", "2", "-g", "1", "-t", "1", "-n", "2", "-w", "1", "-c", "1", "-a", "3", "-z",
            "0", "-G", "0", "-p", "0", "-m", "1", "-N", "1", "-C", "0", "-R", "0", "-d", "float", "-o", "sum", "-J",
            "run.json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("# Out of bounds values : 0 OK"), "{stdout}");
    assert!(stdout.contains("# note: -z 0 (--blocking) does not apply"), "{stdout}");
    assert!(!stdout.contains("--cudagraph"), "-G 0 is harmless and gets no note:\n{stdout}");
    let json = std::fs::read_to_string(dir.join("run.json")).expect("-J file written");
    assert!(json.starts_with("{\"oxccl_perf\":{"), "{json}");
    assert_eq!(json_values(&json, "version"), [format!("\"{}\"", env!("CARGO_PKG_VERSION"))]);
    assert_eq!(json_values(&json, "program"), ["\"oxccl-perf all_reduce\""]);
    assert_eq!(json_values(&json, "iters"), ["2"]);
    assert_eq!(json_values(&json, "warmup_iters"), ["1"]);
    assert_eq!(json_values(&json, "stat"), ["\"mean\""]);
    assert_eq!(json_values(&json, "host").len(), 2, "one host entry per rank");
    assert_eq!(json_values(&json, "OXCCL_SOCKET_IFNAME"), ["\"lo\""], "the environment is recorded");
    assert!(json_values(&json, "OXCCL_UNIQUE_ID").iter().all(|v| *v == "\"***\""), "the id is withheld");
    let rows = json_values(&json, "collective");
    assert_eq!(rows.len(), 10, "8 B .. 4 KiB by x2: {json}");
    assert!(rows.iter().all(|c| *c == "\"all_reduce\""));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The program name picks the collective (broadcast_perf runs broadcast); a conflicting
/// collective argument or an unknown `*_perf` name is a usage error; `--version` prints it.
#[test]
fn program_name_picks_the_collective() {
    let dir = temp_dir("argv0");
    let out = perf_as(&dir, "broadcast_perf", &["-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--json", "b.json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let json = std::fs::read_to_string(dir.join("b.json")).unwrap();
    assert_eq!(json_values(&json, "collective"), ["\"broadcast\""]);
    let out = perf_as(&dir, "broadcast_perf", &["all_reduce"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("program name says broadcast"));
    let out = perf_as(&dir, "hypercube_perf", &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = perf_as(&dir, "sendrecv_perf", &["--version"]);
    assert_eq!(out.status.code(), Some(0));
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(v.starts_with(&format!("oxccl-perf {} ", env!("CARGO_PKG_VERSION"))), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `oxccl-perf plot` draws a PNG of the given size from a `--json` and a `-J` file, and
/// reports the lines it drew (one per algorithm of the comparison run, one for the other).
#[test]
fn plot_draws_a_png_from_json_and_output_file() {
    let dir = temp_dir("plot");
    let a = perf_as(
        &dir,
        "oxccl-perf",
        &[
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "8",
            "-n",
            "1",
            "-w",
            "0",
            "--algo",
            "ring,tree",
            "--rounds",
            "1",
            "--json",
            "algos.json",
        ],
    );
    assert_eq!(a.status.code(), Some(0), "{}", String::from_utf8_lossy(&a.stderr));
    let b = perf_as(&dir, "oxccl-perf", &["-b", "8", "-e", "64K", "-f", "8", "-n", "1", "-w", "0", "-J", "run.json"]);
    assert_eq!(b.status.code(), Some(0), "{}", String::from_utf8_lossy(&b.stderr));
    let out = perf_as(&dir, "oxccl-perf", &["plot", "algos.json", "run.json", "-o", "busbw.png"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("3 line(s) drawn"), "{stdout}");
    let png = std::fs::read(dir.join("busbw.png")).expect("PNG written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let dim = |o: usize| u32::from_be_bytes(png[o..o + 4].try_into().unwrap());
    assert_eq!((dim(16), dim(20)), (1200, 750), "IHDR width and height");
    let out = perf_as(&dir, "oxccl-perf", &["plot", "missing.json"]);
    assert_eq!(out.status.code(), Some(1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--hash` lines of a run: (size, out-of-place hash, in-place hash).
fn hash_lines(env: &[(&str, &str)], coll: &str) -> Vec<(String, String, String)> {
    let mut cmd = as_parent(Command::new(env!("CARGO_BIN_EXE_oxccl-perf")));
    cmd.args([coll, "--ranks", "3", "-b", "8", "-e", "256K", "-f", "8", "-n", "2", "-w", "1", "-T", "120", "--hash"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("oxccl-perf runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{env:?}\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
        .lines()
        .filter(|l| l.starts_with("#  hash"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[2].to_string(), w[w.len() - 3].to_string(), w[w.len() - 1].to_string())
        })
        .collect()
}

/// With `OXCCL_DETERMINISTIC=1`, `--hash` prints a line per size whose hashes are equal out of
/// place and in place, and equal whatever algorithm and chunk size the settings force; without
/// it, forcing another algorithm changes some hash (the input is hard enough to show it).
#[test]
fn hash_lines_are_reproducible_under_the_deterministic_switch() {
    for coll in ["all_reduce", "reduce_scatter"] {
        let on = [("OXCCL_DETERMINISTIC", "1")];
        let base = hash_lines(&on, coll);
        assert_eq!(base.len(), 6, "{base:?}");
        assert!(base.iter().all(|(_, a, b)| a == b && a.len() == 16), "{base:?}");
        let forced = [("OXCCL_DETERMINISTIC", "1"), ("OXCCL_ALGO", "tree"), ("OXCCL_CHUNK_SIZE", "4096")];
        assert_eq!(hash_lines(&forced, coll), base, "{coll}");
    }
    let off = |algo| hash_lines(&[("OXCCL_DETERMINISTIC", "0"), ("OXCCL_ALGO", algo)], "all_reduce");
    assert_ne!(off("ring"), off("tree"), "ring and tree reduce in different orders");
}
