//! Compiling and running the C programs of ffi-tests/ against a header directory and a library.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The directory holding liboxccl.so for this build: `cargo test` leaves it in
/// target/<profile>/deps beside the test binary, `cargo build` in target/<profile>.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    let candidates = [deps.clone(), deps.parent().map(|p| p.to_path_buf()).unwrap_or_default()];
    candidates.iter().find(|d| d.join("liboxccl.so").exists()).cloned().unwrap_or(deps)
}

/// Compiles `ffi-tests/<name>.c` with the include directories `incs`, linked with `-l<lib>`
/// from `libdir`, into `libdir/<out>`; returns the executable's path.
pub fn compile(name: &str, out: &str, incs: &[&Path], libdir: &Path, lib: &str) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let exe = libdir.join(out);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    cmd.args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1"]);
    for i in incs {
        cmd.arg(format!("-I{}", i.display()));
    }
    let st = cmd
        .arg(format!("{root}/ffi-tests/{name}.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", libdir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg(format!("-l{lib}"))
        .status()
        .expect("run the C compiler (install gcc)");
    assert!(st.success(), "compiling ffi-tests/{name}.c failed");
    exe
}

/// Compiles `ffi-tests/<name>.c` against include/ and liboxccl.so.
pub fn build_c(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include");
    let lib = lib_dir();
    assert!(lib.join("liboxccl.so").exists(), "liboxccl.so not found in {}", lib.display());
    compile(name, &format!("ffi-{name}"), &[&root], &lib, "oxccl")
}

/// Runs a C test program (loopback only) and asserts it exits 0 within 4 minutes.
pub fn run_c(exe: &Path, args: &[&str]) {
    let child = Command::new(exe)
        .args(args)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .env("OXCCL_TIMEOUT_MS", "60000")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run C test");
    let res = super::wait_all(vec![child], Duration::from_secs(240));
    super::assert_all_ok(&res);
}
