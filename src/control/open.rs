//! Opening a communicator's control channels: every pair of ranks connects once more through
//! the data listener's authenticated handshake, with [`Purpose::Control`] (the higher rank is
//! dialled, the lower accepted, as for data links).

use crate::bootstrap::accept::{self, Extra, InProgress};
use crate::bootstrap::{self, Bootstrap, Conn, Purpose};
use crate::error::Result;
use std::time::Instant;

/// A control channel to every other rank of `b`'s table: (peer rank, connection with its
/// keys). Data links that
/// arrive meanwhile go to `extra`. Bounded by `deadline`; ends early when `abort` says so
/// (dialling a peer as well as waiting for one).
pub(crate) fn open(
    b: &Bootstrap,
    keep: &mut InProgress,
    extra: &mut Extra,
    deadline: Instant,
    abort: &dyn Fn() -> bool,
) -> Result<Vec<(usize, Conn)>> {
    let mut out = Vec::new();
    for p in b.rank + 1..b.peers.len() {
        let s = bootstrap::connect_peer_until(b, p, Purpose::Control, deadline, abort)
            .map_err(|e| e.context(format!("rank {}: opening the control channel to rank {p}", b.rank)))?;
        out.push((p, s));
    }
    let mut want: Vec<usize> = (0..b.rank)
        .filter(|&p| match extra.remove(&(Purpose::Control, p)) {
            Some(s) => {
                out.push((p, s));
                false
            }
            None => true,
        })
        .collect();
    if !want.is_empty() {
        out.extend(accept::accept_for(b, keep, Purpose::Control, &mut want, extra, deadline, abort)?);
    }
    Ok(out)
}
