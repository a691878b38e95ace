//! Failures during device collectives, on the CUDA stand-in (`cuda-standin/`): `kill -9` of a
//! rank during a device broadcast or a send/receive ring fails every survivor within 2 s, SIGSTOP during a device
//! all-gather within OXCCL_TIMEOUT_MS + 1 s, both on the one-shot IPC path (one host) and on the
//! staged path (fake hosts, `OXCCL_HOSTID`); a device group that fails its checks on the proxy
//! thread releases the stream and reports the error.

mod common;
#[path = "common/devcase.rs"]
mod devcase;

use common::standin::{standin_env, wait_async_error, DevMem};
use cudarc::driver::result;
use devcase::{finish, join, last_error, ok, run, serial, Red};
use oxccl::ffi::coll::{ncclAllGather, ncclBroadcast, ncclRecv, ncclSend};
use oxccl::ffi::comm::ncclCommDestroy;
use oxccl::ffi::group::{ncclGroupEnd, ncclGroupStart};
use oxccl::ffi::ncclResult_t;
use oxccl::{Collective, DataType, ReduceOp};
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// One good broadcast (checked), then rank n-1 kills itself with SIGKILL while the
/// others are in their next broadcast: every survivor's stream completes and the error shows
/// within 2 s (OXCCL_TIMEOUT_MS is 60 s: the death is detected, not timed out).
fn kill_rank(rank: usize, n: usize, id: &str) {
    let (mut r, _ctx) = join(rank, n, id);
    let c =
        r.case(Collective::Broadcast { root: 0 }, DataType::Float32, Red::Op(ReduceOp::Sum), 5_000, true, 1, 0).fetch();
    finish(&r, &[c]);
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: kills this process, as `kill -9` would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    let (buf, other) = (DevMem::new(4 << 20), DevMem::new(4 << 20));
    let st = r.streams[0];
    let res = if std::env::var("OXCCL_TEST_KILL_P2P").is_ok_and(|v| v == "1") {
        // A send/receive ring (one group): send to the right, receive from the left.
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        ok(ncclGroupStart(), r.comm, "ncclGroupStart");
        let (d, c) = (DataType::Float32 as i32, r.comm);
        ok(ncclSend(buf.0 as *const c_void, 1 << 20, d, right as i32, c, st.cast()), c, "ncclSend");
        ok(ncclRecv(other.0 as *mut c_void, 1 << 20, d, left as i32, c, st.cast()), c, "ncclRecv");
        ncclGroupEnd()
    } else {
        ncclBroadcast(
            buf.0 as *const c_void,
            buf.0 as *mut c_void,
            1 << 20,
            DataType::Float32 as i32,
            0,
            r.comm,
            st.cast(),
        )
    };
    if res == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        let _ = unsafe { result::stream::synchronize(st) };
    }
    let e = wait_async_error(r.comm, Duration::from_secs(10));
    let took = t.elapsed();
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error after a peer was killed");
    assert!(took < Duration::from_secs(2), "rank {rank}: the stream completed and the error showed after {took:?}");
    eprintln!("rank {rank}: peer death reported after {took:?}: {}", last_error(r.comm));
    r.dev_scalars.clear();
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

#[test]
fn kill_9_of_a_rank_during_a_device_collective_fails_every_survivor_within_2s() {
    if let Some((rank, n, id)) = common::child_role() {
        kill_rank(rank, n, &id);
        return;
    }
    let entry = "kill_9_of_a_rank_during_a_device_collective_fails_every_survivor_within_2s";
    // One host: the one-shot IPC broadcast and the IPC send/receive exchange (the watchdog sees
    // the death); fake hosts: staged.
    for (hosts, p2p, path) in [("0", "0", "ipc"), ("1", "0", "staged"), ("0", "1", "ipc")] {
        let extra = [
            ("OXCCL_TIMEOUT_MS", "60000".to_string()),
            ("OXCCL_TEST_FAKE_HOSTS", hosts.to_string()),
            ("OXCCL_TEST_KILL_P2P", p2p.to_string()),
        ];
        let res = run(entry, 3, &extra, Duration::from_secs(120));
        assert!(!res[2].0, "the killed rank cannot succeed");
        common::assert_all_ok(&res[..2]);
        for (i, (_, err)) in res[..2].iter().enumerate() {
            let what = if p2p == "1" { "p2p group" } else { "broadcast" };
            let line = format!("device {what} path: {path}");
            assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
            assert!(!err.contains("DEADLOCK"), "rank {i}:\n{err}");
            let Some(report) = err.lines().find(|l| l.contains("peer death reported after")) else {
                panic!("rank {i}: no report:\n{err}")
            };
            eprintln!("{what} {path}: {report}");
        }
    }
}

/// The OXCCL_TIMEOUT_MS of the SIGSTOP tests.
const STOP_TIMEOUT: Duration = Duration::from_millis(3000);

