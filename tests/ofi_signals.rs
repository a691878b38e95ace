//! Loading libfabric keeps the application's signal dispositions: libinfinipath (linked by
//! libfabric's psm provider) installs handlers for SIGSEGV, SIGINT, SIGTERM, ... from its
//! constructor that write `*.btr` backtrace files into the working directory; the shim puts
//! the previous dispositions back (src/transport/ofi/shim.c).

mod common;

use std::process::Command;

const CHILD: &str = "OFI_SIGNALS_CHILD_DIR";

/// The signals libinfinipath takes over when it is loaded.
const SIGNALS: [i32; 6] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGABRT, libc::SIGINT, libc::SIGTERM];

fn handler(sig: i32) -> libc::sighandler_t {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a null new action only reads.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

/// In the child: in the temporary directory, probes libfabric's providers (the `auto` probe's
/// fi_getinfo), checks every disposition is still what it was, then crashes.
#[test]
fn probe_child() {
    let Ok(dir) = std::env::var(CHILD) else { return };
    std::env::set_current_dir(&dir).unwrap();
    // Rust's runtime has its own SIGSEGV and SIGBUS handlers (stack overflows): kept as well.
    let before = SIGNALS.map(handler);
    let found = oxccl::transport::ofi::providers(None);
    eprintln!("providers: {found:?}");
    for (sig, was) in SIGNALS.into_iter().zip(before) {
        assert_eq!(handler(sig), was, "signal {sig} was taken over by loading libfabric");
    }
    // SAFETY: raise(3) with a valid signal. Rust's handler puts the default action back on a
    // SIGSEGV that is no stack overflow and returns; the second one ends this child.
    unsafe {
        libc::raise(libc::SIGSEGV);
        libc::raise(libc::SIGSEGV);
    }
}

#[test]
fn an_ofi_probe_keeps_signal_dispositions_and_a_crash_leaves_no_btr_file() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var(CHILD).is_ok() {
        return;
    }
    if let Err(why) = oxccl::transport::ofi::loaded() {
        common::skipped(&why);
        return;
    }
    let dir = std::env::temp_dir().join(format!("oxccl-ofi-signals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["probe_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, &dir)
        .env_remove("IPATH_NO_BACKTRACE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let files: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "the child dies of its own SIGSEGV: {stderr}");
    assert!(files.iter().all(|f| !f.ends_with(".btr")), "crash files written: {files:?}\n{stderr}");
    assert!(files.is_empty(), "{files:?}");
}
