//! Socket writes that never raise `SIGPIPE` in the host process.
//!
//! `write(2)`/`writev(2)` on a socket whose peer has gone raise `SIGPIPE`, whose default action
//! kills the process (exit status 141). Rust programs ignore the signal, but a C or C++ host
//! that loads oxccl usually keeps the default, so a peer's death would kill the survivors
//! instead of giving them `ncclRemoteError`. Every socket write of the library therefore goes
//! through `send(2)`/`sendmsg(2)` with `MSG_NOSIGNAL` here: a dead peer is an `EPIPE` error.

use std::io::{ErrorKind, IoSlice, Result};
use std::net::TcpStream;

/// `send(2)` with `MSG_NOSIGNAL`: like `Write::write` on the stream, minus the signal.
pub fn send(s: &TcpStream, buf: &[u8]) -> Result<usize> {
    socket2::SockRef::from(s).send_with_flags(buf, libc::MSG_NOSIGNAL)
}

/// `sendmsg(2)` with `MSG_NOSIGNAL`: like `Write::write_vectored` on the stream, minus the
/// signal.
pub fn send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> Result<usize> {
    socket2::SockRef::from(s).send_vectored_with_flags(bufs, libc::MSG_NOSIGNAL)
}

/// Writes all of `buf` to a blocking stream (like `Write::write_all`, minus the signal). A
/// stream with a send timeout that expires fails with `ErrorKind::TimedOut`.
pub fn send_all(s: &TcpStream, mut buf: &[u8]) -> Result<()> {
    while !buf.is_empty() {
        match send(s, buf) {
            Ok(0) => return Err(std::io::Error::new(ErrorKind::WriteZero, "the connection took no more bytes")),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(ErrorKind::TimedOut, "the peer read nothing before the send timeout"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Writing to a closed peer must be an error, not a signal. The test process ignores
    /// SIGPIPE (Rust's runtime does), so this checks the error path; the C hosts of
    /// ffi-tests/sigpipe.c check that no signal is raised.
    #[test]
    fn writes_to_a_closed_peer_fail_with_an_error() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        send_all(&a, b"hello").unwrap();
        drop(b);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let err = loop {
            let r = send(&a, &[7u8; 4096]).and_then(|_| send_vectored(&a, &[IoSlice::new(&[1u8; 64])]));
            match r {
                Err(e) => break e,
                Ok(_) => assert!(std::time::Instant::now() < deadline, "a dead peer still takes bytes after 10 s"),
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert!(
            matches!(err.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset),
            "unexpected error kind {:?}: {err}",
            err.kind()
        );
        assert!(send_all(&a, b"more").is_err());
    }
}
