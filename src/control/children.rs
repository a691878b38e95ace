//! Children (split, shrink, grow) learn of a dead member through their parent's channels.
//!
//! A child has channels of its own, so it finds a member's death by itself; the parent tells
//! it too, whichever sees the death first: when the liveness thread declares a parent's peer
//! dead, every live child adopted by that parent ([`Membership::adopt`]) that holds the peer
//! fails naming it (by its child rank and its parent rank), and sends an abort frame on the
//! child's other channels; the child's own children are told in turn. Only deaths travel this
//! way: a parent's abort frame (a mismatch, a timeout, an abort) concerns the parent alone, and
//! a death relayed in an abort frame reaches every rank's own channel to the dead peer as well. The parent holds its children weakly:
//! a child dropped first is skipped; a parent dropped first takes its forwarding with it, and
//! its children keep their own channels.

use super::{lock, Channels, Hooks, Membership};
use crate::error::Error;
use std::sync::{Arc, Weak};

/// A child as its parent holds it.
pub(super) struct Adopted {
    /// The child's members: parent ranks, in child rank order.
    members: Vec<usize>,
    hooks: Weak<Hooks>,
    /// The child's id in the liveness thread's registry.
    id: u64,
}

impl Membership {
    /// Tells `child` (made from this communicator, with `members`: parent ranks in child rank
    /// order) of every member's death this communicator's channels find from now on. In-memory
    /// channels have nothing to forward: nothing there dies silently.
    pub(crate) fn adopt(&self, child: &Membership, members: Vec<usize>) {
        let (Channels::Tcp(_), Channels::Tcp(id)) = (&self.chans, &child.chans) else { return };
        let mut kids = lock(&self.hooks.children);
        kids.retain(|k| k.hooks.strong_count() > 0);
        kids.push(Adopted { members, hooks: Arc::downgrade(&child.hooks), id: *id });
    }
}

/// The live children of `parent` that hold its rank `peer`: each one's hooks, the peer's rank
/// in it, and its registry id.
pub(super) fn heirs(parent: &Hooks, peer: usize) -> Vec<(Arc<Hooks>, usize, u64)> {
    let kids = lock(&parent.children);
    kids.iter()
        .filter_map(|k| {
            let c = k.members.iter().position(|&m| m == peer)?;
            Some((k.hooks.upgrade()?, c, k.id))
        })
        .collect()
}

/// A child's error for the death of its rank `c` (parent rank `peer`), found by the parent as `e`.
pub(super) fn death(child: &Hooks, c: usize, peer: usize, e: &Error) -> Error {
    Error::new(
        e.kind(),
        format!(
            "rank {}: peer rank {c} (parent rank {peer}) died, found by the parent communicator: {}",
            child.rank,
            e.message()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::super::frame::Frame;
    use super::super::tests::{failed_within, pair};
    use super::super::*;
    use std::io::{Read, Write};

    /// A member, its failure and abort flag, and the peers' ends of its channels.
    type Member = (Membership, Arc<Mutex<Option<Error>>>, Arc<AtomicBool>, Vec<Option<TcpStream>>);

    /// Rank 0 of `n` with a channel to every other rank: its membership, failure, abort flag
    /// and the peers' ends (by rank; none for rank 0).
    fn member(n: usize) -> Member {
        let (failure, aborted) = (Arc::new(Mutex::new(None)), Arc::new(AtomicBool::new(false)));
        let hosts: Vec<String> = (0..n).map(|r| format!("h{r}:boot:net")).collect();
        let hooks = Hooks::new(0, &hosts, None, aborted.clone(), failure.clone(), Default::default());
        let (mine, theirs): (Vec<_>, Vec<_>) = (1..n).map(|p| (p, pair())).map(|(p, (a, b))| ((p, a), b)).unzip();
        let ends = std::iter::once(None).chain(theirs.into_iter().map(Some)).collect();
        (watch(hooks, mine).unwrap(), failure, aborted, ends)
    }

    /// The first abort frame `s` receives within `limit`.
    fn abort_frame(s: &mut TcpStream, limit: Duration) -> Option<(i32, String)> {
        s.set_read_timeout(Some(limit)).unwrap();
        let (mut buf, mut tmp) = (Vec::new(), [0u8; 256]);
        while let Ok(n @ 1..) = s.read(&mut tmp) {
            buf.extend_from_slice(&tmp[..n]);
            while let Some(f) = Frame::take(&mut buf).unwrap() {
                if let Frame::Abort { code, reason } = f {
                    return Some((code, reason));
                }
            }
        }
        None
    }

    #[test]
    fn a_member_found_dead_by_the_parent_fails_the_child_whose_own_channel_is_still_open() {
        let (parent, pfail, _, mut pends) = member(3);
        // The child: parent ranks [0, 2, 1] as child ranks 0, 1, 2.
        let (child, cfail, caborted, mut cends) = member(3);
        parent.adopt(&child, vec![0, 2, 1]);
        // The child's own child: child ranks 0 and 1 (parent ranks 0 and 2).
        let (grandchild, gfail, _, _gends) = member(2);
        child.adopt(&grandchild, vec![0, 1]);
        drop(pends[2].take()); // parent rank 2 dies: its parent channel ends without closing
        let e = failed_within(&cfail, Duration::from_secs(5)).expect("the child is told");
        assert_eq!(e.kind(), crate::error::ErrorKind::Remote);
        assert!(e.message().starts_with("rank 0: peer rank 1 (parent rank 2) died"), "{e}");
        assert!(e.message().contains("peer rank 2 (h2") && e.message().contains("without closing"), "{e}");
        assert!(caborted.load(Ordering::SeqCst), "a death interrupts the child's running call");
        assert_eq!(child.down().map(|d| d.message().to_string()), Some(e.message().to_string()));
        assert!(lock(&pfail).is_some(), "the parent fails too");
        let g = failed_within(&gfail, Duration::from_secs(1)).expect("the grandchild is told in turn");
        assert!(g.message().starts_with("rank 0: peer rank 1 (parent rank 1) died"), "{g}");
        assert!(g.message().contains(e.message()), "{g}");
        // Child rank 2 is warned on the child's channel; child rank 1's channel stayed open
        // all along, so the child learnt it from the parent.
        let (code, reason) = abort_frame(cends[2].as_mut().unwrap(), Duration::from_secs(5)).expect("an abort frame");
        assert_eq!((code, reason.as_str()), (6, e.message()));
    }

    #[test]
    fn a_parent_abort_or_a_non_member_death_leaves_the_child_alone() {
        let (parent, pfail, _, mut pends) = member(3);
        let (child, cfail, caborted, _cends) = member(2);
        parent.adopt(&child, vec![0, 1]);
        let gone = member(2); // a child dropped before the death: skipped
        parent.adopt(&gone.0, vec![0, 2]);
        drop(gone);
        let abort = Frame::Abort { code: 5, reason: "rank 1: collective mismatch".into() };
        pends[1].as_mut().unwrap().write_all(&abort.encode()).unwrap();
        drop(pends[2].take());
        assert!(failed_within(&pfail, Duration::from_secs(5)).is_some(), "the parent fails");
        std::thread::sleep(watch::BEAT); // well past the death's grace
        assert!(lock(&cfail).is_none() && !caborted.load(Ordering::SeqCst), "{:?}", lock(&cfail));
        assert!(child.down().is_none());
        drop(parent); // the parent first: the child keeps its own channels
        assert!(child.down().is_none());
    }
}
