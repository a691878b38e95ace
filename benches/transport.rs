//! Point-to-point latency and bandwidth of each transport between two threads, and the cost of
//! a whole 2-rank all-reduce call per transport.
//!
//! * `pingpong_8B/{shm,tcp}`: round trip of an 8-byte message (both ends spin on the link).
//! * `stream_1MiB/{shm,tcp}`: one-way throughput, 1 MiB messages copied out of a 64 MiB
//!   buffer into another (so the data comes from memory, as a collective's would).
//! * `copy_64MiB/{memcpy,process_vm_readv}`: the single-copy candidate (cross-memory attach)
//!   beside a plain copy of the same buffers.
//! * `all_reduce_{8B,1MiB}/{1rank,shm,tcp}`: `Communicator::all_reduce` float32 sum, 2 ranks as
//!   threads (`1rank`: a single rank, i.e. the call's cost without any communication).
//!
//! Run with `cargo bench --bench transport -- --warm-up-time 1 --measurement-time 3`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use crossbeam::channel::{bounded, Receiver, Sender};
use oxccl::transport::shm::ShmLink;
use oxccl::transport::tcp::TcpLink;
use oxccl::transport::Link;
use oxccl::{Communicator, ReduceOp};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const STREAM_MSG: usize = 1 << 20;
const STREAM_BUF: usize = 64 << 20;

/// Two connected ends of the named transport.
fn pair(kind: &str) -> (Box<dyn Link>, Box<dyn Link>) {
    match kind {
        "shm" => {
            let (a, b) = ShmLink::pair(oxccl::transport::shm::ring_capacity()).expect("shm pair");
            (Box::new(a), Box::new(b))
        }
        _ => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let b = l.accept().unwrap().0;
            (Box::new(TcpLink::new(a, 1).unwrap()), Box::new(TcpLink::new(b, 0).unwrap()))
        }
    }
}

/// Spins on a link like the engine does: pure spinning first, then yielding the core on each
/// try (with more threads than cores, the peer may need this one).
struct Spin(u32);

