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
//!
//! Before a child exists, while its members meet, it is a [`Meeting`] of the parent
//! ([`Membership::meet`]): the parent keeps every death its channels found, so a member found
//! dead before the meeting began, or while it lasts, ends the meeting's waits (the sockets
//! lent to it are shut, [`Meeting::is_down`] is set) with the same error. This holds whether
//! or not the parent failed already: a shrink is made on a parent that usually has.

use super::{lock, Channels, Hooks, Membership, ABORT_GRACE};
use crate::error::{Error, ErrorKind};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

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

    /// A child being made from this communicator by its `members` (parent ranks in child rank
    /// order), this rank being child rank `rank`: down at once if a member was found dead
    /// already, else as soon as one is.
    pub(crate) fn meet(&self, rank: usize, members: Vec<usize>) -> Meeting {
        let g = Arc::new(Gathering {
            rank,
            members,
            down: Mutex::new(None),
            told: AtomicBool::new(false),
            sockets: Mutex::new(Vec::new()),
        });
        // The deaths' lock first, as `Hooks::died` takes them: no death falls between the two.
        let deaths = lock(&self.hooks.deaths);
        for (peer, e) in deaths.iter() {
            g.tell(*peer, e);
        }
        let mut meetings = lock(&self.hooks.meetings);
        meetings.retain(|m| m.strong_count() > 0);
        meetings.push(Arc::downgrade(&g));
        Meeting(g)
    }
}

impl Hooks {
    /// This communicator's channel found its rank `peer` dead (`e` names it): kept for the
    /// meetings to come, and every meeting now holding `peer` is told.
    pub(super) fn died(&self, peer: usize, e: &Error) {
        let mut deaths = lock(&self.deaths);
        if !deaths.iter().any(|(p, _)| *p == peer) {
            deaths.push((peer, e.clone()));
        }
        let meetings: Vec<Arc<Gathering>> = lock(&self.meetings).iter().filter_map(Weak::upgrade).collect();
        drop(deaths);
        for g in meetings {
            g.tell(peer, e);
        }
    }
}

