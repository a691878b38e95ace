//! How the engine explains a failed send: by the peer's call signature, when it is still
//! unread (the peer closed the link because the calls differ). Spreading a failure to the
//! other ranks is the control channel's ([`crate::control`]).

use super::*;

impl Exec<'_, '_> {
    /// A send to `peer` failed with `e`: when the peer's signature of this operation is still
    /// unread, reads what it left and reports a mismatch (the peer's reason for closing) instead.
    pub(super) fn explain(&mut self, peer: usize, e: Error) -> Error {
        let (Some(x), Some(l)) = (self.ctx.sigs.as_deref_mut(), self.ctx.links[peer].as_mut()) else { return e };
        while x.wants_input(peer) {
            match l.try_recv(x.input_buf(peer)) {
                Ok(n) if n > 0 => {
                    if let Err(m) = x.received(peer, n) {
                        return m.context(format!("rank {}: {}", self.ctx.rank, self.ctx.what));
                    }
                }
                _ => break,
            }
        }
        e
    }
}
