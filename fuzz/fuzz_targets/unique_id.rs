//! The unique id (bytes from the user or the environment) and its hex form.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut bytes = [0u8; 128];
    let n = data.len().min(128);
    bytes[..n].copy_from_slice(&data[..n]);
    let _ = oxccl::UniqueId { bytes }.decode();
    let _ = oxccl::UniqueId::from_hex(&String::from_utf8_lossy(data));
});
