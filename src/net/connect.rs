//! Connecting a TCP stream to a peer that may not be listening yet (the bootstrap's and the
//! transports' connections alike).

use crate::error::{Error, Result};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Connects to `addr`, retrying refused connections until `deadline` (the peer may not be
/// listening yet).
pub fn connect_retry(addr: SocketAddr, deadline: Instant) -> Result<TcpStream> {
    connect_retry_within(addr, deadline, None)
}

/// As [`connect_retry`]; with `refused_for`, a listener known to be up already (so a refusal
/// means its process is gone) is retried only that long after the first refusal, and the
/// error says so instead of waiting for the deadline.
pub fn connect_retry_within(addr: SocketAddr, deadline: Instant, refused_for: Option<Duration>) -> Result<TcpStream> {
    connect_retry_until(addr, deadline, refused_for, &|| false)
}

/// As [`connect_retry_within`], giving up (a [`crate::error::ErrorKind::Remote`] error) once
/// `abort` says so: it is asked before every attempt, at least every 100 ms.
pub fn connect_retry_until(
    addr: SocketAddr,
    deadline: Instant,
    refused_for: Option<Duration>,
    abort: &dyn Fn() -> bool,
) -> Result<TcpStream> {
    let mut delay = Duration::from_millis(1);
    let mut first_refusal: Option<Instant> = None;
    loop {
        if abort() {
            return Err(Error::remote(format!("gave up connecting to {addr}: the wait was aborted")));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(format!("could not connect to {addr} before the deadline")));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| Error::from_io("TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e)
                if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::Interrupted) =>
            {
                if e.kind() == ErrorKind::ConnectionRefused {
                    let since = *first_refusal.get_or_insert_with(Instant::now);
                    if refused_for.is_some_and(|g| since.elapsed() >= g) {
                        return Err(Error::remote(format!(
                            "{addr} refused the connection: it was listening before, so its process has exited (or its rendezvous ended)"
                        )));
                    }
                }
                std::thread::sleep(delay.min(left));
                delay = (delay * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(Error::system(format!("connect to {addr}: {e}"))),
        }
    }
}