/// One good all-gather (checked), then rank n-1 stops itself with SIGSTOP (alive, silent)
/// while the others are in their next all-gather: every survivor's stream completes and the
/// error shows within OXCCL_TIMEOUT_MS + 1 s of the call. On one host the all-gather runs the
/// one-shot IPC flow (the watchdog times it out); across fake hosts it is staged (the host
/// links time out on the proxy thread).
fn stop_rank(rank: usize, n: usize, id: &str) {
    let (mut r, _ctx) = join(rank, n, id);
    let c = r.case(Collective::AllGather, DataType::Float32, Red::Op(ReduceOp::Sum), 3_000, false, 1, 0).fetch();
    finish(&r, &[c]);
    if rank == n - 1 {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: stops this process, as `kill -STOP` would; the parent kills it at the end.
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        unreachable!("rank {rank} was continued");
    }
    let t = Instant::now();
    let (send, recv) = (DevMem::new(1 << 20), DevMem::new(n << 20));
    let st = r.streams[0];
    let res = ncclAllGather(
        send.0 as *const c_void,
        recv.0 as *mut c_void,
        1 << 18,
        DataType::Float32 as i32,
        r.comm,
        st.cast(),
    );
    if res == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        let _ = unsafe { result::stream::synchronize(st) };
    }
    let e = wait_async_error(r.comm, STOP_TIMEOUT + Duration::from_secs(10));
    let took = t.elapsed();
    assert_ne!(e, ncclResult_t::ncclSuccess, "rank {rank}: no error while a peer was stopped");
    let bound = STOP_TIMEOUT + Duration::from_secs(1);
    assert!(took < bound, "rank {rank}: the stream completed and the error showed after {took:?} (bound {bound:?})");
    eprintln!("rank {rank}: stopped peer reported after {took:?}: {}", last_error(r.comm));
    r.dev_scalars.clear();
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

/// Runs `stop_rank` on 3 ranks: waits for the two survivors, then kills the stopped rank.
fn run_stopped(fake_hosts: bool, path: &str) {
    let entry = "sigstop_of_a_rank_during_a_device_collective_fails_every_survivor_within_timeout_plus_1s";
    let _one = serial();
    let mut env = standin_env();
    env.push(("OXCCL_DEBUG", "INFO".into()));
    env.push(("OXCCL_CUDA_IPC_BUFFER", "65536".into()));
    env.push(("OXCCL_TIMEOUT_MS", STOP_TIMEOUT.as_millis().to_string()));
    env.push(("OXCCL_TEST_FAKE_HOSTS", if fake_hosts { "1" } else { "0" }.into()));
    let mut children = common::spawn_ranks(entry, 3, &env);
    let mut stopped = children.pop().expect("three ranks");
    let start = Instant::now();
    while children.iter_mut().any(|c| c.try_wait().ok().flatten().is_none())
        && start.elapsed() < Duration::from_secs(90)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = stopped.kill();
    let _ = stopped.wait();
    let res = common::wait_all(children, Duration::from_secs(5));
    common::assert_all_ok(&res);
    for (i, (_, err)) in res.iter().enumerate() {
        let line = format!("device all_gather path: {path}");
        assert!(err.contains(&line), "rank {i}: expected {line:?}:\n{err}");
        let Some(report) = err.lines().find(|l| l.contains("stopped peer reported after")) else {
            panic!("rank {i}: no report:\n{err}")
        };
        eprintln!("{path}: {report}");
        assert!(!err.contains("DEADLOCK"), "rank {i}:\n{err}");
    }
}

#[test]
fn sigstop_of_a_rank_during_a_device_collective_fails_every_survivor_within_timeout_plus_1s() {
    if let Some((rank, n, id)) = common::child_role() {
        stop_rank(rank, n, &id);
        return;
    }
    run_stopped(false, "ipc");
    run_stopped(true, "staged");
}

/// A device group whose plan fails its checks (a send to itself without the matching receive),
/// on the proxy thread or when planning the IPC exchange: the stream is released and the
/// communicator reports the error.
fn unpaired_rank(rank: usize, n: usize, id: &str) {
    let (r, _ctx) = join(rank, n, id);
    let buf = DevMem::new(4096);
    let st = r.streams[0];
    ok(ncclGroupStart(), r.comm, "ncclGroupStart");
    let sent = ncclSend(buf.0 as *const c_void, 1024, DataType::Float32 as i32, rank as i32, r.comm, st.cast());
    ok(sent, r.comm, "ncclSend");
    let ended = ncclGroupEnd();
    if ended == ncclResult_t::ncclSuccess {
        // SAFETY: a live stream of the current context.
        unsafe { result::stream::synchronize(st) }.expect("the stream must be released");
    }
    let e = wait_async_error(r.comm, Duration::from_secs(10));
    assert!(ended != ncclResult_t::ncclSuccess || e != ncclResult_t::ncclSuccess, "no error reported");
    let msg = last_error(r.comm);
    // On the IPC path the failing rank fails the communicator: a peer may report that first.
    assert!(msg.contains("to itself") || msg.contains("failed"), "unexpected error: {msg}");
    eprintln!("rank {rank}: reported: {msg}");
    assert_eq!(ncclCommDestroy(r.comm), ncclResult_t::ncclSuccess);
}

#[test]
fn an_unpaired_device_send_to_itself_in_a_group_is_reported() {
    if let Some((rank, n, id)) = common::child_role() {
        unpaired_rank(rank, n, &id);
        return;
    }
    // One rank: staged (the host plan refuses it on the proxy thread); two ranks on one host:
    // the IPC exchange refuses it when planning, and fails the communicator.
    for (n, path) in [(1, "staged"), (2, "ipc")] {
        let res = run("an_unpaired_device_send_to_itself_in_a_group_is_reported", n, &[], Duration::from_secs(60));
        common::assert_all_ok(&res);
        // The rank whose plan failed first took the path and reports its own error.
        let line = format!("device send path: {path}");
        let own = |err: &String| err.lines().any(|l| l.contains("reported: ") && l.contains("to itself"));
        assert!(res.iter().any(|(_, err)| err.contains(&line) && own(err)), "no rank reported {line:?}: {res:?}");
    }
}
