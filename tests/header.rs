//! The committed `include/oxccl.h` must equal what cbindgen generates from the source.
//! Run with `OXCCL_BLESS=1` to rewrite it after changing the C ABI.

#[test]
fn header_is_up_to_date() {
    let root = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{root}/cbindgen.toml")).expect("cbindgen.toml parses");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_src(format!("{root}/src/ffi/mod.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    let generated = String::from_utf8(out).expect("header is UTF-8");
    let path = format!("{root}/include/oxccl.h");
    if std::env::var_os("OXCCL_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/oxccl.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/oxccl.h is out of date with src/ffi: regenerate with `OXCCL_BLESS=1 cargo test --test header` and commit it"
    );
}
