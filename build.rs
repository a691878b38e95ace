//! Build script: sets liboxccl.so's SONAME, and generates the `pnccl*` profiling aliases that
//! NCCL exports beside every `nccl*` function (one thin wrapper per `#[no_mangle] extern "C"`
//! function of src/ffi, with the same signature), included by src/ffi/profiling.rs.
//!
//! With the `ofi` feature (default) and libfabric's headers present (`pkg-config libfabric`, or
//! `rdma/fabric.h` in the system include path), it also compiles src/transport/ofi/shim.c with
//! the C compiler (`$CC`, else `cc`) into a static library and sets the `oxccl_ofi` cfg. The
//! shim loads libfabric.so.1 at run time (dlopen), so the library never links to it.

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
    let found = match std::process::Command::new("pkg-config").args(["--cflags", "libfabric"]).output() {
        Ok(o) if o.status.success() => {
            flags.extend(String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from));
            true
        }
        _ => ["/usr/include/rdma/fabric.h", "/usr/local/include/rdma/fabric.h"].iter().any(|p| Path::new(p).exists()),
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
