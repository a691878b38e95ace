//! Connecting a communicator's links to the peers a plan needs, on first use.

use super::*;

impl Communicator {
    /// Connects a link to every peer in `peers` that has none yet (higher ranks are dialled,
    /// lower ones accepted), choosing each link's transport; bounded by `deadline`.
    pub(super) fn ensure_links(&self, inner: &mut Inner, peers: &[usize], deadline: Instant) -> Result<()> {
        let mut missing: Vec<usize> =
            peers.iter().copied().filter(|&p| p != self.rank && inner.links[p].is_none()).collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        let Some(boot) = inner.boot.as_ref() else {
            return Err(Error::internal(format!(
                "rank {}: no link to ranks {missing:?} and no way to connect",
                self.rank
            )));
        };
        let mut fresh = Vec::new();
        let aborted = || self.aborted.load(Ordering::Relaxed);
        for &p in missing.iter().filter(|&&p| p > self.rank) {
            fresh.push((p, bootstrap::connect_peer_until(boot, p, bootstrap::Purpose::Data, deadline, &aborted)?));
        }
        let mut want: Vec<usize> = missing.iter().copied().filter(|&p| p < self.rank).collect();
        want.retain(|p| match inner.pending.remove(&(bootstrap::Purpose::Data, *p)) {
            Some(s) => {
                fresh.push((*p, s));
                false
            }
            None => true,
        });
        if !want.is_empty() {
            // Every handshake at once: a stranger never delays a peer (bootstrap::accept).
            fresh.extend(bootstrap::accept::accept_for(
                boot,
                &mut inner.handshakes,
                bootstrap::Purpose::Data,
                &mut want,
                &mut inner.pending,
                deadline,
                &aborted,
            )?);
        }
        for (_, c) in &fresh {
            if let Ok(c) = c.stream.try_clone() {
                lock(&self.sockets).push(c);
            }
        }
        let mut extra = Vec::new();
        let homes = boot.peers.iter().map(|p| p.addr.ip()).collect();
        let built =
            crate::transport::select::build(self.rank, fresh, &self.hosts, homes, &self.config, deadline, &mut extra)?;
        for (p, link) in built {
            inner.links[p] = Some(link);
        }
        lock(&self.sockets).extend(extra);
        Ok(())
    }
}
