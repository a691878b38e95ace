//! oxccl-iperf: raw full-duplex TCP throughput, the ceiling that oxccl's TCP collectives are
//! compared with in docs/PERFORMANCE.md.
//!
//! Both ends send `--size` bytes to each other at the same time over `--streams` connections,
//! `--iters` times after `--warmup` untimed rounds; the result is bytes per direction divided by
//! the time, in GB/s (1 GB = 1e9 B), median over iterations. Data is sent from and received
//! into buffers of the full size, as a collective does (a small, cache-resident buffer, as
//! classic iperf uses, is faster: `--buf 1M`).
//!
//! Two ways of driving the sockets are measured, because neither is always faster on a small
//! machine: `threads` (a blocking writer and a blocking reader thread per connection and end,
//! as iperf does) and `poll` (one thread per end moving every connection with nonblocking calls
//! and poll(2), as oxccl's engine does). `--mode best` (the default) runs both, prints each, and
//! reports the faster as the result: the ceiling a collective is compared with.
//!
//! ```text
//! oxccl-iperf [--size 128M] [--iters 5] [--streams 1]                 # both ends in this process, loopback
//! oxccl-iperf --listen 0.0.0.0:5201 [--size ..] [--streams ..]         # one end (waits for the other)
//! oxccl-iperf --connect HOST:5201 [--size ..] [--streams ..]           # the other end
//! oxccl-iperf --listen MINE:5201 --connect NEXT:5201 [--size ..]       # one host of a ring
//! ```
//!
//! With both `--listen` and `--connect`, the host is one member of a ring, as in a ring
//! collective: it sends `--size` bytes to the next host (the one at `--connect`) while it
//! receives as many from the previous one (whichever connects to its `--listen` address).
//! Every host of the ring is started this way; each prints its own figure.
//!
//! `--rails` measures the rails of a link between two hosts through oxccl itself: each rail
//! alone and all of them striped, over TCP or, with `OXCCL_NET=ofi`, libfabric ([`rails`]):
//!
//! ```text
//! OXCCL_RANK=R OXCCL_NRANKS=2 MASTER_ADDR=HOST0 MASTER_PORT=P OXCCL_SOCKET_IFNAME=rail0,rail1 \
//!     oxccl-iperf --rails [--size 64M] [--iters 5]            # on both hosts; rank 0 prints
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

#[path = "oxccl-iperf/rails.rs"]
mod rails;

/// How the sockets of one end are driven.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// A blocking writer and a blocking reader thread per connection.
    Threads,
    /// One thread, nonblocking sockets and poll(2).
    Poll,
}

struct Opts {
    size: usize,
    iters: usize,
    warmup: usize,
    modes: Vec<Mode>,
    streams: usize,
    listen: Option<String>,
    connect: Option<String>,
    buf: Option<usize>,
    rails: bool,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        size: 128 << 20,
        iters: 5,
        warmup: 1,
        modes: vec![Mode::Threads, Mode::Poll],
        streams: 1,
        listen: None,
        connect: None,
        buf: None,
        rails: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--size" | "-s" => o.size = oxccl::config::parse_size(&val()?).ok_or("bad --size")? as usize,
            "--iters" | "-n" => o.iters = val()?.parse().map_err(|_| "bad --iters")?,
            "--warmup" | "-w" => o.warmup = val()?.parse().map_err(|_| "bad --warmup")?,
            "--mode" => {
                o.modes = match val()?.as_str() {
                    "threads" => vec![Mode::Threads],
                    "poll" => vec![Mode::Poll],
                    "best" => vec![Mode::Threads, Mode::Poll],
                    m => return Err(format!("bad --mode {m} (threads, poll or best)")),
                }
            }
            "--streams" | "-P" => o.streams = val()?.parse().map_err(|_| "bad --streams")?,
            "--listen" => o.listen = Some(val()?),
            "--buf" => o.buf = Some(oxccl::config::parse_size(&val()?).ok_or("bad --buf")? as usize),
            "--connect" => o.connect = Some(val()?),
            "--rails" => o.rails = true,
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    if o.streams == 0 || o.iters == 0 {
        return Err("--streams and --iters must be at least 1".into());
    }
    Ok(o)
}

fn tune(s: &TcpStream) {
    let _ = oxccl::transport::tcp::tune(s);
}

/// Per-stream send and receive buffers, allocated once.
struct Bufs {
    send: Vec<Vec<u8>>,
    recv: Vec<Vec<u8>>,
}

impl Bufs {
    fn new(streams: usize, per: usize) -> Bufs {
        Bufs {
            send: (0..streams).map(|_| vec![1u8; per.max(1)]).collect(),
            recv: (0..streams).map(|_| vec![0u8; per.max(1)]).collect(),
        }
    }
}

