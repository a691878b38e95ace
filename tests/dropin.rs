//! NCCL drop-in checks (issue [H]): the export list, the libnccl.so.2 alias, the ABI against
//! NVIDIA's own nccl.h (downloaded once by scripts/fetch-nccl-header.sh; skipped visibly when
//! offline), and NCCL programs in ffi-tests/ run on oxccl.

mod common;
use common::cprog::{build_c, compile, lib_dir, run_c};
use oxccl::ffi::collconfig::ncclCollConfig_t;
use oxccl::ffi::config::ncclConfig_t;
use oxccl::ffi::premul::ncclScalarResidence_t;
use oxccl::ffi::{ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};
use std::collections::BTreeSet;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The 51 NCCL functions PyTorch 2.15 imports (each `nccl` + name).
const PYTORCH: &str = "AllGather AllReduce AlltoAll Bcast Broadcast CommAbort CommCount CommDeregister CommDestroy CommFinalize CommGetAsyncError CommGetUniqueId CommGrow CommInitAll CommInitRank CommInitRankConfig CommInitRankScalable CommMemStats CommRegister CommResume CommRevoke CommShrink CommSplit CommSuspend CommUserRank CommWindowDeregister CommWindowRegister DevCommCreate DevCommDestroy Gather GetErrorString GetLastError GetLsaMultimemDevicePointer GetPeerDevicePointer GetUniqueId GetVersion GroupEnd GroupSimulateEnd GroupStart MemAlloc MemFree PutSignal Recv RedOpCreatePreMulSum RedOpDestroy Reduce ReduceScatter Send Signal WaitSignal WinGetUserPtr";

fn names_in(file: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("{ROOT}/abi/{file}")).unwrap_or_else(|e| panic!("abi/{file}: {e}"));
    text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect()
}

/// NCCL's functions (each also as `p<name>`) and oxccl's own extensions.
fn expected_exports() -> BTreeSet<String> {
    let names = names_in("nccl-exports.txt");
    let ext = names_in("oxccl-exports.txt");
    assert!(ext.iter().all(|n| n.starts_with("oxccl")), "an extension must be named oxccl*: {ext:?}");
    names.iter().cloned().chain(names.iter().map(|n| format!("p{n}"))).chain(ext).collect()
}

fn dynamic_symbols(lib: &Path) -> BTreeSet<String> {
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(lib).output().expect("run nm (binutils)");
    assert!(out.status.success(), "nm failed on {}", lib.display());
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().nth(2)).map(String::from).collect()
}

fn soname(lib: &Path) -> String {
    let out = Command::new("readelf").arg("-d").arg(lib).output().expect("run readelf");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find(|l| l.contains("(SONAME)"))
        .and_then(|l| l.split('[').nth(1))
        .map(|s| s.trim_end_matches(']').to_string())
        .unwrap_or_default()
}

