//! Builds the C programs in ffi-tests/ with the system C compiler against include/ and
//! liboxccl.so, and runs them.

mod common;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The directory holding liboxccl.so for this build: `cargo test` leaves it in
/// target/<profile>/deps beside the test binary, `cargo build` in target/<profile>.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let deps = exe.parent().expect("deps dir").to_path_buf();
    let candidates = [deps.clone(), deps.parent().map(|p| p.to_path_buf()).unwrap_or_default()];
    candidates.iter().find(|d| d.join("liboxccl.so").exists()).cloned().unwrap_or(deps)
}

/// Compiles `ffi-tests/<name>.c` and returns the executable's path.
pub fn build_c(name: &str) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let lib = lib_dir();
    assert!(lib.join("liboxccl.so").exists(), "liboxccl.so not found in {}", lib.display());
    let out = lib.join(format!("ffi-{name}"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg(format!("-I{root}/include"))
        .arg(format!("{root}/ffi-tests/{name}.c"))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-loxccl")
        .status()
        .expect("run the C compiler (install gcc)");
    assert!(st.success(), "compiling ffi-tests/{name}.c failed");
    out
}

fn run_c(exe: &PathBuf, args: &[&str]) {
    let child = Command::new(exe)
        .args(args)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .env("OXCCL_TIMEOUT_MS", "60000")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run C test");
    let res = common::wait_all(vec![child], Duration::from_secs(240));
    common::assert_all_ok(&res);
}

#[test]
fn c_allreduce_multi_process() {
    let exe = build_c("allreduce");
    for n in ["1", "2", "3", "4"] {
        run_c(&exe, &[n]);
    }
}

#[test]
fn c_every_collective_and_grouped_send_recv_ring() {
    let exe = build_c("collectives");
    for n in ["1", "3", "5"] {
        run_c(&exe, &[n]);
    }
}

#[test]
fn nccl_h_compiles_as_cpp() {
    let root = env!("CARGO_MANIFEST_DIR");
    let src = std::env::temp_dir().join(format!("oxccl-cpp-{}.cc", std::process::id()));
    std::fs::write(&src, "#include <nccl.h>\nint main() { ncclComm_t c = nullptr; (void)c; ncclDataType_t t = ncclFloat; ncclRedOp_t o = ncclAvg; return (int)t + (int)o == 11 ? 0 : 1; }\n").unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let st = Command::new(cxx)
        .args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", &format!("-I{root}/include")])
        .arg(&src)
        .status()
        .expect("run the C++ compiler");
    let _ = std::fs::remove_file(&src);
    assert!(st.success(), "nccl.h does not compile as C++");
}

#[test]
fn c_bad_input_mismatch_async_error_destroy_twice_abort() {
    let exe = build_c("bad_input");
    run_c(&exe, &["2"]);
}