/// Sends `size` bytes split over `out` while receiving as many split over `inn` (the same
/// streams for a full-duplex pair), driving the sockets as `mode` says; returns the seconds
/// taken.
fn exchange(mode: Mode, out: &[TcpStream], inn: &[TcpStream], size: usize, bufs: &mut Bufs) -> std::io::Result<f64> {
    match mode {
        Mode::Threads => exchange_threads(out, inn, size, bufs),
        Mode::Poll => exchange_poll(out, inn, size, bufs),
    }
}

/// [`exchange`] with one thread: nonblocking sockets, each moved as far as it goes whenever
/// poll(2) says it is ready.
fn exchange_poll(out: &[TcpStream], inn: &[TcpStream], size: usize, bufs: &mut Bufs) -> std::io::Result<f64> {
    let per = size.div_ceil(out.len());
    for s in out.iter().chain(inn) {
        s.set_nonblocking(true)?;
    }
    let (mut sent, mut got) = (vec![0usize; out.len()], vec![0usize; inn.len()]);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(out.len() + inn.len());
    let start = Instant::now();
    let result = loop {
        fds.clear();
        let pending_out = (0..out.len()).filter(|&i| sent[i] < per);
        fds.extend(pending_out.map(|i| libc::pollfd { fd: out[i].as_raw_fd(), events: libc::POLLOUT, revents: 0 }));
        let pending_in = (0..inn.len()).filter(|&i| got[i] < per);
        fds.extend(pending_in.map(|i| libc::pollfd { fd: inn[i].as_raw_fd(), events: libc::POLLIN, revents: 0 }));
        if fds.is_empty() {
            break Ok(start.elapsed().as_secs_f64());
        }
        // SAFETY: `fds` is a valid, initialised array of `fds.len()` pollfd entries that lives
        // across the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 30_000) };
        if rc == 0 {
            break Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no progress for 30 s"));
        }
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break Err(e);
        }
        // Move every socket as far as it goes, ready or not: a would-block costs one call.
        if let Err(e) = pump(out, &mut sent, per, |i, at, mut s| {
            let b = &bufs.send[i];
            let from = at % b.len();
            s.write(&b[from..b.len().min(from + per - at)])
        }) {
            break Err(e);
        }
        if let Err(e) = pump(inn, &mut got, per, |i, at, mut s| {
            let b = &mut bufs.recv[i];
            let from = at % b.len();
            let end = b.len().min(from + per - at);
            s.read(&mut b[from..end])
        }) {
            break Err(e);
        }
    };
    for s in out.iter().chain(inn) {
        s.set_nonblocking(false)?;
    }
    result
}

