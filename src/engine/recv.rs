//! The receive side of the engine: reading each peer's bytes in plan order, straight into
//! their destination, through staging, or reduced in place out of the link's memory.

use super::*;

impl Exec<'_, '_> {
    /// Reads the bytes of every peer's receives that can move, in plan order, after what is
    /// left of the peer's operation signature, and completes those whose bytes and
    /// dependencies are all there. Returns whether anything moved.
    pub(super) fn progress_recvs(&mut self) -> Result<bool> {
        let mut moved = false;
        for peer in 0..self.recvs.len() {
            let (read, signature_left) = self.read_signature(peer)?;
            moved |= read;
            if !signature_left {
                moved |= self.progress_peer(peer)?;
            }
        }
        Ok(moved)
    }

    /// Reads what `peer` still owes of its operation signature (with the bytes of a staged
    /// front receive behind it). Returns whether bytes moved, and whether the signature still
    /// wants input (then no receive of `peer` moves).
    fn read_signature(&mut self, peer: usize) -> Result<(bool, bool)> {
        let (Some(x), Some(l)) = (self.ctx.sigs.as_deref_mut(), self.ctx.links[peer].as_mut()) else {
            return Ok((false, false));
        };
        if !x.wants_input(peer) {
            return Ok((false, false));
        }
        // A front receive that stages its bytes (a reduction, not yet started) takes
        // the bytes behind the signature in the same read; they are applied only
        // after the signature was checked, and never reach the caller's buffers
        // before that. On links that reduce in place, only a small step is staged
        // this way (its copy costs less than a second release of ring space).
        let staged = self.recvs[peer].front().copied().and_then(|i| match self.plan.nodes[i].step {
            Step::Recv { dst, action, .. }
                if !matches!(action, Action::Store)
                    && self.state[i] == State::Pending
                    && (!l.supports_in_place() || dst.len <= SMALL_STAGE) =>
            {
                Some((i, dst.len))
            }
            _ => None,
        });
        let want = x.input_buf(peer).len();
        let n = match staged {
            Some((_, len)) => {
                let staging: &mut [u8] = bytemuck::cast_slice_mut(&mut self.ctx.staging[peer][..]);
                l.try_recv_vectored(x.input_buf(peer), &mut staging[..len])
            }
            None => l.try_recv(x.input_buf(peer)),
        }
        .map_err(|e| sig_fail(self.ctx.rank, self.ctx.what, e))?;
        let moved = n > 0;
        let (to_sig, rest) = (n.min(want), n.saturating_sub(want));
        if let (Some((i, len)), true) = (staged, rest > 0) {
            self.state[i] = if rest == len { State::Received } else { State::Moving(rest) };
        }
        x.received(peer, to_sig).map_err(|e| e.context(format!("rank {}: {}", self.ctx.rank, self.ctx.what)))?;
        Ok((moved, x.wants_input(peer)))
    }

    /// Moves `peer`'s front receives in plan order until one must wait. Returns whether
    /// anything moved.
    fn progress_peer(&mut self, peer: usize) -> Result<bool> {
        let mut moved = false;
        while let Some(&i) = self.recvs[peer].front() {
            let Step::Recv { dst, action, .. } = self.plan.nodes[i].step else { unreachable!() };
            if let Some(k) = self.direct_state(peer, i, action) {
                let n = self.recv_direct(peer, i, dst, action, k)?;
                moved |= n > 0;
                if k + n < dst.len {
                    self.state[i] = State::Direct(k + n);
                    break;
                }
                if matches!(action, Action::ReduceFinal { .. }) {
                    self.finish(dst);
                }
                self.recvs[peer].pop_front();
                self.done(i);
                moved = true;
                continue;
            }
            let got = match self.state[i] {
                State::Moving(k) => k,
                State::Received => dst.len,
                _ => 0,
            };
            if got < dst.len {
                if !self.may_read(i) || moved && self.waits_for_locals(peer, i, action) {
                    break;
                }
                let n = self.recv_into(peer, i, dst, action, got)?;
                moved |= n > 0;
                if got + n < dst.len {
                    self.state[i] = State::Moving(got + n);
                    break;
                }
                self.state[i] = State::Received;
            }
            if !self.deps_done(i) {
                break;
            }
            self.apply(peer, dst, action);
            self.recvs[peer].pop_front();
            self.done(i);
            moved = true;
        }
        Ok(moved)
    }

    /// Whether reduction `i` from `peer`, which could run straight out of the link's memory
    /// but whose dependencies are not done, should leave its bytes in the link until the next
    /// round rather than stage them now: that round runs the local steps first (often the
    /// ones it waits for, such as the encode that frees its slot), and staging would copy
    /// its bytes once more.
    fn waits_for_locals(&mut self, peer: usize, i: usize, action: Action) -> bool {
        !matches!(action, Action::Store)
            && self.state[i] == State::Pending
            && !self.deps_done(i)
            && self.link(peer).supports_in_place()
    }

