//! Hardening (issue [K]): no signal kills a C host, handles are never reused, group/destroy
//! ordering and concurrent use are refused, strangers cannot stall a job.

mod common;

use common::cprog::build_c;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs a C test program with extra environment variables; asserts it exits 0 (not by a
/// signal) within `limit`, and returns its stderr.
fn run_c_env(exe: &std::path::Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> String {
    let mut c = Command::new(exe);
    c.args(args)
        .env("OXCCL_SOCKET_IFNAME", "lo")
        .env("OXCCL_TIMEOUT_MS", "60000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let res = common::wait_all(vec![c.spawn().expect("run C test")], limit);
    common::assert_all_ok(&res);
    res.into_iter().next().map(|r| r.1).unwrap_or_default()
}

#[test]
fn c_host_with_default_sigpipe_survives_its_peers_death() {
    let exe = build_c("sigpipe");
    for transport in ["tcp", "shm"] {
        // Several rounds: the kill lands at a different point of the transfer each time.
        for (round, n) in ["2", "3", "2"].into_iter().enumerate() {
            let err = run_c_env(&exe, &[n], &[("OXCCL_TRANSPORT", transport)], Duration::from_secs(120));
            assert!(err.contains("with the dead rank failed after"), "{transport} round {round}: {err}");
        }
    }
}

/// Environment variable that makes this test binary a child of
/// [`library_socket_writes_never_raise_sigpipe`]: `control` or `library`.
const SIGPIPE_CHILD: &str = "OXCCL_TEST_SIGPIPE_CHILD";

/// A connected loopback socket whose peer reset the connection and whose pending error was
/// already read: every later write fails with EPIPE, which raises SIGPIPE unless the write
/// says MSG_NOSIGNAL.
fn broken_socket() -> std::net::TcpStream {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.write_all(b"unread").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    drop(b); // closed with unread bytes: the kernel answers with a reset
    std::thread::sleep(Duration::from_millis(50));
    let mut buf = [0u8; 8];
    let r = a.read(&mut buf);
    assert!(r.is_err(), "reading after the reset should fail (consuming the error), got {r:?}");
    a
}

/// The child's body: `control` makes a plain writev(2) on a broken socket (the process must
/// die of SIGPIPE, which shows the setup provokes it); `library` drives every socket-writing
/// path of the library into the same state (each must return an error).
fn sigpipe_child(mode: &str) -> ! {
    use oxccl::transport::Link;
    // SAFETY: restores the default action, as a C host has it; no handler is installed.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let big = vec![5u8; 64 << 10];
    if mode == "control" {
        use std::os::fd::AsRawFd;
        let s = broken_socket();
        let iov = [libc::iovec { iov_base: big.as_ptr() as *mut libc::c_void, iov_len: big.len() }];
        // SAFETY: one valid iovec over `big`, which outlives the call.
        unsafe { libc::writev(s.as_raw_fd(), iov.as_ptr(), 1) };
        std::process::exit(3); // not reached when SIGPIPE kills the process
    }
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send_vectored(&[&big[..10], &big[..]]).is_err(), "vectored send (writev path)");
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send_vectored(&[&big[..10], &big[..100]]).is_err(), "small vectored send");
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    assert!(link.try_send(&big).is_err(), "send");
    let mut link = oxccl::transport::tcp::TcpLink::new(broken_socket(), 1).unwrap();
    link.send_abort(b"frame", true, Duration::from_millis(20));
    let mut s = broken_socket();
    assert!(oxccl::bootstrap::wire::write_frame(&mut s, &big).is_err(), "bootstrap frame");
    std::process::exit(0);
}

#[test]
fn library_socket_writes_never_raise_sigpipe() {
    if let Ok(mode) = std::env::var(SIGPIPE_CHILD) {
        sigpipe_child(&mode);
    }
    let exe = std::env::current_exe().unwrap();
    let run = |mode: &str| {
        Command::new(&exe)
            .args(["library_socket_writes_never_raise_sigpipe", "--exact", "--nocapture", "--test-threads=1"])
            .env(SIGPIPE_CHILD, mode)
            .output()
            .expect("run child")
    };
    use std::os::unix::process::ExitStatusExt;
    let control = run("control");
    assert_eq!(
        control.status.signal(),
        Some(libc::SIGPIPE),
        "the control writev did not die of SIGPIPE ({:?}): the test's setup is broken",
        control.status
    );
    let lib = run("library");
    assert!(
        lib.status.success(),
        "a library write raised a signal or failed: {:?}\n{}",
        lib.status,
        String::from_utf8_lossy(&lib.stderr)
    );
}

#[test]
fn c_handles_never_reused_destroy_in_group_and_two_threads_refused() {
    let exe = build_c("misuse");
    run_c_env(&exe, &["2"], &[], Duration::from_secs(120));
}
