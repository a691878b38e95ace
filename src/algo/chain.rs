//! Pipelined chains for rooted collectives (NCCL's ring broadcast and reduce).
//!
//! The chain is `root -> root+1 -> ... -> root+n-1`: a tree in which every rank has one child,
//! so the pipelined tree schedules of [`super::tree`] run on it unchanged. Broadcast: every rank
//! stores each chunk and forwards it at once, so after the pipeline fills every link carries
//! one chunk at a time and each rank sends the message exactly once. Reduce flows the other
//! way, `root+n-1 -> ... -> root+1 -> root`, each rank adding its input to each chunk on the way.

use super::tree::{self, Node};
use super::Plan;

/// `rank`'s place in the chain that starts at `root`.
pub fn chain(n: usize, rank: usize, root: usize) -> Node {
    let pos = (rank + n - root) % n;
    let parent = (pos > 0).then(|| (rank + n - 1) % n);
    let child = (pos + 1 < n).then(|| (rank + 1) % n);
    Node { parent, children: [child, None] }
}

/// Rank `rank`'s chain broadcast of `count` elements from `root`.
pub fn broadcast(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    tree::broadcast_on(chain(n, rank, root), count, elem, chunk_bytes)
}

/// Rank `rank`'s chain reduce of `count` elements to `root`.
pub fn reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    tree::reduce_on(chain(n, rank, root), n, count, elem, chunk_bytes)
}
