//! The hello a rank sends the bootstrap root (frame payload after the length).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let secret = [7u8; 16];
    let nonce = [9u8; 16];
    assert!(oxccl::bootstrap::root::parse_hello(data, &secret, &nonce).is_err());
});
