//! Build script: sets liboxccl.so's SONAME, and generates the `pnccl*` profiling aliases that
//! NCCL exports beside every `nccl*` function (one thin wrapper per `#[no_mangle] extern "C"`
//! function of src/ffi, with the same signature), included by src/ffi/profiling.rs.
//!
//! With the `ofi` feature (default) and libfabric's headers present (`pkg-config libfabric`, or
//! `rdma/fabric.h` in the system include path), it also compiles src/transport/ofi/shim.c with
//! the C compiler (`$CC`, else `cc`) into a static library and sets the `oxccl_ofi` cfg. The
//! shim loads libfabric.so.1 at run time (dlopen), so the library never links to it. Cargo is
//! told to run this script again when the headers appear or go (see `find_headers`).

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,liboxccl.so");
    let dir = Path::new("src/ffi");
    println!("cargo:rerun-if-changed=src/ffi");
    let mut files: Vec<_> = std::fs::read_dir(dir).expect("src/ffi").filter_map(|e| e.ok()).map(|e| e.path()).collect();
    files.sort();
    let mut out = String::new();
    for f in files.iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
        let module = f.file_stem().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(f).expect("read src/ffi file");
        for (name, args, ret) in extern_fns(&text) {
            let names: Vec<&str> =
                args.split(',').filter_map(|a| a.split(':').next()).map(str::trim).filter(|a| !a.is_empty()).collect();
            let _ = writeln!(
                out,
                "/// Profiling alias of [`super::{module}::{name}`].\n#[no_mangle]\npub extern \"C\" fn p{name}({args}){ret} {{ super::{module}::{name}({}) }}\n",
                names.join(", ")
            );
        }
    }
    let dst = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("pnccl.rs");
    std::fs::write(dst, out).expect("write pnccl.rs");
    ofi_shim();
}

/// Compiles the libfabric shim where the headers exist; says why not otherwise.
fn ofi_shim() {
    println!("cargo:rustc-check-cfg=cfg(oxccl_ofi)");
    println!("cargo:rerun-if-changed=src/transport/ofi/shim.c");
    println!("cargo:rerun-if-env-changed=CC");
    if std::env::var_os("CARGO_FEATURE_OFI").is_none() {
        return;
    }
    let mut flags: Vec<String> = Vec::new();
    let found = match find_headers() {
        Headers::PkgConfig(f) => {
            flags = f;
            true
        }
        Headers::At(dir) => {
            if !["/usr/include", "/usr/local/include"].iter().any(|d| Path::new(d) == dir) {
                flags.push(format!("-I{}", dir.display()));
            }
            true
        }
        Headers::Missing => false,
    };
    if !found {
        println!(
            "cargo:warning=libfabric headers not found: the ofi transport is compiled out (install libfabric-dev and rebuild)"
        );
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let obj = out.join("ofi_shim.o");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-c", "-O2", "-fPIC", "-Wall", "-Wno-unused-function"])
        .args(&flags)
        .arg("src/transport/ofi/shim.c")
        .arg("-o")
        .arg(&obj)
        .status();
    if !status.is_ok_and(|s| s.success()) {
        println!(
            "cargo:warning=compiling src/transport/ofi/shim.c with {cc} failed: the ofi transport is compiled out"
        );
        return;
    }
    let lib = out.join("liboxccl_ofi.a");
    let _ = std::fs::remove_file(&lib);
    let ar = std::env::var("AR").unwrap_or_else(|_| "ar".into());
    if !std::process::Command::new(&ar).arg("crs").arg(&lib).arg(&obj).status().is_ok_and(|s| s.success()) {
        println!("cargo:warning=archiving the ofi shim with {ar} failed: the ofi transport is compiled out");
        return;
    }
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=oxccl_ofi");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-cfg=oxccl_ofi");
}

/// Where libfabric's headers were found.
enum Headers {
    /// `pkg-config --cflags libfabric` succeeded: its flags.
    PkgConfig(Vec<String>),
    /// `rdma/fabric.h` exists under this include directory.
    At(std::path::PathBuf),
    /// Neither.
    Missing,
}

/// Looks for libfabric's headers, and tells cargo what to watch so that the answer is
/// looked for again when it may change: pkg-config's search path, the header found, or (when
/// none was) the directories it would appear in. Installing libfabric-dev creates
/// `rdma/fabric.h` with the package's old modification time, so a missing header is watched
/// through its directory (whose own time changes when an entry is added), never as a file.
/// `OXCCL_LIBFABRIC_INCLUDE` (build time) replaces the system include directories searched.
fn find_headers() -> Headers {
    for var in ["PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "PKG_CONFIG_SYSROOT_DIR", "OXCCL_LIBFABRIC_INCLUDE"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let dirs: Vec<std::path::PathBuf> = match std::env::var_os("OXCCL_LIBFABRIC_INCLUDE") {
        Some(d) => std::env::split_paths(&d).collect(),
        None => {
            if let Ok(o) = std::process::Command::new("pkg-config").args(["--cflags", "libfabric"]).output() {
                if o.status.success() {
                    let flags: Vec<String> =
                        String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from).collect();
                    let mut inc: Vec<&str> = flags.iter().filter_map(|f| f.strip_prefix("-I")).collect();
                    inc.extend(["/usr/include", "/usr/local/include"]);
                    if let Some(h) = inc.iter().map(|d| Path::new(d).join("rdma/fabric.h")).find(|h| h.exists()) {
                        println!("cargo:rerun-if-changed={}", h.display());
                    }
                    return Headers::PkgConfig(flags);
                }
            }
            ["/usr/include", "/usr/local/include"].iter().map(std::path::PathBuf::from).collect()
        }
    };
    if let Some(d) = dirs.iter().find(|d| d.join("rdma/fabric.h").exists()) {
        println!("cargo:rerun-if-changed={}", d.join("rdma/fabric.h").display());
        return Headers::At(d.clone());
    }
    for d in &dirs {
        // The nearest existing directory on the way to rdma/fabric.h: its time changes when
        // `rdma/` (or the header in it) is created.
        let rdma = d.join("rdma");
        let watch = [rdma.as_path(), d.as_path()].into_iter().find(|p| p.is_dir());
        if let Some(w) = watch {
            println!("cargo:rerun-if-changed={}", w.display());
        }
    }
    Headers::Missing
}

/// `(name, arguments, " -> type" or "")` of every `pub extern "C" fn nccl*` in `text`.
fn extern_fns(text: &str) -> Vec<(String, String, String)> {
    let mut v = Vec::new();
    let key = "pub extern \"C\" fn nccl";
    let mut rest = text;
    while let Some(i) = rest.find(key) {
        rest = &rest[i + key.len() - 4..];
        let open = rest.find('(').expect("(");
        let close = rest.find(')').expect(")");
        let body = rest.find('{').expect("{");
        let name = rest[..open].trim().to_string();
        let args = rest[open + 1..close].split_whitespace().collect::<Vec<_>>().join(" ");
        let ret = rest[close + 1..body].trim();
        let ret = if ret.is_empty() { String::new() } else { format!(" {ret}") };
        v.push((name, args.trim_end_matches(',').to_string(), ret));
        rest = &rest[body..];
    }
    v
}
