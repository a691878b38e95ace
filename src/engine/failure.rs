//! How the engine ends a failed operation: explaining a send failure by the peer's signature,
//! and spreading abort frames ([`crate::abort`]) so every rank learns the first reason.

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

    /// The operation failed with `e`. Looks for an abort frame ([`crate::abort`]) that a peer
    /// which failed first left on a link (its reason replaces a bare "connection closed", and
    /// a collective mismatch found elsewhere replaces any other failure), then writes this
    /// rank's frame on every link so that the reason reaches every rank. Bounded: at most
    /// [`ABORT_GRACE`] waiting for frames, [`ABORT_SEND_BUDGET`] writing them.
    pub(super) fn spread(&mut self, e: Error) -> Error {
        if self.ctx.sigs.is_none() || self.ctx.abort.load(Ordering::Relaxed) {
            return e;
        }
        let n = self.ctx.links.len();
        let mut tails: Vec<Vec<u8>> = (0..n).map(|p| self.received_tail(p)).collect();
        let mut closed: Vec<bool> = self.ctx.links.iter().map(|l| l.is_none()).collect();
        // A bare closed link may be the echo of a failure whose frame is still on its way.
        let grace = match e.kind() {
            ErrorKind::Remote => ABORT_GRACE,
            // This rank found the mismatch itself: nothing explains it better; tell the others now.
            ErrorKind::InvalidUsage => Duration::ZERO,
            _ => Duration::from_millis(20),
        };
        let deadline = Instant::now() + grace;
        let mut found: Option<(usize, ErrorKind, String)> = None;
        loop {
            for p in 0..n {
                let Some(l) = self.ctx.links[p].as_mut().filter(|_| !closed[p]) else { continue };
                closed[p] = l.salvage(&mut tails[p]);
                if let Some((k, text)) = crate::abort::parse_tail(&tails[p]) {
                    closed[p] = true;
                    let better = match &found {
                        None => true,
                        Some(f) => k == ErrorKind::InvalidUsage && f.1 != k,
                    };
                    if better {
                        found = Some((p, k, text));
                    }
                }
            }
            if found.is_some() || closed.iter().all(|&c| c) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let (err, kind, text) = match found {
            Some((p, k, text)) if e.kind() == ErrorKind::Remote || (k == ErrorKind::InvalidUsage && e.kind() != k) => {
                let who = self.ctx.links[p].as_ref().map(|l| l.describe()).unwrap_or_default();
                let err = Error::new(
                    k,
                    format!("rank {}: {} failed because {who} failed: {text}", self.ctx.rank, self.ctx.what),
                );
                (err, k, text)
            }
            _ => {
                let (k, text) = (e.kind(), e.message().to_string());
                (e, k, text)
            }
        };
        let frame = crate::abort::encode(kind, &text);
        // A peer that reads nothing (stopped, or stuck behind a full buffer) gets a share of
        // a common budget, not a wait of its own.
        let send_deadline = Instant::now() + ABORT_SEND_BUDGET;
        for (p, &done) in closed.iter().enumerate() {
            if done {
                continue;
            }
            let at = self.at_boundary(p, frame.len());
            let limit = send_deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
            if let Some(l) = self.ctx.links[p].as_mut() {
                l.send_abort(&frame, at, limit);
            }
        }
        err
    }

    /// The bytes of the current operation already read from `peer` that may start an abort
    /// frame (in-band links only): the partial signature when no data step from `peer` has
    /// started, else what the front receive step holds.
    fn received_tail(&self, peer: usize) -> Vec<u8> {
        let mut t = Vec::new();
        if !self.ctx.links[peer].as_ref().is_some_and(|l| l.abort_in_band()) {
            return t;
        }
        // Until a data step from `peer` is complete, the bytes read where its signature belongs
        // come first (they may be the start of a frame).
        let first = self.plan.nodes.iter().position(|nd| matches!(nd.step, Step::Recv { peer: p, .. } if p == peer));
        if first.is_none() || self.recvs[peer].front().copied() == first {
            if let Some(x) = self.ctx.sigs.as_deref() {
                crate::abort::keep_tail(&mut t, x.received_so_far(peer));
            }
        }
        if let Some(&i) = self.recvs[peer].front() {
            let Step::Recv { dst, action, .. } = self.plan.nodes[i].step else { return t };
            let got = match self.state[i] {
                State::Moving(k) => k,
                State::Received => dst.len,
                _ => 0,
            };
            if got > 0 {
                let bytes: &[u8] = match action {
                    // SAFETY: read after a failure, when no step runs any more; the view is
                    // dropped before this function returns.
                    Action::Store => unsafe { &self.mem.slice(dst)[..got] },
                    _ => &bytemuck::cast_slice::<u64, u8>(&self.ctx.staging[peer][..])[..got],
                };
                crate::abort::keep_tail(&mut t, bytes);
            }
        }
        t
    }

    /// Whether an abort frame of `len` bytes written to `peer` now cannot be taken for data
    /// that completes the peer's operation: the peer expects a signature next (none of this
    /// operation's went out yet, or all of its data did), or the current send step still
    /// owes more than `len` bytes (the peer will be missing data when the link closes).
    fn at_boundary(&self, peer: usize, len: usize) -> bool {
        let Some(x) = self.ctx.sigs.as_deref() else { return false };
        match x.sent_to(peer) {
            None | Some(0) => true,
            Some(k) if k < crate::mismatch::SIG_LEN => false,
            Some(_) => match self.sends[peer].front() {
                None => true,
                Some(&i) => {
                    let Step::Send { src, .. } = self.plan.nodes[i].step else { return false };
                    let sent = match self.state[i] {
                        State::Moving(k) => k,
                        _ => 0,
                    };
                    src.len - sent > len
                }
            },
        }
    }
}
