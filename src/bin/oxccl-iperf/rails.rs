//! `oxccl-iperf --rails`: each rail of a link between two hosts alone, then all of them striped,
//! as oxccl's own links carry them (TCP, or libfabric with `OXCCL_NET=ofi`).
//!
//! Run as rank 0 and rank 1 of a two-rank group from the launcher environment
//! (`OXCCL_RANK`/`OXCCL_NRANKS=2`, `MASTER_ADDR`/`MASTER_PORT`), with `OXCCL_SOCKET_IFNAME`
//! naming the rails. The two ranks first join with every rail (the striped link), tell each
//! other their rails, and time all-reduces of `--size` bytes (f32 sum) on it; then, for each
//! rail of rank 0, both start this program again with `OXCCL_SOCKET_IFNAME` naming that rail
//! alone (rank 1: its rail on the same subnet), meeting at rank 0's address on it (port
//! `MASTER_PORT + 1 + i`), and time the same all-reduces there. Rank 0 prints the table: per
//! setting, the median time and busbw (GB/s; for two ranks the bytes each way per second).

use oxccl::bootstrap::net::IfAddr;
use oxccl::{Communicator, ReduceOp};
use std::net::IpAddr;
use std::process::Command;
use std::time::Instant;

/// The variable that makes this program a child timing one rail.
const CHILD: &str = "OXCCL_IPERF_RAILS_CHILD";
/// Bytes per rank of the rail-list exchange.
const LIST: usize = 1024;

/// Median seconds of `iters` all-reduces of `size` bytes after `warmup` untimed ones.
fn time_all_reduce(comm: &Communicator, size: usize, iters: usize, warmup: usize) -> Result<f64, String> {
    let count = (size / 4).max(1);
    let send = vec![1.0f32; count];
    let mut recv = vec![0f32; count];
    let mut t = Vec::new();
    for i in 0..warmup + iters {
        let s = Instant::now();
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum).map_err(|e| e.to_string())?;
        if i >= warmup {
            t.push(s.elapsed().as_secs_f64());
        }
    }
    if recv.iter().any(|&v| v != comm.size() as f32) {
        return Err("wrong all-reduce result".into());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn encode(rails: &[IfAddr], rank: usize) -> Vec<u8> {
    let text: String = rails.iter().map(|r| format!("{} {} {}\n", r.name, r.addr, r.prefix)).collect();
    let mut out = vec![0u8; 2 * LIST];
    let b = text.as_bytes();
    let n = b.len().min(LIST);
    out[rank * LIST..rank * LIST + n].copy_from_slice(&b[..n]);
    out
}

fn decode(b: &[u8]) -> Vec<IfAddr> {
    let text = String::from_utf8_lossy(b);
    text.lines()
        .filter_map(|l| {
            let mut it = l.split(' ');
            let name = it.next()?.to_string();
            let addr: IpAddr = it.next()?.parse().ok()?;
            let prefix = it.next()?.parse().ok()?;
            Some(IfAddr { name, addr, prefix })
        })
        .collect()
}

/// The child: one all-reduce timing on the link the environment describes; prints `secs`.
pub fn child(size: usize, iters: usize, warmup: usize) -> Result<(), String> {
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let t = time_all_reduce(&comm, size, iters, warmup)?;
    println!("RAILSECS {t}");
    Ok(())
}

/// Whether this process is a child of [`main_rails`].
pub fn is_child() -> bool {
    oxccl::config::environ::raw(CHILD).is_some()
}

/// The parent (see the module docs).
pub fn main_rails(size: usize, iters: usize, warmup: usize) -> Result<(), String> {
    let cfg = oxccl::config::Config::from_env();
    if cfg.socket_ifname.is_none() {
        return Err("--rails needs OXCCL_SOCKET_IFNAME naming the rails (e.g. rail0,rail1)".into());
    }
    let mine = oxccl::transport::rails::local(&cfg);
    let comm = Communicator::from_env().map_err(|e| e.to_string())?;
    let (rank, n) = (comm.rank(), comm.size());
    if n != 2 {
        return Err(format!("--rails runs as one of two ranks (OXCCL_NRANKS=2), not {n}"));
    }
    let mut lists = vec![0u8; 2 * LIST];
    comm.all_reduce(&encode(&mine, rank), &mut lists, ReduceOp::Sum).map_err(|e| e.to_string())?;
    let (r0, r1) = (decode(&lists[..LIST]), decode(&lists[LIST..]));
    let striped = time_all_reduce(&comm, size, iters, warmup)?;
    let port: u16 = oxccl::config::environ::var("MASTER_PORT").and_then(|p| p.parse().ok()).unwrap_or(29500);
    let mut rows = Vec::new();
    for (i, a) in r0.iter().enumerate() {
        let Some(b) = r1.iter().find(|b| a.same_subnet(b.addr) && b.same_subnet(a.addr)) else { continue };
        let own = if rank == 0 { a } else { b };
        let out = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .args(["--size", &size.to_string(), "--iters", &iters.to_string(), "--warmup", &warmup.to_string()])
            .env(CHILD, "1")
            .env("OXCCL_SOCKET_IFNAME", format!("={}", own.name))
            .env_remove("NCCL_SOCKET_IFNAME")
            .env("MASTER_ADDR", a.addr.to_string())
            .env("MASTER_PORT", (port + 1 + i as u16).to_string())
            .output()
            .map_err(|e| format!("starting the timing of {}: {e}", own.name))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let secs = text.lines().find_map(|l| l.strip_prefix("RAILSECS ")).and_then(|s| s.parse::<f64>().ok());
        let Some(secs) = secs else {
            return Err(format!("the timing of {} failed: {}", own.name, String::from_utf8_lossy(&out.stderr)));
        };
        rows.push((format!("{} {} -> {} {}", a.name, a.addr, b.name, b.addr), secs));
    }
    // Both ranks are done with their children before rank 0 prints.
    let mut one = [0u8];
    comm.all_reduce(&[1u8], &mut one, ReduceOp::Sum).map_err(|e| e.to_string())?;
    if rank == 0 {
        let net = match &cfg.net {
            Ok(oxccl::config::NetMode::Ofi) => "ofi",
            _ => "socket",
        };
        println!("# oxccl-iperf --rails ({net}): all-reduce of {size} B (f32 sum), 2 ranks, median of {iters} (+{warmup} warm-up)");
        println!("{:<48} {:>10} {:>10}", "rails (rank 0 -> rank 1)", "time(ms)", "busbw GB/s");
        for (name, t) in &rows {
            println!("{name:<48} {:>10.1} {:>10.3}", t * 1e3, size as f64 / t / 1e9);
        }
        let alone: f64 = rows.iter().map(|(_, t)| size as f64 / t / 1e9).sum();
        println!("{:<48} {:>10.1} {:>10.3}", "striped (all rails)", striped * 1e3, size as f64 / striped / 1e9);
        if let Some((_, first)) = rows.first() {
            println!(
                "# striped / first rail alone {:.2}, striped / sum of the rails alone {:.2}",
                first / striped,
                size as f64 / striped / 1e9 / alone
            );
        }
    }
    Ok(())
}
