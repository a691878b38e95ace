//! Kernels are compiled once per machine, not once per process: on the CUDA stand-in (whose
//! NVRTC counts as a compiler here), a first process compiles `cuda/reduce.cu` and stores the
//! image under `OXCCL_KERNEL_CACHE`; a second process loads it and compiles nothing (its
//! `OXCCL_DEBUG=INFO` log says so and has no "NVRTC compiled" line); a damaged entry is
//! refused with a WARN line and compiled again; `OXCCL_KERNEL_CACHE=0` always compiles and
//! writes nothing. An entry or a directory another user could have written (owned by another
//! uid, group- or world-writable, or a symbolic link) is never loaded: one WARN line and a
//! compile.

mod common;

use common::standin::standin_env;
use std::path::Path;
use std::time::Duration;

fn child() {
    let gpu = oxccl::device::gpu(0).expect("GPU 0 (the stand-in)");
    let _ctx = gpu.enter().unwrap();
    let k = gpu.kernels().expect("kernels");
    assert!(k.get(&oxccl::device::kernels::reduce_name(oxccl::DataType::Float32, oxccl::ReduceOp::Sum)).is_ok());
}

/// Runs the child once with `OXCCL_KERNEL_CACHE=cache`; returns its stderr.
fn run(cache: &str) -> String {
    run_in("a_second_process_compiles_nothing", cache)
}

/// Runs the child of test `entry` once with `OXCCL_KERNEL_CACHE=cache`; returns its stderr.
fn run_in(entry: &str, cache: &str) -> String {
    let mut env = standin_env();
    env.push(("OXCCL_KERNEL_CACHE", cache.to_string()));
    env.push(("OXCCL_DEBUG", "INFO".into()));
    let res = common::run_ranks(entry, 1, &env, Duration::from_secs(120));
    assert!(res[0].0, "child failed:\n{}", res[0].1);
    res[0].1.clone()
}