/// Calls `io(i, done[i], socket)` on each socket `i` until it would block or has moved `per`
/// bytes, adding what it moved to `done[i]`; a zero-byte result is the peer closing.
fn pump(
    socks: &[TcpStream],
    done: &mut [usize],
    per: usize,
    mut io: impl FnMut(usize, usize, &TcpStream) -> std::io::Result<usize>,
) -> std::io::Result<()> {
    for (i, s) in socks.iter().enumerate() {
        while done[i] < per {
            match io(i, done[i], s) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done[i] += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// [`exchange`] with a blocking writer and a blocking reader thread per connection.
fn exchange_threads(out: &[TcpStream], inn: &[TcpStream], size: usize, bufs: &mut Bufs) -> std::io::Result<f64> {
    let per = size.div_ceil(out.len());
    let start = Instant::now();
    std::thread::scope(|sc| -> std::io::Result<()> {
        let mut handles = Vec::new();
        for (((o, i), sb), rb) in out.iter().zip(inn).zip(&bufs.send).zip(bufs.recv.iter_mut()) {
            let mut w = o.try_clone()?;
            let mut r = i.try_clone()?;
            handles.push(sc.spawn(move || -> std::io::Result<()> {
                let mut left = per;
                while left > 0 {
                    let n = left.min(sb.len());
                    w.write_all(&sb[..n])?;
                    left -= n;
                }
                Ok(())
            }));
            handles.push(sc.spawn(move || -> std::io::Result<()> {
                let mut left = per;
                while left > 0 {
                    let n = left.min(rb.len());
                    r.read_exact(&mut rb[..n])?;
                    left -= n;
                }
                Ok(())
            }));
        }
        for h in handles {
            h.join().map_err(|_| std::io::Error::other("worker panicked"))??;
        }
        Ok(())
    })?;
    Ok(start.elapsed().as_secs_f64())
}

fn connect_streams(addr: &str, n: usize) -> std::io::Result<Vec<TcpStream>> {
    (0..n)
        .map(|_| {
            let s = TcpStream::connect(addr)?;
            tune(&s);
            Ok(s)
        })
        .collect()
}

fn accept_streams(l: &TcpListener, n: usize) -> std::io::Result<Vec<TcpStream>> {
    (0..n)
        .map(|_| {
            let (s, _) = l.accept()?;
            tune(&s);
            Ok(s)
        })
        .collect()
}

/// The seconds of each timed round (after the warm-up rounds) of every mode in `o.modes`, in
/// that order. Both ends (every member of a ring) run the same rounds in the same order.
fn run(o: &Opts) -> std::io::Result<Vec<(Mode, Vec<f64>)>> {
    let per = o.buf.unwrap_or(o.size.div_ceil(o.streams));
    let (mut ba, mut bb) = (Bufs::new(o.streams, per), Bufs::new(o.streams, per));
    // The streams this end sends on and receives on; in one process (no address), also the
    // other end's (which shares them for both directions).
    let (out, inn, other) = match (&o.listen, &o.connect) {
        (Some(mine), Some(next)) => {
            let l = TcpListener::bind(mine)?;
            // The next host may not listen yet: retry for up to 30 s.
            let deadline = Instant::now() + std::time::Duration::from_secs(30);
            let out = loop {
                match connect_streams(next, o.streams) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline && e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        std::thread::sleep(std::time::Duration::from_millis(20))
                    }
                    Err(e) => return Err(e),
                }
            };
            (out, accept_streams(&l, o.streams)?, None)
        }
        (Some(addr), None) => {
            let socks = accept_streams(&TcpListener::bind(addr)?, o.streams)?;
            (clone_all(&socks)?, socks, None)
        }
        (None, Some(addr)) => {
            let socks = connect_streams(addr, o.streams)?;
            (clone_all(&socks)?, socks, None)
        }
        (None, None) => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            let addr = l.local_addr()?.to_string();
            let (a, b) = std::thread::scope(|sc| {
                let h = sc.spawn(|| accept_streams(&l, o.streams));
                let a = connect_streams(&addr, o.streams);
                (a, h.join().unwrap_or_else(|_| Err(std::io::Error::other("accept panicked"))))
            });
            let a = a?;
            (clone_all(&a)?, a, Some(b?))
        }
    };
    let mut results = Vec::new();
    for &mode in &o.modes {
        let mut times = Vec::new();
        for round in 0..o.warmup + o.iters {
            let t = match &other {
                None => exchange(mode, &out, &inn, o.size, &mut ba)?,
                Some(b) => {
                    let (ta, tb) = std::thread::scope(|sc| {
                        let h = sc.spawn(|| exchange(mode, b, b, o.size, &mut bb));
                        (
                            exchange(mode, &out, &inn, o.size, &mut ba),
                            h.join().unwrap_or_else(|_| Err(std::io::Error::other("panicked"))),
                        )
                    });
                    ta?.max(tb?)
                }
            };
            if round >= o.warmup {
                times.push(t);
            }
        }
        results.push((mode, times));
    }
    Ok(results)
}

/// Second handles on `socks` (a full-duplex pair sends and receives on the same streams).
fn clone_all(socks: &[TcpStream]) -> std::io::Result<Vec<TcpStream>> {
    socks.iter().map(TcpStream::try_clone).collect()
}

/// The median of `t` (sorted in place).
fn median(t: &mut [f64]) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\nusage: oxccl-iperf [--size 128M] [--iters 5] [--warmup 1] [--streams 1] [--mode best|threads|poll] [--buf BYTES] [--listen ADDR] [--connect ADDR] | [--rails]");
            std::process::exit(2);
        }
    };
    if o.rails || rails::is_child() {
        let r = if rails::is_child() {
            rails::child(o.size, o.iters, o.warmup)
        } else {
            rails::main_rails(o.size, o.iters, o.warmup)
        };
        if let Err(e) = r {
            eprintln!("oxccl-iperf --rails: {e}");
            std::process::exit(1);
        }
        return;
    }
    match run(&o) {
        Ok(results) => {
            println!(
                "# oxccl-iperf {}: size {} B per direction, streams {}, iters {} (+{} warm-up)",
                if o.listen.is_some() && o.connect.is_some() { "ring member" } else { "full duplex" },
                o.size,
                o.streams,
                o.iters,
                o.warmup
            );
            // Each mode's median, then the faster one as the result line.
            let mut best = f64::INFINITY;
            for (mode, mut t) in results {
                let med = median(&mut t);
                println!(
                    "# mode {:<8} {:>10.1} us {:>10.3} GB/s",
                    format!("{mode:?}").to_lowercase(),
                    med * 1e6,
                    gbps(o.size, med)
                );
                best = best.min(med);
            }
            println!(
                "{:>12} {:>10} {:>10}\n{:>12} {:>10.1} {:>10.3}",
                "size(B)",
                "time(us)",
                "GB/s",
                o.size,
                best * 1e6,
                gbps(o.size, best)
            );
        }
        Err(e) => {
            eprintln!("oxccl-iperf: {e}");
            std::process::exit(1);
        }
    }
}

/// GB/s (1 GB = 1e9 B) of `bytes` in `secs`.
fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}
