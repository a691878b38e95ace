//! End-to-end tests of the `oxccl-perf` binary: a multi-rank sweep over every type and op with
//! result checking and JSON output, and the command-line error paths.

use std::path::PathBuf;
use std::process::{Command, Output};

fn perf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_oxccl-perf"))
        .args(args)
        // Run as the parent that starts its own ranks, even inside a launcher's environment.
        .env_remove("OXCCL_RANK")
        .env_remove("OXCCL_NRANKS")
        .env_remove("OXCCL_UNIQUE_ID")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_RANK")
        .env_remove("PMI_SIZE")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS")
        .output()
        .expect("oxccl-perf runs")
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
    let out = perf(&["--ranks", "3", "-b", "1K", "-e", "64K", "-d", "all", "-o", "all", "-n", "2", "-w", "1", "-T", "300", "--json", path_str]);
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
fn help_and_unimplemented_collectives() {
    let out = perf(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--ranks N"));

    let out = perf(&["alltoall", "--ranks", "2"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("collective alltoall is not implemented yet"));
}
