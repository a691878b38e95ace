//! Abort frames found at the end of the bytes a failing peer left on a link.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((kind, text)) = oxccl::abort::parse_tail(data) {
        assert!(text.len() <= 3 * oxccl::abort::MAX_TEXT);
        let _ = kind;
    }
});
