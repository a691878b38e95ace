//! The parent process: starts the local ranks (placing them on CPUs) and supervises them.

use super::args::{self, Opts};
use super::{usage_error, GRACE};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
/// Starts the local ranks of this run and supervises them; returns the exit status.
pub(crate) fn parent_main(opts: &Opts, args: &[String]) -> i32 {
    if opts.coll.has_root && opts.root >= opts.ranks {
        usage_error(&format!("--root {} is not below --ranks {}", opts.root, opts.ranks));
    }
    if oxccl::config::env("SOCKET_IFNAME").is_none() {
        // Still single-threaded here; the children inherit it, and so does our rendezvous root.
        std::env::set_var("OXCCL_SOCKET_IFNAME", "lo");
    }
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return parent_fail(&format!("cannot find own executable: {e}")),
    };
    let id = match oxccl::UniqueId::new() {
        Ok(id) => id,
        Err(e) => return parent_fail(&e.to_string()),
    };
    let hex = id.to_hex();
    let allowed = allowed_cpus();
    let cpus = if opts.bind.pins(opts.ranks, allowed.len().max(1)) { allowed } else { Vec::new() };
    let mut children = Vec::with_capacity(opts.ranks);
    for rank in 0..opts.ranks {
        let cpu = (!cpus.is_empty()).then(|| cpus[rank % cpus.len()]);
        match spawn_rank(&exe, args, &hex, rank, opts.ranks, cpu) {
            Ok(c) => children.push(c),
            Err(e) => {
                kill_all(&mut children);
                return parent_fail(&format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    // `id` (and with it the rendezvous root) stays alive until the ranks are done.
    wait_all(&mut children, opts.timeout)
}

fn parent_fail(msg: &str) -> i32 {
    eprintln!("oxccl-perf: {msg}");
    1
}

fn spawn_rank(
    exe: &Path,
    args: &[String],
    id_hex: &str,
    rank: usize,
    n: usize,
    cpu: Option<usize>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("OXCCL_UNIQUE_ID", id_hex)
        .env("OXCCL_RANK", rank.to_string())
        .env("OXCCL_NRANKS", n.to_string())
        .env("OXCCL_LOCAL_RANK", rank.to_string())
        .env(PLACED, if cpu.is_some() { "cpu" } else { "none" })
        .stdin(Stdio::null());
    die_with_parent(&mut cmd);
    if let Some(cpu) = cpu {
        bind_to_cpu(&mut cmd, cpu);
    }
    cmd.spawn()
}

/// The CPUs this process may run on, in increasing order (empty if the OS does not say).
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set; the kernel writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live, writable `cpu_set_t` of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    // SAFETY: `CPU_ISSET` only reads the set, for indices below its capacity.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Vec<usize> {
    Vec::new()
}

/// Makes the child run only on `cpu` (`--bind cpu`, or `auto` with a CPU per rank).
#[cfg(target_os = "linux")]
fn bind_to_cpu(cmd: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set, and `cpu` comes from
    // `allowed_cpus`, so it is below `CPU_SETSIZE`.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        set
    };
    // SAFETY: between fork and exec this makes one system call, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn bind_to_cpu(_: &mut Command, _: usize) {}

/// Environment variable through which the parent tells its ranks how it placed them.
const PLACED: &str = "OXCCL_PERF_PLACED";

/// How the ranks of this run were placed, in words, for the header.
pub(crate) fn binding_note(o: &Opts) -> &'static str {
    match oxccl::config::environ::raw(PLACED).as_deref() {
        Some("cpu") => "one CPU per rank, as mpirun's default",
        Some(_) if o.bind == args::Bind::None => "none",
        Some(_) => "none (more ranks than CPUs, as mpirun when oversubscribed)",
        None => "set by the launcher",
    }
}

/// CPUs this process may run on.
pub(crate) fn own_cpus() -> usize {
    allowed_cpus().len()
}

/// Makes a child get SIGKILL if this process dies, so ranks are never orphaned.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec this calls only async-signal-safe functions.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_: &mut Command) {}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn exit_code(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

/// Waits for every rank; returns the first non-zero status. After a failure the others get
/// `GRACE` to exit, then are killed; past `timeout` all are killed.
fn wait_all(children: &mut [Child], timeout: Option<Duration>) -> i32 {
    let start = Instant::now();
    let mut done = vec![false; children.len()];
    let mut first_bad: Option<(i32, Instant)> = None;
    loop {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r] {
                continue;
            }
            let code = match c.try_wait() {
                Ok(Some(s)) => exit_code(s),
                Ok(None) => continue,
                Err(_) => 1,
            };
            done[r] = true;
            if code != 0 && first_bad.is_none() {
                first_bad = Some((code, Instant::now()));
            }
        }
        if done.iter().all(|&d| d) {
            return first_bad.map_or(0, |b| b.0);
        }
        let grace_over = first_bad.is_some_and(|(_, t)| t.elapsed() > GRACE);
        let timed_out = timeout.is_some_and(|t| start.elapsed() > t);
        if grace_over || timed_out {
            if timed_out && first_bad.is_none() {
                eprintln!("oxccl-perf: timed out after {:?}; killing the ranks", start.elapsed());
            }
            let stuck: Vec<usize> = (0..children.len()).filter(|&r| !done[r]).collect();
            eprintln!("oxccl-perf: killing rank(s) {stuck:?}");
            kill_all(children);
            return first_bad.map_or(1, |b| b.0);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