/// A meeting as its parent holds it (weakly).
pub(super) struct Gathering {
    /// This rank in the child.
    rank: usize,
    /// The members: parent ranks, in child rank order.
    members: Vec<usize>,
    /// The first member's death found.
    down: Mutex<Option<Error>>,
    /// Whether `down` is set.
    told: AtomicBool,
    /// Connections of the meeting, shut when a member dies.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Gathering {
    /// The parent found its rank `peer` dead (`e`): fails the meeting if `peer` is a member.
    fn tell(&self, peer: usize, e: &Error) {
        let Some(c) = self.members.iter().position(|&m| m == peer) else { return };
        let mut down = lock(&self.down);
        if down.is_some() {
            return;
        }
        *down = Some(death(self.rank, c, peer, e));
        self.told.store(true, Ordering::SeqCst);
        drop(down);
        for s in lock(&self.sockets).iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// A child being made from a parent ([`Membership::meet`]); it leaves the parent when dropped.
pub(crate) struct Meeting(Arc<Gathering>);

impl Meeting {
    /// Whether a member was found dead (one atomic load: wait loops ask it).
    pub(crate) fn is_down(&self) -> bool {
        self.0.told.load(Ordering::SeqCst)
    }

    /// The error naming the member found dead, if one was.
    pub(crate) fn down(&self) -> Option<Error> {
        lock(&self.0.down).clone()
    }

    /// Shuts (a duplicate of) `s` when a member is found dead, or now if one was: a read
    /// blocked on it returns.
    pub(crate) fn lend(&self, s: &TcpStream) {
        let Ok(c) = s.try_clone() else { return };
        let mut socks = lock(&self.0.sockets);
        // `tell` sets the flag before it takes the sockets: one of the two shuts it.
        if self.is_down() {
            let _ = c.shutdown(Shutdown::Both);
        }
        socks.push(c);
    }

    /// Forgets the sockets lent so far (their wait is over).
    pub(crate) fn release(&self) {
        lock(&self.0.sockets).clear();
    }

    /// Making the child failed with `e`: the member's death, if the parent finds one within
    /// twice [`ABORT_GRACE`] (a reset connection, a closed root connection or the root ending
    /// the rendezvous because a member left may be its echo), is reported instead. A timeout
    /// or a bad argument is no echo and is reported as it is, unless a death was found
    /// already.
    pub(crate) fn explain(&self, e: Error) -> Error {
        let echo = !matches!(e.kind(), ErrorKind::Timeout | ErrorKind::InvalidArgument);
        let until = Instant::now() + if echo { 2 * ABORT_GRACE } else { Duration::ZERO };
        loop {
            if let Some(d) = self.down() {
                return d;
            }
            if Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
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

/// The error of child rank `me` for the death of its rank `c` (parent rank `peer`), found by
/// the parent as `e`.
pub(super) fn death(me: usize, c: usize, peer: usize, e: &Error) -> Error {
    Error::new(
        e.kind(),
        format!(
            "rank {me}: peer rank {c} (parent rank {peer}) died, found by the parent communicator: {}",
            e.message()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::super::frame::Frame;
    use super::super::tests::{channel, failed_within, pair, Far};
    use super::super::*;
    use std::io::Read;

    /// A member, its failure and abort flag, and the peers' ends of its channels.
    type Member = (Membership, Arc<Mutex<Option<Error>>>, Arc<AtomicBool>, Vec<Option<Far>>);

    /// Rank 0 of `n` with a channel to every other rank: its membership, failure, abort flag
    /// and the peers' ends (by rank; none for rank 0).
    fn member(n: usize) -> Member {
        let (failure, aborted) = (Arc::new(Mutex::new(None)), Arc::new(AtomicBool::new(false)));
        let hosts: Vec<String> = (0..n).map(|r| format!("h{r}:boot:net")).collect();
        let hooks = Hooks::new(0, &hosts, None, aborted.clone(), failure.clone(), Default::default());
        let (mine, theirs): (Vec<_>, Vec<_>) = (1..n).map(|p| (p, channel())).map(|(p, (a, b))| ((p, a), b)).unzip();
        let ends = std::iter::once(None).chain(theirs.into_iter().map(Some)).collect();
        (watch(hooks, mine).unwrap(), failure, aborted, ends)
    }

    /// The first abort frame `s` receives within `limit`.
    fn abort_frame(s: &mut Far, limit: Duration) -> Option<(i32, String)> {
        s.frames(limit).into_iter().find_map(|f| match f {
            Frame::Abort { code, reason } => Some((code, reason)),
            _ => None,
        })
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
        pends[1].as_mut().unwrap().send(&abort);
        drop(pends[2].take());
        assert!(failed_within(&pfail, Duration::from_secs(5)).is_some(), "the parent fails");
        std::thread::sleep(watch::BEAT); // well past the death's grace
        assert!(lock(&cfail).is_none() && !caborted.load(Ordering::SeqCst), "{:?}", lock(&cfail));
        assert!(child.down().is_none());
        drop(parent); // the parent first: the child keeps its own channels
        assert!(child.down().is_none());
    }

    #[test]
    fn a_member_found_dead_before_or_while_a_child_meets_ends_it_on_a_failed_parent() {
        let (parent, pfail, _, mut pends) = member(4);
        drop(pends[1].take()); // parent rank 1 dies: the parent fails
        assert!(failed_within(&pfail, Duration::from_secs(5)).is_some(), "the parent fails");
        // A meeting holding the dead rank begins on the failed parent: down at once.
        let a = parent.meet(0, vec![0, 1, 2]);
        let e = a.down().expect("a member already dead ends the meeting");
        assert!(a.is_down() && e.kind() == ErrorKind::Remote, "{e}");
        assert!(e.message().starts_with("rank 0: peer rank 1 (parent rank 1) died, found by the parent"), "{e}");
        assert!(e.message().contains("without closing"), "{e}");
        // Meetings of live members wait; parent rank 2 first sends an abort frame (no death)...
        let b = parent.meet(1, vec![3, 0, 2]);
        let c = parent.meet(0, vec![0, 3]);
        let (lent, mut far) = pair();
        b.lend(&lent);
        let abort = Frame::Abort { code: 6, reason: "rank 2: peer rank 1 died".into() };
        pends[2].as_mut().unwrap().send(&abort);
        std::thread::sleep(watch::BEAT);
        assert!(!b.is_down() && !c.is_down(), "an abort frame is no death: {:?}", b.down());
        // ... then dies: the same channel still finds the death, and ends the meeting's waits.
        drop(pends[2].take());
        let t = Instant::now();
        while !b.is_down() {
            assert!(t.elapsed() < Duration::from_secs(5), "rank 2's death did not end the meeting");
            std::thread::sleep(Duration::from_millis(10));
        }
        let e = b.explain(Error::remote("rank 1: the bootstrap root closed the connection"));
        assert!(e.message().starts_with("rank 1: peer rank 2 (parent rank 2) died, found by the parent"), "{e}");
        far.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(far.read(&mut [0u8; 8]).unwrap(), 0, "the lent socket is shut");
        // A meeting without the dead waits on, and a timeout is reported as it is.
        assert!(c.down().is_none());
        let t = Instant::now();
        assert_eq!(c.explain(Error::timeout("late")).message(), "late");
        assert!(t.elapsed() < ABORT_GRACE, "a timeout is no echo of a death");
    }
}