/// NVIDIA's include directory, or None (printed) when the wheel cannot be downloaded.
fn nvidia_include() -> Option<PathBuf> {
    let out = Command::new(format!("{ROOT}/scripts/fetch-nccl-header.sh")).output().expect("run fetch-nccl-header.sh");
    if !out.status.success() {
        common::skipped(&format!(
            "NVIDIA's nccl.h is unavailable (offline?): {}",
            String::from_utf8_lossy(&out.stderr)
        ));
        return None;
    }
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Makes libnccl.so.2 (and libnccl.so) beside liboxccl.so.
fn nccl_alias() -> PathBuf {
    let dir = lib_dir();
    let st = Command::new(format!("{ROOT}/scripts/install-nccl-alias.sh"))
        .arg(&dir)
        .status()
        .expect("run install-nccl-alias.sh");
    assert!(st.success(), "install-nccl-alias.sh failed");
    dir
}

#[test]
fn exports_are_exactly_the_nccl_symbol_list() {
    let got = dynamic_symbols(&lib_dir().join("liboxccl.so"));
    let want = expected_exports();
    let extra: Vec<_> = got.difference(&want).collect();
    let missing: Vec<_> = want.difference(&got).collect();
    assert!(extra.is_empty() && missing.is_empty(), "exports differ: extra {extra:?}, missing {missing:?}");
    for n in PYTORCH.split_whitespace() {
        assert!(got.contains(&format!("nccl{n}")), "PyTorch imports nccl{n}, which is not exported");
    }
    assert_eq!(soname(&lib_dir().join("liboxccl.so")), "liboxccl.so");
}

#[test]
fn nccl_alias_has_nccl_soname_and_the_same_exports() {
    let dir = nccl_alias();
    assert_eq!(soname(&dir.join("libnccl.so.2")), "libnccl.so.2");
    assert_eq!(dynamic_symbols(&dir.join("libnccl.so.2")), expected_exports());
}

#[test]
fn c_dropin_program_on_oxccl_header() {
    let exe = build_c("dropin");
    for n in ["2", "4"] {
        run_c(&exe, &[n]);
    }
}

#[test]
fn c_initall_one_process_many_ranks() {
    let exe = build_c("initall");
    run_c(&exe, &["4"]);
    run_c(&exe, &["1"]);
}

/// `#define`-free C: static asserts that NVIDIA's types have oxccl's layout and values.
fn abi_asserts() -> String {
    let mut s = String::from("#include <nccl.h>\n#include <stddef.h>\n#define SA(c) _Static_assert(c, #c)\n");
    let mut sa = |c: String| s.push_str(&format!("SA({c});\n"));
    macro_rules! layout {
        ($t:ident: $($f:ident),*) => {
            sa(format!("sizeof({}) == {}", stringify!($t), size_of::<$t>()));
            $(sa(format!("offsetof({}, {}) == {}", stringify!($t), stringify!($f), offset_of!($t, $f)));)*
        };
    }
    layout!(ncclConfig_t: size, magic, version, blocking, cgaClusterSize, minCTAs, maxCTAs, netName, splitShare, trafficClass,
        commName, collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs, nChannelsPerNetPeer, nvlinkCentricSched, graphUsageMode,
        numRmaCtx, maxP2pPeers, graphStreamOrdering, launchOrderImplicit, numRmaSig, rmaEagerInit, hostCftMode, nvlsHostMode);
    layout!(ncclCollConfig_t: size, magic, version, ext, minCTAs, maxCTAs, nvlsCTAs, cgaClusterSize, algSelection,
        forceAlgSelection, CTAPolicy, userProfilerTag, launchCompletionEvent);
    layout!(ncclUniqueId: internal);
    macro_rules! values {
        ($t:ident: $($v:ident),*) => { $(sa(format!("{} == {}", stringify!($v), $t::$v as i64));)* };
    }
    values!(ncclResult_t: ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError, ncclInvalidArgument,
        ncclInvalidUsage, ncclRemoteError, ncclInProgress, ncclTimeout, ncclNumResults);
    values!(ncclDataType_t: ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64, ncclFloat16, ncclFloat32,
        ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2, ncclNumTypes);
    values!(ncclRedOp_t: ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg, ncclNumOps, ncclMaxRedOp);
    values!(ncclScalarResidence_t: ncclScalarDevice, ncclScalarHostImmediate);
    sa(format!("NCCL_CONFIG_UNDEF_INT == {}", oxccl::ffi::config::NCCL_CONFIG_UNDEF_INT));
    sa(format!("NCCL_API_MAGIC == {:#x}u", oxccl::ffi::config::NCCL_API_MAGIC));
    sa(format!("NCCL_SPLIT_NOCOLOR == {}", oxccl::ffi::config::NCCL_SPLIT_NOCOLOR));
    sa("sizeof(ncclConfig_t) == sizeof((ncclConfig_t)NCCL_CONFIG_INITIALIZER)".to_string());
    s.push_str("int main(void) { return 0; }\n");
    s
}

#[test]
fn nvidia_nccl_h_abi_and_dropin_program_linked_with_lnccl() {
    let Some(inc) = nvidia_include() else { return };
    let stubs = PathBuf::from(format!("{ROOT}/ffi-tests/cuda-stubs"));
    // 1. Layout and values: NVIDIA's header against oxccl's Rust definitions.
    let src = std::env::temp_dir().join(format!("oxccl-abi-{}.c", std::process::id()));
    std::fs::write(&src, abi_asserts()).unwrap();
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Werror", "-fsyntax-only"])
        .arg(format!("-I{}", stubs.display()))
        .arg(format!("-I{}", inc.display()))
        .arg(&src)
        .output()
        .expect("run the C compiler");
    let _ = std::fs::remove_file(&src);
    assert!(out.status.success(), "ABI mismatch with NVIDIA's nccl.h:\n{}", String::from_utf8_lossy(&out.stderr));
    // 2. Every function NVIDIA's nccl.h declares is exported.
    let header = std::fs::read_to_string(inc.join("nccl.h")).unwrap();
    let got = dynamic_symbols(&lib_dir().join("liboxccl.so"));
    for tok in header
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .filter(|t| t.starts_with("nccl") || t.starts_with("pnccl"))
    {
        let declared = header.contains(&format!("{tok}(")) || header.contains(&format!("{tok} ("));
        if declared
            && tok.chars().nth(if tok.starts_with('p') { 5 } else { 4 }).is_some_and(|c| c.is_ascii_uppercase())
            && tok != "ncclUniqueId"
        {
            assert!(got.contains(tok), "NVIDIA's nccl.h declares {tok}, which liboxccl.so does not export");
        }
    }
    // 3. The NCCL program, built against NVIDIA's header and linked with -lnccl (oxccl's alias).
    let dir = nccl_alias();
    let exe =
        compile("dropin", "ffi-dropin-nvidia", &[&stubs, &inc, Path::new(&format!("{ROOT}/ffi-tests"))], &dir, "nccl");
    let dynamic = Command::new("readelf").arg("-d").arg(&exe).output().unwrap();
    assert!(
        String::from_utf8_lossy(&dynamic.stdout).contains("[libnccl.so.2]"),
        "the program does not need libnccl.so.2"
    );
    run_c(&exe, &["4"]);
}
