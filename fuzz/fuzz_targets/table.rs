//! The root's reply table (frame payload after the length).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let n = data.first().map_or(1, |&b| b as usize % 8 + 1);
    let _ = oxccl::bootstrap::root::parse_table(data.get(1..).unwrap_or(&[]), n);
});