/// The images in `dir` (`*.bin`; the hidden compile locks beside them are not images).
fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "bin")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_second_process_compiles_nothing() {
    if common::child_role().is_some() {
        child();
        return;
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = dir.join("cache");
    let c = cache.display().to_string();

    let first = run(&c);
    assert!(first.contains("NVRTC compiled cuda/reduce.cu"), "the first process must compile:\n{first}");
    let files = entries(&cache);
    // Only what the child used: the set-up's probe (u8 divide/scale) and the f32 sum.
    assert_eq!(files.len(), 2, "two images stored: {files:?}");
    assert_eq!(first.matches("NVRTC compiled").count(), 2, "{first}");
    assert!(first.contains("(f32 sum)") && first.contains("(u8 divide/scale)"), "{first}");
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777, 0o700);
    }

    let second = run(&c);
    assert!(!second.contains("NVRTC compiled"), "the second process compiled:\n{second}");
    assert!(second.contains("nothing compiled"), "the second process did not load the cache:\n{second}");

    for f in &files {
        let mut data = std::fs::read(f).unwrap();
        let mid = data.len() / 2;
        data[mid] ^= 0x40;
        std::fs::write(f, &data).unwrap();
    }
    let third = run(&c);
    assert!(
        third.contains("damaged") && third.contains("NVRTC compiled"),
        "a damaged entry must be compiled again:\n{third}"
    );
    let fourth = run(&c);
    assert!(!fourth.contains("NVRTC compiled"), "the rewritten entry must load:\n{fourth}");

    let off = run("0");
    assert!(off.contains("NVRTC compiled"), "OXCCL_KERNEL_CACHE=0 must compile:\n{off}");
    assert!(!Path::new("0").exists(), "OXCCL_KERNEL_CACHE=0 is no directory");
    assert_eq!(entries(&cache).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several processes of one host starting on an empty cache compile each unit once between
/// them: one takes the entry's compile lock, the others wait and load its image.
#[test]
fn processes_starting_together_compile_once() {
    const NAME: &str = "processes_starting_together_compile_once";
    if common::child_role().is_some() {
        child();
        return;
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kcache-race-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut env = standin_env();
    env.push(("OXCCL_KERNEL_CACHE", dir.join("cache").display().to_string()));
    env.push(("OXCCL_DEBUG", "INFO".into()));
    // A cold stand-in compiler too, so that the compiles overlap.
    env.retain(|(k, _)| *k != "OXCCL_STANDIN_CACHE");
    env.push(("OXCCL_STANDIN_CACHE", dir.join("standin").display().to_string()));
    let res = common::run_ranks(NAME, 3, &env, Duration::from_secs(240));
    common::assert_all_ok(&res);
    let logs: String = res.iter().map(|r| r.1.as_str()).collect();
    assert_eq!(logs.matches("NVRTC compiled").count(), 2, "each of the 2 units compiled once:\n{logs}");
    assert_eq!(logs.matches("nothing compiled").count(), 4, "the other processes loaded both:\n{logs}");
    assert_eq!(entries(&dir.join("cache")).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Asserts that `log` (a child's stderr) compiled and loaded nothing from the cache, with a WARN
/// line containing `why`.
fn refused(log: &str, why: &str, what: &str) {
    assert!(
        log.contains("WARN")
            && log.contains(why)
            && log.contains("NVRTC compiled")
            && !log.contains("nothing compiled"),
        "{what}: the entry must be refused with a WARN naming \"{why}\" and compiled again:\n{log}"
    );
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn an_entry_another_user_could_have_written_is_not_loaded() {
    const NAME: &str = "an_entry_another_user_could_have_written_is_not_loaded";
    if common::child_role().is_some() {
        child();
        return;
    }
    let dir =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("kcache-plant-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = dir.join("cache");
    let c = cache.display().to_string();
    let run = |what: &str| -> String {
        let log = run_in(NAME, &c);
        eprintln!("-- {what}: {} log lines", log.lines().count());
        log
    };
    assert!(run("first").contains("NVRTC compiled"));
    let files = entries(&cache);
    assert!(!files.is_empty(), "the first process stores its images");
    assert!(run("warm").contains("nothing compiled"), "a private entry loads");
    // SAFETY: geteuid cannot fail.
    let root = unsafe { libc::geteuid() } == 0;

    // An entry owned by another user (the planted file keeps a valid in-file hash).
    if root {
        for f in &files {
            std::os::unix::fs::chown(f, Some(65534), Some(65534)).unwrap();
        }
        refused(&run("entry of uid 65534"), "not by this user", "an entry owned by uid 65534");
        assert!(run("rewritten").contains("nothing compiled"), "the compile replaced the planted entry");
    } else {
        common::skipped("kernel-cache entry owned by another uid (needs root to chown)");
    }

    // An entry that the group or anyone may write.
    for f in &files {
        chmod(f, 0o666);
    }
    refused(&run("entry mode 666"), "writable by others", "a world-writable entry");

    // An entry that is a symbolic link (to a valid image elsewhere).
    assert!(run("rewritten").contains("nothing compiled"));
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    for f in &files {
        let target = elsewhere.join(f.file_name().unwrap());
        std::fs::rename(f, &target).unwrap();
        std::os::unix::fs::symlink(&target, f).unwrap();
    }
    refused(&run("symlinked entry"), "symbolic link", "an entry behind a symbolic link");
    for f in &files {
        assert!(!std::fs::symlink_metadata(f).unwrap().file_type().is_symlink(), "the compile replaced the link");
    }

    // A directory anyone may write: neither read nor written.
    chmod(&cache, 0o777);
    let log = run("dir mode 777");
    refused(&log, "neither read nor written", "a world-writable cache directory");
    for f in &files {
        std::fs::remove_file(f).unwrap();
    }
    let log = run("dir mode 777, empty");
    refused(&log, "neither read nor written", "a world-writable cache directory");
    assert!(entries(&cache).is_empty(), "nothing is written into a world-writable directory");
    chmod(&cache, 0o700);

    // A directory owned by another user.
    if root {
        std::os::unix::fs::chown(&cache, Some(65534), None).unwrap();
        refused(&run("dir of uid 65534"), "neither read nor written", "a cache directory owned by uid 65534");
        assert!(entries(&cache).is_empty(), "nothing is written into another user's directory");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
