//! Operation signatures read from data links (mismatch detection).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = oxccl::mismatch::Signature::decode(data) {
        assert_eq!(s.encode().as_slice(), data);
    }
});
