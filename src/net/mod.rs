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

/// Fills `buf` with random bytes from the kernel (`getrandom(2)`: no descriptor, so it works
/// when the process is out of them).
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: `rest` is writable for its length; getrandom writes at most that many bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::from_io("getrandom", e));
        }
        got += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn random_bytes_fill_the_buffer_and_differ() {
        let (mut a, mut b) = ([0u8; 300], [0u8; 300]);
        super::random_bytes(&mut a).unwrap();
        super::random_bytes(&mut b).unwrap();
        assert_ne!(a, b);
        assert!(a.iter().filter(|&&x| x == 0).count() < 20, "300 random bytes are not mostly zero");
    }
}
