//! Child communicators made from a parent: [`Communicator::split`] (`ncclCommSplit`),
//! [`Communicator::shrink`] (`ncclCommShrink`) and [`Communicator::grow`] (`ncclCommGrow`).
//!
//! Every child gets its own rendezvous, listeners, connections and secret; nothing is shared
//! with the parent. Split and grow use the parent's links only to agree on the child's unique
//! id (split: the child's rank 0 makes a fresh [`UniqueId`] and all-gathers it with the
//! colors; grow: the id of `ncclCommGetUniqueId`, all-gathered so every existing rank knows
//! it). Shrink needs no parent link at all, so it works after ranks died: see
//! [`Communicator::shrink_with`]. Only `NCCL_SHRINK_ABORT` makes the parent unusable.
//!
//! While any child is being made, a member found dead by the parent's control channels (before
//! or during the making, whether or not the parent failed earlier) ends the child's waits with
//! `ncclRemoteError` naming the member by its child and parent ranks
//! (`control::Meeting`); a split's also end on the parent's failure. Once made, every
//! child is adopted by its parent: a member's death found on the parent's control channels
//! fails the child too, beside what the child's own channels find ([`crate::control`]).

use crate::api::Collectives;
use crate::bootstrap::auth::{self, Secret, SECRET_LEN};
use crate::bootstrap::{root, UniqueId};
use crate::comm::{Communicator, Under};
use crate::error::{Error, ErrorKind, Result};
use std::sync::atomic::Ordering;

/// Bytes in one rank's record of the split exchange: color, key, then a unique id.
const RECORD: usize = 16 + 128;

/// The child's members (parent ranks) in child rank order for `color`, given every parent
/// rank's `(color, key)`: ordered by key, ties by parent rank (NCCL's rule).
pub fn split_members(table: &[(Option<u32>, i32)], color: u32) -> Vec<usize> {
    let mut m: Vec<usize> = (0..table.len()).filter(|&r| table[r].0 == Some(color)).collect();
    m.sort_by_key(|&r| (table[r].1, r));
    m
}

