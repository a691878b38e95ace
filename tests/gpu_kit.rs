//! The GPU check kit (scripts/gpu-kit.sh, docs/GPU.md) works away from the checkout: built here
//! from this build's executables (`--prebuilt`), moved to another folder, and run there with
//! only /usr/bin:/bin on PATH (no cargo, no compiler needed) and a cleared environment, against
//! the kit's own CPU stand-in of CUDA: `run --quick --standin`, then the full runner limited to
//! the steps that prove the device path in both modes and the (5) steps that run on the stand-in
//! (`--only`). Each step must PASS in the summary table and in `$OUT/summary.tsv`, except the
//! (5) steps that need a real GPU with torch or a feature not built: those say SKIP, with why.
//!
//! Needs the device suites, oxccl-perf and the gpu_kernel_bench example built in this profile,
//! as `cargo test --release --all-targets` does; bash, cc and c++ (for the stand-in).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The cargo target directory this test runs from (target/<profile>/deps/<exe> → target).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.ancestors().nth(3).expect("target dir").to_path_buf()
}

/// The rows of `summary.tsv`: (name, status, note).
fn summary(out: &Path) -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(out.join("summary.tsv")).expect("summary.tsv");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("name\tstatus\tseconds\tnote"), "summary.tsv header:\n{text}");
    lines
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 4, "summary.tsv row {l:?}");
            assert!(f[2].parse::<f64>().is_ok(), "seconds of {l:?}");
            (f[0].to_string(), f[1].to_string(), f[3].to_string())
        })
        .collect()
}

/// Runs the kit's runner from `kit` with a cleared environment; returns (exit ok, stdout).
fn run_kit(kit: &Path, out: &Path, args: &[&str]) -> (bool, String) {
    let res = Command::new("/usr/bin/timeout")
        .args(["-k", "5", "300", "/bin/bash"])
        .arg(kit.join("run"))
        .args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", out)
        .env("OUT", out)
        .current_dir(out.parent().unwrap())
        .output()
        .expect("run the kit");
    let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
    let text = format!("{stdout}\n--- stderr\n{}", String::from_utf8_lossy(&res.stderr));
    (res.status.success(), text)
}

/// Checks that the steps `want` ran, in that order, and passed; those in `may_skip` may say
/// SKIP instead, with a reason (they need a real GPU with torch, or a feature not built).
fn check_steps(out: &Path, text: &str, want: &[&str], may_skip: &[&str]) {
    let rows = summary(out);
    let names: Vec<&str> = rows.iter().map(|r| r.0.as_str()).filter(|n| want.contains(n)).collect();
    assert_eq!(names, want, "steps run:\n{text}");
    for (name, status, note) in &rows {
        if may_skip.contains(&name.as_str()) && status == "SKIP" {
            assert!(!note.is_empty(), "step {name} skipped without a reason:\n{text}");
        } else if want.contains(&name.as_str()) {
            let log = std::fs::read_to_string(out.join(format!("{name}.txt"))).unwrap_or_default();
            let tail: String =
                log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            assert_eq!(status, "PASS", "step {name}: {status} ({note})\n{tail}\n--- runner output\n{text}");
        } else {
            assert_eq!(status, "SKIP", "step {name} was not selected: {status} ({note})");
        }
    }
    let last = text.lines().rfind(|l| l.starts_with("RESULT ")).unwrap_or("");
    assert!(last.starts_with("RESULT PASS"), "last line {last:?}:\n{text}");
}

#[test]
fn the_kit_runs_from_a_copy_without_cargo_on_the_stand_in() {
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-kit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let built = work.join("kit");
    let st = Command::new("bash")
        .arg(format!("{ROOT}/scripts/gpu-kit.sh"))
        .arg(&built)
        .arg("--prebuilt")
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .expect("scripts/gpu-kit.sh");
    assert!(
        st.status.success(),
        "scripts/gpu-kit.sh failed (build the device suites, oxccl-perf and examples first: \
         cargo test --release --all-targets --no-run):\n{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let kib: u64 = String::from_utf8(Command::new("du").arg("-sk").arg(&built).output().unwrap().stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(kib <= 56 * 1024, "the kit is {kib} KiB, over 56 MiB");

    // Moved elsewhere: nothing may point back into the checkout or the build folder.
    let kit = work.join("moved").join("kit");
    std::fs::create_dir_all(kit.parent().unwrap()).unwrap();
    assert!(Command::new("cp").arg("-a").arg(&built).arg(&kit).status().unwrap().success());
    std::fs::remove_dir_all(&built).unwrap();

    let out = work.join("out-quick");
    let (ok, text) = run_kit(&kit, &out, &["--quick", "--standin"]);
    check_steps(&out, &text, &["0-devinfo", "0-kernels", "0-perf-2ranks"], &[]);
    assert!(ok, "run --quick --standin exited with failure:\n{text}");
    let devinfo = std::fs::read_to_string(out.join("0-devinfo.txt")).unwrap();
    assert!(devinfo.contains("device0.name: oxccl CUDA stand-in"), "not on the kit's stand-in:\n{devinfo}");

    let out = work.join("out-some");
    let only = "^(0-devinfo|1-alltypes-proxy|1-colls-3ranks|2-kill-abort|5-late-peer|5-async|5-one-queue|5-one-queue-colls|5-vmm|5-torch-.*|5-kernel-offsets|5-small-kernel.*)$";
    let (ok, text) = run_kit(&kit, &out, &["--standin", "--only", only]);
    // The (5) steps that need a GPU with torch, or the small kernel, say SKIP with the reason.
    let torch = ["5-torch-expandable", "5-torch-mallocasync", "5-torch-capture"];
    // One step when the build has no small kernel, an off and an on step when it has.
    let small: Vec<String> =
        summary(&out).into_iter().map(|r| r.0).filter(|n| n.starts_with("5-small-kernel")).collect();
    let mut want = vec!["0-devinfo", "1-alltypes-proxy", "1-colls-3ranks", "2-kill-abort", "5-late-peer"];
    want.extend(["5-async", "5-one-queue", "5-one-queue-colls", "5-vmm"]);
    want.extend(torch);
    want.push("5-kernel-offsets");
    want.extend(small.iter().map(String::as_str));
    let may_skip: Vec<&str> = torch.iter().copied().chain(small.iter().map(String::as_str)).collect();
    check_steps(&out, &text, &want, &may_skip);
    assert!(ok, "run --standin --only exited with failure:\n{text}");
    let _ = std::fs::remove_dir_all(&work);
}
