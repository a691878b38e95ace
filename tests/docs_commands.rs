//! Every shell command quoted in README.md, python-bindings/README.md and docs/*.md (fenced
//! `bash`/`sh`/`shell`/`console` blocks) runs as written from the repository root, so the
//! docs stay true. Commands that cannot run here are on an allow-list with the reason, printed
//! as SKIPPED; any other command that fails fails this test.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Bound on one command.
const LIMIT: Duration = Duration::from_secs(300);

/// Commands (by prefix) not run here, and why.
const SKIP: &[(&str, &str)] = &[
    ("./scripts/test.sh", "the whole suite, which runs this test"),
    ("bash scripts/gpu-check.sh", "needs a GPU (the one GPU command)"),
    ("cargo build --release", "cargo test --release built it (cargo inside cargo test would wait on its lock)"),
    (
        "pip install",
        "installs into the current Python; scripts/python-tests.sh installs the package this way and tests it",
    ),
    (
        "pip wheel",
        "builds the library again (minutes); scripts/python-tests.sh builds and installs the package this way",
    ),
    ("python3 -m venv build/venv", "installs matplotlib from PyPI for a plotting script"),
    ("benches/algo_sweep.sh", "a benchmark of many minutes"),
    ("TRANSPORT=tcp RANKS=", "a benchmark of many minutes"),
    ("cc app.c", "app.c stands for the user's program; tests/dropin.rs builds and runs programs this way"),
    (
        "LD_LIBRARY_PATH=$PWD/target/release ./app",
        "./app is the user's program (tests/dropin.rs runs programs this way)",
    ),
    (
        "LD_PRELOAD=$PWD/target/release/libnccl.so.2 ./app",
        "./app is the user's program (tests/dropin.rs runs programs this way)",
    ),
];

/// Commands (by prefix) run only when their tool is installed.
const NEEDS: &[(&str, &str)] = &[("torchrun", "torchrun"), ("OXCCL_COMM_ID=127.0.0.1:29533 mpirun", "mpirun")];

/// (file, command) for every command in a fenced shell block of the docs.
fn commands() -> Vec<(String, String)> {
    let mut files = vec![PathBuf::from("README.md"), PathBuf::from("python-bindings/README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| p.strip_prefix(ROOT).unwrap().to_path_buf())
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(Path::new(ROOT).join(&f)).expect("read doc");
        let mut shell = None::<bool>;
        let mut pending = String::new();
        for line in text.lines() {
            let t = line.trim_start();
            if let Some(lang) = t.strip_prefix("```") {
                shell = match shell {
                    Some(_) => None,
                    None => Some(matches!(lang.trim(), "bash" | "sh" | "shell" | "console")),
                };
                continue;
            }
            if shell != Some(true) {
                continue;
            }
            let cmd = strip_comment(t.strip_prefix("$ ").unwrap_or(t));
            if let Some(head) = cmd.strip_suffix('\\') {
                pending.push_str(head);
                continue;
            }
            let full = format!("{pending}{cmd}");
            pending.clear();
            if !full.trim().is_empty() {
                out.push((f.display().to_string(), full.trim().to_string()));
            }
        }
    }
    out
}

/// The command without a trailing `# comment` (a `#` after whitespace, outside quotes).
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if prev_space && !single && !double => return line[..i].trim_end(),
            _ => {}
        }
        prev_space = c.is_whitespace();
    }
    line.trim_end()
}

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes target/release/liboxccl.so current (cargo test leaves the cdylib in deps/).
fn uplift_library() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_oxccl-perf"));
    let release = exe.parent().unwrap();
    let built = common::cprog::lib_dir().join("liboxccl.so");
    let dst = release.join("liboxccl.so");
    if built == dst || !built.exists() {
        return;
    }
    // Cargo often leaves the two names as hard links of one file: copying onto `dst` in place
    // would truncate `built` too (an empty library for every later test). A copy beside it,
    // renamed over `dst`, leaves `built` alone.
    let same = |a: &std::path::Path, b: &std::path::Path| {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
            _ => false,
        }
    };
    if same(&built, &dst) {
        return;
    }
    let tmp = release.join(format!(".liboxccl.so.{}", std::process::id()));
    std::fs::copy(&built, &tmp).expect("copy liboxccl.so into target/release");
    std::fs::rename(&tmp, &dst).expect("move liboxccl.so into place in target/release");
}

/// Runs `cmd` with bash in the repository root; returns (success, output tail).
fn run(cmd: &str) -> (bool, String) {
    let mut child = Command::new("bash")
        .args(["-o", "pipefail", "-c", cmd])
        .current_dir(ROOT)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child
        .wait_with_output()
        .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)));
    let out = out.unwrap_or_default();
    let tail: String = out.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    match status {
        Some(s) => (s.success(), tail),
        None => (false, format!("killed after {LIMIT:?}\n{tail}")),
    }
}

#[test]
fn comments_are_stripped_outside_quotes() {
    assert_eq!(strip_comment("a -b 1   # note"), "a -b 1");
    assert_eq!(strip_comment("echo '# kept' \"#kept\" x#y"), "echo '# kept' \"#kept\" x#y");
    assert_eq!(strip_comment("# only"), "");
}

#[test]
fn documented_commands_run_as_written() {
    if !env!("CARGO_BIN_EXE_oxccl-perf").contains("/release/") {
        common::skipped("the docs' commands use target/release: run with cargo test --release");
        return;
    }
    uplift_library();
    let cmds = commands();
    assert!(cmds.len() >= 10, "too few commands found: {cmds:?}");
    let mut failed = Vec::new();
    for (file, cmd) in &cmds {
        if let Some((_, why)) = SKIP.iter().find(|(p, _)| cmd.starts_with(p)) {
            common::skipped(&format!("{file}: `{cmd}`: {why}"));
            continue;
        }
        if let Some((_, tool)) = NEEDS.iter().find(|(p, t)| cmd.starts_with(p) && !on_path(t)) {
            common::skipped(&format!("{file}: `{cmd}`: {tool} is not installed"));
            continue;
        }
        // The binaries cargo test built stand for a build the command would make.
        let mut cmd_here = cmd.replace("cargo run --release --bin oxccl-perf", "target/release/oxccl-perf");
        if cmd.starts_with("scripts/install.sh ") && !cmd.contains("--lib-dir") {
            cmd_here = format!("{cmd_here} --lib-dir {}", common::cprog::lib_dir().display());
        }
        let t = Instant::now();
        let (ok, tail) = run(&cmd_here);
        eprintln!("{} {file}: `{cmd}` ({:.1} s)", if ok { "ok" } else { "FAILED" }, t.elapsed().as_secs_f64());
        if !ok {
            failed.push(format!("{file}: `{cmd}`:\n{tail}"));
        }
    }
    assert!(failed.is_empty(), "documented commands failed:\n\n{}", failed.join("\n\n"));
}
