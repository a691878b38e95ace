//! Source-layout rules, checked by scanning `src/`: the process environment is read only in
//! the config module (`src/config.rs`, `src/config/`), through `config::environ`.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read src/") {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The 1-based lines of `text` (comments aside) that read an environment variable through
/// `std::env` (`var`, `var_os`, `vars`, `vars_os`, with or without the `std::` path).
fn env_reads(text: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .filter(|(_, l)| l.contains("env::var") || l.contains("use std::env::{") || l.contains("use std::env;"))
        .map(|(i, _)| i + 1)
        .collect()
}

#[test]
fn the_scanner_finds_environment_reads() {
    let sample = "fn a() {\n    let x = std::env::var(\"A\");\n    // std::env::var in a comment\n    let y = env::var_os(\"B\");\n    let z: Vec<_> = std::env::vars().collect();\n}\nuse std::env::{var, vars};\n";
    assert_eq!(env_reads(sample), vec![2, 4, 5, 7]);
    assert!(env_reads("std::env::set_var(\"A\", \"1\");\nstd::env::current_exe();\n").is_empty());
}

#[test]
fn environment_is_read_only_in_the_config_module() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = rust_files(&src);
    assert!(files.len() > 50, "expected the crate's sources under {}", src.display());
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "config.rs" || rel.starts_with("config/") {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        bad.extend(env_reads(&text).into_iter().map(|n| format!("src/{rel}:{n}")));
    }
    assert!(bad.is_empty(), "environment read outside src/config (use oxccl::config::environ): {bad:?}");
}
