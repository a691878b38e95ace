//! Builds the C programs in ffi-tests/ with the system C compiler against include/ and
//! liboxccl.so, and runs them.

mod common;
use std::process::Command;

use common::cprog::{build_c, run_c};

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

#[test]
fn c_shrink_after_a_rank_is_killed() {
    let exe = build_c("shrink_fault");
    run_c(&exe, &["4"]);
}

#[test]
fn c_grow_two_ranks_to_four() {
    let exe = build_c("grow");
    run_c(&exe, &["4"]);
}

#[test]
fn c_one_thread_creates_ranks_in_a_group() {
    let exe = build_c("group_init");
    run_c(&exe, &[]);
}
