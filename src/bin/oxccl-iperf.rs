//! oxccl-iperf: raw full-duplex TCP throughput, the ceiling that oxccl's TCP collectives are
//! compared with in docs/PERFORMANCE.md.
//!
//! Both ends send `--size` bytes to each other at the same time over `--streams` connections
//! (one writer and one reader thread per connection and end), `--iters` times; the result is
//! bytes per direction divided by the time, in GB/s (1 GB = 1e9 B), median over iterations.
//! Data is sent from and received into buffers of the full size, as a collective does (a
//! small, cache-resident buffer, as classic iperf uses, is faster: `--buf 1M`).
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

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

struct Opts {
    size: usize,
    iters: usize,
    streams: usize,
    listen: Option<String>,
    connect: Option<String>,
    buf: Option<usize>,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts { size: 128 << 20, iters: 5, streams: 1, listen: None, connect: None, buf: None };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--size" | "-s" => o.size = oxccl::config::parse_size(&val()?).ok_or("bad --size")? as usize,
            "--iters" | "-n" => o.iters = val()?.parse().map_err(|_| "bad --iters")?,
            "--streams" | "-P" => o.streams = val()?.parse().map_err(|_| "bad --streams")?,
            "--listen" => o.listen = Some(val()?),
            "--buf" => o.buf = Some(oxccl::config::parse_size(&val()?).ok_or("bad --buf")? as usize),
            "--connect" => o.connect = Some(val()?),
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
/// streams for a full-duplex pair); returns the seconds taken.
fn exchange(out: &[TcpStream], inn: &[TcpStream], size: usize, bufs: &mut Bufs) -> std::io::Result<f64> {
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

fn run(o: &Opts) -> std::io::Result<Vec<f64>> {
    let mut times = Vec::new();
    let per = o.buf.unwrap_or(o.size.div_ceil(o.streams));
    let (mut ba, mut bb) = (Bufs::new(o.streams, per), Bufs::new(o.streams, per));
    match (&o.listen, &o.connect) {
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
            let inn = accept_streams(&l, o.streams)?;
            for _ in 0..o.iters {
                times.push(exchange(&out, &inn, o.size, &mut ba)?);
            }
        }
        (Some(addr), None) => {
            let l = TcpListener::bind(addr)?;
            let socks = accept_streams(&l, o.streams)?;
            for _ in 0..o.iters {
                times.push(exchange(&socks, &socks, o.size, &mut ba)?);
            }
        }
        (None, Some(addr)) => {
            let socks = connect_streams(addr, o.streams)?;
            for _ in 0..o.iters {
                times.push(exchange(&socks, &socks, o.size, &mut ba)?);
            }
        }
        (None, None) => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            let addr = l.local_addr()?.to_string();
            let (a, b) = std::thread::scope(|sc| {
                let h = sc.spawn(|| accept_streams(&l, o.streams));
                let a = connect_streams(&addr, o.streams);
                (a, h.join().unwrap_or_else(|_| Err(std::io::Error::other("accept panicked"))))
            });
            let (a, b) = (a?, b?);
            for _ in 0..o.iters {
                let (ta, tb) = std::thread::scope(|sc| {
                    let h = sc.spawn(|| exchange(&b, &b, o.size, &mut bb));
                    (
                        exchange(&a, &a, o.size, &mut ba),
                        h.join().unwrap_or_else(|_| Err(std::io::Error::other("panicked"))),
                    )
                });
                times.push(ta?.max(tb?));
            }
        }
    }
    Ok(times)
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\nusage: oxccl-iperf [--size 128M] [--iters 5] [--streams 1] [--buf BYTES] [--listen ADDR] [--connect ADDR]");
            std::process::exit(2);
        }
    };
    match run(&o) {
        Ok(mut t) => {
            t.sort_by(f64::total_cmp);
            let med = t[t.len() / 2];
            println!(
                "# oxccl-iperf {}: size {} B per direction, streams {}, iters {}\n{:>12} {:>10} {:>10}\n{:>12} {:>10.1} {:>10.3}",
                if o.listen.is_some() && o.connect.is_some() { "ring member" } else { "full duplex" },
                o.size,
                o.streams,
                o.iters,
                "size(B)",
                "time(us)",
                "GB/s",
                o.size,
                med * 1e6,
                o.size as f64 / med / 1e9
            );
        }
        Err(e) => {
            eprintln!("oxccl-iperf: {e}");
            std::process::exit(1);
        }
    }
}