impl Spin {
    fn idle(&mut self) {
        self.0 += 1;
        if self.0 < 2000 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn send_all(l: &mut dyn Link, mut buf: &[u8]) {
    let mut spin = Spin(0);
    while !buf.is_empty() {
        let n = l.try_send(buf).expect("send");
        buf = &buf[n..];
        if n == 0 {
            spin.idle();
        }
    }
}

fn recv_all(l: &mut dyn Link, mut buf: &mut [u8]) {
    let mut spin = Spin(0);
    while !buf.is_empty() {
        let n = l.try_recv(buf).expect("recv");
        buf = &mut buf[n..];
        if n == 0 {
            spin.idle();
        }
    }
}

/// A helper thread that runs `job(link, n)` for every `n` it is sent (0 ends it).
fn helper(mut link: Box<dyn Link>, job: fn(&mut dyn Link, u64)) -> (Sender<u64>, std::thread::JoinHandle<()>) {
    let (tx, rx): (Sender<u64>, Receiver<u64>) = bounded(1);
    let h = std::thread::spawn(move || {
        while let Ok(n) = rx.recv() {
            if n == 0 {
                break;
            }
            job(link.as_mut(), n);
        }
    });
    (tx, h)
}

fn echo(l: &mut dyn Link, n: u64) {
    let mut b = [0u8; 8];
    for _ in 0..n {
        recv_all(l, &mut b);
        send_all(l, &b);
    }
}

fn sink(l: &mut dyn Link, n: u64) {
    let mut dst = vec![0u8; STREAM_BUF];
    for i in 0..n as usize {
        let off = (i * STREAM_MSG) % STREAM_BUF;
        recv_all(l, &mut dst[off..off + STREAM_MSG]);
    }
    send_all(l, &[1]);
}

fn point_to_point(c: &mut Criterion) {
    let mut g = c.benchmark_group("pingpong_8B");
    for kind in ["shm", "tcp"] {
        let (mut a, b) = pair(kind);
        let (tx, h) = helper(b, echo);
        g.bench_function(kind, |bench| {
            bench.iter_custom(|iters| {
                tx.send(iters).unwrap();
                let mut m = [7u8; 8];
                let t = Instant::now();
                for _ in 0..iters {
                    send_all(a.as_mut(), &m);
                    recv_all(a.as_mut(), &mut m);
                }
                t.elapsed()
            })
        });
        tx.send(0).unwrap();
        h.join().unwrap();
    }
    g.finish();

    let mut g = c.benchmark_group("stream_1MiB");
    g.throughput(Throughput::Bytes(STREAM_MSG as u64));
    let src: Vec<u8> = (0..STREAM_BUF).map(|i| i as u8).collect();
    for kind in ["shm", "tcp"] {
        let (mut a, b) = pair(kind);
        let (tx, h) = helper(b, sink);
        g.bench_function(kind, |bench| {
            bench.iter_custom(|iters| {
                tx.send(iters).unwrap();
                let t = Instant::now();
                for i in 0..iters as usize {
                    let off = (i * STREAM_MSG) % STREAM_BUF;
                    send_all(a.as_mut(), &src[off..off + STREAM_MSG]);
                }
                recv_all(a.as_mut(), &mut [0u8; 1]);
                t.elapsed()
            })
        });
        tx.send(0).unwrap();
        h.join().unwrap();
    }
    g.finish();
}

/// `process_vm_readv` from this very process: the same kernel path a peer would take.
fn cma_copy(dst: &mut [u8], src: &[u8]) {
    let local = libc::iovec { iov_base: dst.as_mut_ptr().cast(), iov_len: dst.len() };
    let remote = libc::iovec { iov_base: src.as_ptr() as *mut _, iov_len: src.len() };
    // SAFETY: both iovecs describe live buffers of this process of the given lengths.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    assert_eq!(n, src.len() as isize, "process_vm_readv: {}", std::io::Error::last_os_error());
}

fn single_copy(c: &mut Criterion) {
    let mut g = c.benchmark_group("copy_64MiB");
    let len = 64 << 20;
    g.throughput(Throughput::Bytes(len as u64));
    let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
    let mut dst = vec![0u8; len];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(&src)));
    g.bench_function("process_vm_readv", |b| b.iter(|| cma_copy(&mut dst, &src)));
    g.finish();
}

/// Two communicators (ranks as threads of this process) over `transport`.
fn comms(transport: &str) -> (Communicator, Communicator) {
    std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    std::env::set_var("OXCCL_TRANSPORT", transport);
    let id = oxccl::UniqueId::new().expect("unique id");
    let other = std::thread::spawn(move || Communicator::init_rank(2, &id, 1).expect("rank 1"));
    let me = Communicator::init_rank(2, &id, 0).expect("rank 0");
    (me, other.join().unwrap())
}

fn all_reduce(c: &mut Criterion) {
    for (name, count) in [("all_reduce_8B", 2usize), ("all_reduce_1MiB", 1 << 18)] {
        let mut g = c.benchmark_group(name);
        g.throughput(Throughput::Bytes(4 * count as u64));
        // One rank: no communication at all, i.e. the library's own cost per call.
        let solo = Communicator::in_memory(1).pop().unwrap();
        let (send, mut recv) = (vec![1f32; count], vec![0f32; count]);
        g.bench_function("1rank", |b| b.iter(|| solo.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap()));
        for kind in ["shm", "tcp"] {
            let (me, other) = comms(kind);
            let (tx, rx) = bounded::<u64>(1);
            let h = std::thread::spawn(move || {
                let send = vec![1f32; count];
                let mut recv = vec![0f32; count];
                while let Ok(n) = rx.recv() {
                    for _ in 0..n {
                        other.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                    }
                }
            });
            let send = vec![2f32; count];
            let mut recv = vec![0f32; count];
            g.bench_function(BenchmarkId::from_parameter(kind), |b| {
                b.iter_custom(|iters| {
                    tx.send(iters).unwrap();
                    let t = Instant::now();
                    for _ in 0..iters {
                        me.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                    }
                    t.elapsed()
                })
            });
            assert!(recv.iter().all(|&x| x == 3.0), "all-reduce result");
            drop(tx);
            h.join().unwrap();
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = point_to_point, single_copy, all_reduce
}
criterion_main!(benches);