    /// Whether receive step `i` may read bytes now. A `Store` writes straight into its
    /// destination, so it waits for its dependencies first (they may still read those bytes);
    /// other receives stage their bytes and wait for dependencies only before applying them.
    pub(super) fn may_read(&self, i: usize) -> bool {
        match self.plan.nodes[i].step {
            Step::Recv { action: Action::Store, .. } => self.deps_done(i),
            _ => self.state[i] != State::Received,
        }
    }

    fn recv_into(&mut self, peer: usize, i: usize, dst: Region, action: Action, got: usize) -> Result<usize> {
        let r = match action {
            Action::Store => {
                // SAFETY: as in `slice_mut`: the destination region is in the receive buffer.
                let buf = unsafe { std::slice::from_raw_parts_mut(self.ptr(dst), dst.len) };
                let link = self.ctx.links[peer].as_mut().expect("checked in new");
                link.try_recv(&mut buf[got..])
            }
            _ => {
                let staging: &mut [u8] = bytemuck::cast_slice_mut(&mut self.ctx.staging[peer][..]);
                let link = self.ctx.links[peer].as_mut().expect("checked in new");
                link.try_recv(&mut staging[got..dst.len])
            }
        };
        r.map_err(|e| self.fail(i, e))
    }

    /// `Some(bytes applied)` when receive step `i` from `peer` runs (or may start) as a
    /// reduction straight out of the link's memory: the link supports it and the step's
    /// dependencies are done before any of its bytes were taken. Otherwise the step goes
    /// through staging, which also lets bytes be taken before the dependencies are done.
    fn direct_state(&mut self, peer: usize, i: usize, action: Action) -> Option<usize> {
        let state = self.state[i];
        match state {
            State::Direct(k) => Some(k),
            State::Pending
                if !matches!(action, Action::Store) && self.deps_done(i) && self.link(peer).supports_in_place() =>
            {
                Some(0)
            }
            _ => None,
        }
    }

    /// Reduces bytes `k..` of step `i` straight out of the link; returns the bytes applied.
    fn recv_direct(&mut self, peer: usize, i: usize, dst: Region, action: Action, k: usize) -> Result<usize> {
        let (Action::Reduce { with } | Action::ReduceFinal { with }) = action else {
            unreachable!("only reductions run in place")
        };
        let (dtype, op) = (self.calls[dst.call].dtype, self.calls[dst.call].op);
        let (d, w) = (self.ptr(dst), self.ptr(with));
        let mut done = k;
        while done < dst.len {
            let off = done;
            let fwd = self.forward_to(i, off)?;
            let max = fwd.map_or(dst.len - off, |f| f.room.min(dst.len - off));
            // SAFETY: the link hands out at most `max` bytes, the step's remaining ones, so
            // bytes off.. of `dst`/`with` stay inside their regions (bounds-checked in `new`);
            // a forward's room holds `max` bytes and lies in the link's memory, apart from
            // the caller's buffers and the bytes being received.
            let mut apply = |a: &[u8], b: &[u8]| unsafe {
                match fwd {
                    Some(f) => fuse::reduce_forward(dtype, op, d.add(off), w.add(off), a, b, f.out),
                    None => reduce_elems(dtype, op, d.add(off), w.add(off), a, b),
                }
            };
            let link = self.ctx.links[peer].as_mut().expect("links checked in new");
            let used = link.recv_in_place(max, &mut apply).map_err(|e| fail(self.ctx.rank, self.ctx.what, i, e))?;
            if let (Some(f), Some(n)) = (fwd, used) {
                self.forwarded(f, off, n);
            }
            match used {
                Some(n) if n > 0 => done += n,
                _ => break,
            }
        }
        Ok(done - k)
    }

    fn apply(&mut self, peer: usize, dst: Region, action: Action) {
        let (with, last) = match action {
            Action::Store => return,
            Action::Reduce { with } => (with, false),
            Action::ReduceFinal { with } => (with, true),
        };
        let staging: &[u8] = bytemuck::cast_slice(&self.ctx.staging[peer][..]);
        let (dtype, op) = (self.calls[dst.call].dtype, self.calls[dst.call].op);
        // SAFETY: `dst` and `with` are regions of this call (bounds-checked in `new`) and the
        // staging memory is the engine's own.
        unsafe { reduce_at(dtype, op, self.ptr(dst), self.ptr(with), &staging[..dst.len]) };
        if last {
            self.finish(dst);
        }
    }
}
