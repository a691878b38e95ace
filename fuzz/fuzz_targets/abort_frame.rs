//! Control-channel frames (abort, heartbeat, closing) as a peer may send them.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut buf = data.to_vec();
    while let Ok(Some(f)) = oxccl::control::frame::Frame::take(&mut buf) {
        if let oxccl::control::frame::Frame::Abort { reason, .. } = f {
            assert!(reason.len() <= 3 * oxccl::control::frame::MAX_PAYLOAD);
        }
    }
});
