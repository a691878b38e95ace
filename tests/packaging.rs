//! C packaging (scripts/install.sh): install to a temporary prefix, then build
//! packaging/example/allreduce.c with `pkg-config --cflags --libs oxccl` (and `nccl`) and with
//! CMake's `find_package(oxccl)`, and run each program (a checked 2-rank all-reduce).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Installs into a fresh prefix from this build's liboxccl.so; returns the prefix.
fn install(tag: &str) -> PathBuf {
    let prefix = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("prefix-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    let lib = common::cprog::lib_dir();
    run(Command::new(format!("{ROOT}/scripts/install.sh")).arg(&prefix).arg("--lib-dir").arg(&lib));
    prefix
}

/// Runs a built example: it prints `ok <NCCL version code>`.
fn check_example(exe: &Path) {
    let out = run(Command::new(exe).env_remove("LD_LIBRARY_PATH"));
    assert!(out.starts_with(&format!("ok {}", oxccl::NCCL_VERSION_CODE)), "{}: {out}", exe.display());
}

#[test]
fn pkg_config_finds_the_installed_library() {
    if !have("pkg-config") {
        common::skipped("pkg-config is not installed");
        return;
    }
    let prefix = install("pc");
    let lib = prefix.join("lib");
    // The installed files and SONAMEs.
    for f in ["include/nccl.h", "include/oxccl.h", "lib/libnccl.so.2", "lib/libnccl.so", "lib/liboxccl.so"] {
        assert!(prefix.join(f).exists(), "{f} not installed");
    }
    let soname = |f: &str| {
        let d = run(Command::new("readelf").arg("-d").arg(lib.join(f)));
        d.lines().find(|l| l.contains("SONAME")).map(|l| l.to_string()).unwrap_or_default()
    };
    let v = env!("CARGO_PKG_VERSION");
    let so = if v.starts_with("0.") {
        v.rsplit_once('.').unwrap().0.to_string()
    } else {
        v.split('.').next().unwrap().to_string()
    };
    assert!(soname("liboxccl.so").contains(&format!("[liboxccl.so.{so}]")), "{}", soname("liboxccl.so"));
    assert!(soname("libnccl.so.2").contains("[libnccl.so.2]"));
    assert!(lib.join(format!("liboxccl.so.{so}")).exists());
    for pkg in ["oxccl", "nccl"] {
        let flags = run(Command::new("pkg-config")
            .args(["--cflags", "--libs", pkg])
            .env("PKG_CONFIG_PATH", lib.join("pkgconfig")));
        assert!(flags.contains(&format!("-l{pkg}")), "{flags}");
        let exe = prefix.join(format!("example-{pkg}"));
        let mut cc = Command::new("cc");
        cc.arg(format!("{ROOT}/packaging/example/allreduce.c"))
            .args(flags.split_whitespace())
            .arg(format!("-Wl,-rpath,{}", lib.display()))
            .arg("-o")
            .arg(&exe);
        run(&mut cc);
        check_example(&exe);
    }
    let _ = std::fs::remove_dir_all(&prefix);
}

#[test]
fn cmake_find_package_finds_the_installed_library() {
    if !have("cmake") {
        common::skipped("cmake is not installed (scripts/test.sh installs it)");
        return;
    }
    let prefix = install("cmake");
    let build = prefix.join("build");
    std::fs::create_dir_all(&build).unwrap();
    run(Command::new("cmake")
        .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
        .arg(format!("{ROOT}/packaging/example"))
        .current_dir(&build));
    run(Command::new("cmake").args(["--build", "."]).current_dir(&build));
    check_example(&build.join("allreduce"));
    check_example(&build.join("allreduce_nccl"));
    let _ = std::fs::remove_dir_all(&prefix);
}
