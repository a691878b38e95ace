//! The lowest layer of host and network helpers, used by the bootstrap, the transports and the
//! logger alike: the host name, kernel randomness, signal-free sends ([`nosig`]), length-prefixed
//! frames ([`wire`]) and connecting with retries ([`connect`]). It uses nothing else in the crate
//! but [`crate::error`], so nothing here can close an import cycle.

pub mod connect;
pub mod nosig;
pub mod wire;

use crate::error::{Error, Result};

/// This host's name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Fills `buf` with random bytes from the kernel.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::from_io("reading /dev/urandom", e))
}
