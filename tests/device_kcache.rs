//! Kernels are compiled once per machine, not once per process: on the CUDA stand-in (whose
//! NVRTC counts as a compiler here), a first process compiles `cuda/reduce.cu` and stores the
//! image under `OXCCL_KERNEL_CACHE`; a second process loads it and compiles nothing (its
//! `OXCCL_DEBUG=INFO` log says so and has no "NVRTC compiled" line); a damaged entry is
//! refused with a WARN line and compiled again; `OXCCL_KERNEL_CACHE=0` always compiles and
//! writes nothing.

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
    let mut env = standin_env();
    env.push(("OXCCL_KERNEL_CACHE", cache.to_string()));
    env.push(("OXCCL_DEBUG", "INFO".into()));
    let res = common::run_ranks("a_second_process_compiles_nothing", 1, &env, Duration::from_secs(120));
    assert!(res[0].0, "child failed:\n{}", res[0].1);
    res[0].1.clone()
}

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir).map(|d| d.map(|e| e.unwrap().path()).collect()).unwrap_or_default();
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
    assert_eq!(files.len(), 1, "one image stored: {files:?}");
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777, 0o700);
    }

    let second = run(&c);
    assert!(!second.contains("NVRTC compiled"), "the second process compiled:\n{second}");
    assert!(second.contains("nothing compiled"), "the second process did not load the cache:\n{second}");

    let mut data = std::fs::read(&files[0]).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x40;
    std::fs::write(&files[0], &data).unwrap();
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
    assert_eq!(entries(&cache).len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
}