impl Communicator {
    /// Splits this communicator (`ncclCommSplit`): every rank calls it; ranks with the same
    /// `color` form one child, ordered by `key` (ties: parent rank). `color = None`
    /// (`NCCL_SPLIT_NOCOLOR`) joins no child and returns `Ok(None)`.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        let n = self.size();
        // Round 1: everybody's (color, key).
        let mine = encode(color, key, None);
        let mut all = vec![0u8; RECORD * n];
        self.all_gather(&mine, &mut all)?;
        let table: Vec<(Option<u32>, i32)> = all.chunks(RECORD).map(decode_ck).collect();
        let members = color.map(|c| split_members(&table, c)).unwrap_or_default();
        let lead = members.first() == Some(&self.rank());
        // Round 2: each child's rank 0 publishes a fresh unique id.
        let id = if lead { Some(UniqueId::new()?) } else { None };
        let mine = encode(color, key, id.as_ref());
        self.all_gather(&mine, &mut all)?;
        let Some(&leader) = members.first() else { return Ok(None) };
        let child_rank =
            members.iter().position(|&r| r == self.rank()).expect("a colored rank is a member of its color");
        let id = decode_id(&all[leader * RECORD..(leader + 1) * RECORD]);
        // While the child meets, a member found dead by this parent's control channel ends the
        // child's waits at once (the member is named), and so does the parent's failure (its
        // error is reported). A child's connection that was reset or refused may be the echo of
        // that death (or of another member's failure on it): the parent's channel is given the
        // time to report it.
        let start_root = child_rank == 0 && crate::config::BootstrapSettings::from_env().comm_id.is_some();
        let cfg = std::sync::Arc::new((*self.config).clone());
        let meeting = self.meet(child_rank, members.clone());
        let under = Under { meeting: meeting.as_ref(), parent: Some(self) };
        let down = || meeting.as_ref().and_then(|m| m.down());
        let child = Communicator::join_under(members.len(), &id, child_rank, start_root, cfg, under).map_err(|e| {
            let until = std::time::Instant::now() + 2 * crate::control::ABORT_GRACE;
            while e.kind() == ErrorKind::Remote
                && self.failure().is_none()
                && down().is_none()
                && std::time::Instant::now() < until
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            match down().or_else(|| self.failure()) {
                Some(f) => self.record(Error::new(f.kind(), format!("ncclCommSplit: {}", f.message()))),
                None => e,
            }
        })?;
        drop(meeting);
        self.adopt(&child, members);
        Ok(Some(child))
    }

    /// Shrinks this communicator (`ncclCommShrink` with `NCCL_SHRINK_DEFAULT`): the ranks not
    /// in `exclude` call it (the excluded ranks do not) and form a child in parent-rank order.
    /// See [`Communicator::shrink_with`].
    pub fn shrink(&self, exclude: &[usize]) -> Result<Communicator> {
        self.shrink_with(exclude, false)
    }

    /// Shrinks this communicator; with `abort` (`NCCL_SHRINK_ABORT`) this communicator is
    /// aborted first, so a collective blocked on another thread returns and the parent is
    /// unusable afterwards.
    ///
    /// The survivors never use the parent's connections, so this works after excluded ranks
    /// died (and the parent failed and shut its links): the lowest surviving rank runs the
    /// child's rendezvous root on its parent data listener, whose address every survivor has
    /// from the parent's bootstrap table, and every survivor derives the child's secret from
    /// the parent's secret, the number of shrinks made on this parent so far and the member
    /// list. No message is needed to agree on the child's id; a survivor that disagrees on the
    /// members fails authentication. A survivor found dead by this communicator's control
    /// channels (its process ended without closing them, or it was silent for
    /// `OXCCL_LIVENESS_TIMEOUT_MS`), before the shrink or while it waits, makes the others fail
    /// at once with `ncclRemoteError` naming it by its child and parent ranks, even though this
    /// communicator failed earlier; a survivor that lives but never calls makes them fail with
    /// `ncclTimeout` after `OXCCL_TIMEOUT_MS` (at most twice that when the first attempt was
    /// cut off and retried). A survivor that is alive but late is waited for. Excluded ranks
    /// are never contacted. An in-memory parent (ranks as threads) exchanges a fresh id over
    /// its links instead, and so must not have failed.
    pub fn shrink_with(&self, exclude: &[usize], abort: bool) -> Result<Communicator> {
        let n = self.size();
        if let Some(&bad) = exclude.iter().find(|&&r| r >= n) {
            return Err(Error::invalid_argument(format!("excluded rank {bad} is out of range for {n} ranks")));
        }
        if exclude.contains(&self.rank()) {
            return Err(Error::invalid_usage(format!(
                "rank {} is in the exclude list and must not call shrink",
                self.rank()
            )));
        }
        let members: Vec<usize> = (0..n).filter(|r| !exclude.contains(r)).collect();
        let leader = members[0];
        let child_rank = members.iter().position(|&r| r == self.rank()).expect("a survivor is a member");
        let epoch = self.shrinks.fetch_add(1, Ordering::SeqCst);
        if abort {
            self.abort();
        }
        let Some((addrs, secret, listener)) = self.rendezvous_table()? else {
            return self.shrink_in_memory(&members, child_rank, abort);
        };
        let id = UniqueId::encode(addrs[leader], &shrink_secret(&secret, epoch, n, &members));
        if self.rank() == leader {
            root::spawn(listener, id.decode()?.1)?;
        } else {
            drop(listener);
        }
        // The root may drop a connection that reached the listener while the parent still
        // accepted on it (a link being built when the failure hit): try again while time is
        // left. Refused connections are retried inside `join` until its own deadline. A member
        // found dead by this communicator's channels ends every wait.
        let meeting = self.meet(child_rank, members.clone());
        let under = Under { meeting: meeting.as_ref(), parent: None };
        let down = || meeting.as_ref().is_some_and(|m| m.is_down());
        let start = std::time::Instant::now();
        let join = || Communicator::join_under(members.len(), &id, child_rank, false, self.config.clone(), under);
        let mut r = join();
        while let Err(e) = &r {
            let transient = matches!(e.kind(), ErrorKind::Remote | ErrorKind::System);
            if !transient || down() || start.elapsed() >= self.config.timeout {
                break;
            }
            crate::info!("rank {}: shrink rendezvous failed ({}); retrying", self.rank(), e.message());
            std::thread::sleep(std::time::Duration::from_millis(20));
            r = join();
        }
        let child = r.map_err(|e| {
            let e = match &meeting {
                Some(m) => m.explain(e),
                None => e,
            };
            e.context(format!(
                "rank {}: shrink: survivors (parent ranks {members:?}) could not meet at parent rank {leader} ({}); a dead rank must be in the exclude list",
                self.rank(),
                addrs[leader]
            ))
        })?;
        self.adopt(&child, members);
        Ok(child)
    }

    /// Makes the id for growing this communicator (`ncclCommGetUniqueId`): a fresh unique id
    /// (a new rendezvous root in this process, with a new secret) that this rank hands to the
    /// joining ranks out of band. It is also kept here, so this rank may call
    /// [`Communicator::grow`] without it; the grow consumes it.
    pub fn grow_unique_id(&self) -> Result<UniqueId> {
        let id = UniqueId::new()?;
        *crate::sync::lock(&self.grow_id) = Some(id);
        Ok(id)
    }

    /// Grows this communicator to `new_size` ranks (`ncclCommGrow` on an existing rank): every
    /// rank of this communicator calls it and keeps its rank; the joining ranks call
    /// [`Communicator::join_grow`] with ranks `size()..new_size` and the id that one rank of
    /// this communicator made with [`Communicator::grow_unique_id`]. `id` may be that id or
    /// `None` (the ranks agree on it over this communicator). This communicator stays usable.
    pub fn grow(&self, new_size: usize, id: Option<&UniqueId>) -> Result<Communicator> {
        let n = self.size();
        if new_size <= n {
            return Err(Error::invalid_argument(format!(
                "ncclCommGrow: new size {new_size} must be larger than the current {n} ranks"
            )));
        }
        if let Some(id) = id {
            id.decode()?;
        }
        let kept = crate::sync::lock(&self.grow_id).take();
        let mine = id.copied().or(kept);
        // Every rank's id (or none), so that ranks that passed none learn the coordinator's.
        let mut rec = [0u8; 129];
        if let Some(m) = &mine {
            rec[0] = 1;
            rec[1..].copy_from_slice(&m.bytes);
        }
        let mut all = vec![0u8; 129 * n];
        self.all_gather(&rec[..], &mut all)?;
        let mut ids: Vec<[u8; 128]> =
            all.chunks(129).filter(|r| r[0] == 1).map(|r| <[u8; 128]>::try_from(&r[1..]).expect("128 bytes")).collect();
        ids.sort_unstable();
        ids.dedup();
        let bytes =
            match ids.as_slice() {
                [one] => *one,
                [] => return Err(Error::invalid_usage(
                    "ncclCommGrow: no rank of the communicator has a grow id: one must call ncclCommGetUniqueId first",
                )),
                _ => {
                    return Err(Error::invalid_usage(format!(
                        "ncclCommGrow: ranks of the communicator hold {} different grow ids; exactly one must be used",
                        ids.len()
                    )))
                }
            };
        // The existing ranks keep theirs; one of them found dead by this communicator's
        // channels ends the waits (a joining rank's death is found as at any init).
        let meeting = self.meet(self.rank(), (0..n).collect());
        let under = Under { meeting: meeting.as_ref(), parent: None };
        let start_root = self.rank() == 0 && crate::config::BootstrapSettings::from_env().comm_id.is_some();
        let cfg = std::sync::Arc::new((*self.config).clone());
        let child = Communicator::join_under(new_size, &UniqueId { bytes }, self.rank(), start_root, cfg, under)
            .map_err(|e| match &meeting {
                Some(m) => {
                    let e = m.explain(e);
                    if m.is_down() {
                        e.context("ncclCommGrow")
                    } else {
                        e
                    }
                }
                None => e,
            })?;
        drop(meeting);
        self.adopt(&child, (0..n).collect());
        Ok(child)
    }

    /// Joins a grown communicator as a new rank (`ncclCommGrow` with `comm = NULL`): `rank` is
    /// this rank in the grown communicator of `new_size` ranks (at least the old size; the
    /// existing ranks keep theirs), `id` the grow id from the coordinator.
    pub fn join_grow(new_size: usize, id: &UniqueId, rank: usize) -> Result<Communicator> {
        id.decode()?;
        Communicator::init_rank(new_size, id, rank)
    }

    /// Shrink of an in-memory parent: the lowest survivor makes a fresh id and sends it to the
    /// others over the parent's links.
    fn shrink_in_memory(&self, members: &[usize], child_rank: usize, abort: bool) -> Result<Communicator> {
        if abort || self.async_error().is_some() {
            return Err(Error::invalid_usage(
                "an in-memory communicator cannot be shrunk after it failed or with NCCL_SHRINK_ABORT: its ranks share no address to meet at; create new communicators",
            ));
        }
        let leader = members[0];
        let mut bytes = [0u8; 128];
        if self.rank() == leader {
            let id = UniqueId::new()?;
            bytes = id.bytes;
            self.group(|g| members[1..].iter().try_for_each(|&m| g.send(&id.bytes[..], m)))?;
        } else {
            self.recv(&mut bytes[..], leader)?;
        }
        Communicator::init_rank(members.len(), &UniqueId { bytes }, child_rank)
    }
}

