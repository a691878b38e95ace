//! Build script: sets liboxccl.so's SONAME, and generates the `pnccl*` profiling aliases that
//! NCCL exports beside every `nccl*` function (one thin wrapper per `#[no_mangle] extern "C"`
//! function of src/ffi, with the same signature), included by src/ffi/profiling.rs.

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