/// The child's secret for the `epoch`-th shrink of a parent of `n` ranks to `members`: bound to
/// the parent's secret, so only the parent's ranks can join.
fn shrink_secret(parent: &Secret, epoch: u64, n: usize, members: &[usize]) -> Secret {
    let mut ctx = Vec::with_capacity(16 + 4 * members.len());
    ctx.extend_from_slice(&epoch.to_be_bytes());
    ctx.extend_from_slice(&(n as u64).to_be_bytes());
    for &m in members {
        ctx.extend_from_slice(&(m as u32).to_be_bytes());
    }
    let p = auth::prove(parent, b"oxccl-shrink", &[], &ctx);
    let mut s = [0u8; SECRET_LEN];
    s.copy_from_slice(&p[..SECRET_LEN]);
    s
}

fn encode(color: Option<u32>, key: i32, id: Option<&UniqueId>) -> Vec<u8> {
    let mut v = Vec::with_capacity(RECORD);
    v.extend_from_slice(&color.map(i64::from).unwrap_or(-1).to_le_bytes());
    v.extend_from_slice(&i64::from(key).to_le_bytes());
    v.extend_from_slice(id.map(|i| &i.bytes[..]).unwrap_or(&[0u8; 128]));
    v
}

fn decode_ck(rec: &[u8]) -> (Option<u32>, i32) {
    let c = i64::from_le_bytes(rec[..8].try_into().expect("8 bytes"));
    let k = i64::from_le_bytes(rec[8..16].try_into().expect("8 bytes"));
    (u32::try_from(c).ok(), k as i32)
}

fn decode_id(rec: &[u8]) -> UniqueId {
    let mut bytes = [0u8; 128];
    bytes.copy_from_slice(&rec[16..]);
    UniqueId { bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_ordered_by_key_then_rank() {
        let t = [(Some(1), 5), (Some(0), 0), (Some(1), 2), (None, 0), (Some(1), 2)];
        assert_eq!(split_members(&t, 1), vec![2, 4, 0]);
        assert_eq!(split_members(&t, 0), vec![1]);
        assert!(split_members(&t, 7).is_empty());
    }

    #[test]
    fn record_round_trip() {
        let id = UniqueId { bytes: [7u8; 128] };
        let r = encode(Some(3), -4, Some(&id));
        assert_eq!(decode_ck(&r), (Some(3), -4));
        assert_eq!(decode_id(&r).bytes, id.bytes);
        assert_eq!(decode_ck(&encode(None, 9, None)), (None, 9));
    }
}
