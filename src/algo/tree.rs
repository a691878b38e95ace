//! Binary trees: NCCL's double binary tree all-reduce, and pipelined tree broadcast and reduce.
//!
//! **The tree** ([`btree`]) is NCCL's: rooted at 0, rank `r` with lowest set bit `b` has parent
//! `(r ^ b) | (b << 1)` (or `r ^ b` when that is out of range) and children `r - b/2` and the
//! largest `r + b/2^k` in range. Even ranks are interior, odd ranks are leaves.
//!
//! **The double tree** ([`dtree`]) adds a second tree in which the roles swap: for an even rank
//! count it is the mirror image (`r -> n-1-r`), for an odd count the first tree shifted by one
//! rank. Every rank is then a leaf in one tree and interior in at most the other, so each rank
//! sends and receives about the same amount, and both trees together use the links evenly.
//!
//! **All-reduce** ([`all_reduce`]) gives each tree half of the data. Per chunk, a node reduces
//! its children's partial sums with its own input and sends the result up; the root finishes
//! the operator (`Avg`) and the result travels back down, each node storing it and forwarding it
//! to its children. Chunks are pipelined: chunk `k+1` goes up while chunk `k` comes down.
//!
//! Message order: both ranks of a link must see the messages between them in the same order
//! (see [`super`]). Every rank emits its steps in one global order of (round, tree, phase): in
//! round `j`, chunk `j` of each tree goes up and chunk `j - lag` comes down, with `lag` a little
//! more than a round trip through the tree, so the up-going pipeline is never stalled behind a
//! down-going chunk that cannot have arrived yet.

use super::{byte_chunks, chunks, partition, trivial_reduction, Action, Plan, Region, Step};

/// A rank's neighbours in one tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// Parent rank (`None` at the root).
    pub parent: Option<usize>,
    /// Up to two children.
    pub children: [Option<usize>; 2],
}

impl Node {
    /// The children that exist, in order.
    pub fn kids(&self) -> impl Iterator<Item = usize> + '_ {
        self.children.iter().flatten().copied()
    }
    fn map(self, f: impl Fn(usize) -> usize) -> Node {
        Node { parent: self.parent.map(&f), children: self.children.map(|c| c.map(&f)) }
    }
}

/// NCCL's binary tree over ranks `0..n`, rooted at 0 (see the module docs).
pub fn btree(n: usize, rank: usize) -> Node {
    if n <= 1 {
        return Node::default();
    }
    let mut bit = 1;
    while bit < n && bit & rank == 0 {
        bit <<= 1;
    }
    if rank == 0 {
        // `bit` is the smallest power of two >= n: the root has one child, the largest power
        // of two below n.
        return Node { parent: None, children: [Some(bit >> 1), None] };
    }
    let mut up = (rank ^ bit) | (bit << 1);
    if up >= n {
        up = rank ^ bit;
    }
    let low = bit >> 1;
    let down0 = (low > 0).then(|| rank - low);
    let mut step = low;
    while step > 0 && rank + step >= n {
        step >>= 1;
    }
    let down1 = (step > 0).then(|| rank + step);
    Node { parent: Some(up), children: [down0, down1] }
}

/// The binary tree with its root moved to `root` (relative ranks, then shifted back).
pub fn rooted(n: usize, rank: usize, root: usize) -> Node {
    btree(n, (rank + n - root) % n).map(|r| (r + root) % n)
}

/// Both trees of NCCL's double binary tree for `rank`.
pub fn dtree(n: usize, rank: usize) -> [Node; 2] {
    let first = btree(n, rank);
    let second = if n % 2 == 1 {
        btree(n, (rank + n - 1) % n).map(|r| (r + 1) % n)
    } else {
        btree(n, n - 1 - rank).map(|r| n - 1 - r)
    };
    [first, second]
}

/// Number of levels below the root of a tree given by `node_of(rank)` (0 for one rank).
pub fn height(n: usize, node_of: impl Fn(usize) -> Node) -> usize {
    (0..n)
        .map(|r| {
            let (mut d, mut at) = (0, r);
            while let Some(p) = node_of(at).parent {
                d += 1;
                at = p;
                if d > n {
                    break; // not a tree; cannot happen for the trees above
                }
            }
            d
        })
        .max()
        .unwrap_or(0)
}

/// One chunk of one tree: the byte range it covers.
#[derive(Clone, Copy)]
struct Piece {
    off: usize,
    len: usize,
}

/// Bookkeeping of one tree's up phase for one chunk.
#[derive(Clone, Copy, Default)]
struct Up {
    /// The step that leaves the fully reduced value at this node (root) / the last reduction.
    last: Option<usize>,
    /// The step that sends this node's partial result up.
    sent: Option<usize>,
}

/// Receives the children's values of `p` and reduces them into the receive buffer (with this
/// rank's input as the first operand); at the root the last reduction finishes the operator.
/// Returns the index of the last reduction (or `None` at a leaf).
fn reduce_children(plan: &mut Plan, node: &Node, acc: Region, input: Region, root: bool) -> Option<usize> {
    let kids: Vec<usize> = node.kids().collect();
    let mut last: Option<usize> = None;
    for (i, &kid) in kids.iter().enumerate() {
        let with = if last.is_some() { acc } else { input };
        let action = if root && i + 1 == kids.len() { Action::ReduceFinal { with } } else { Action::Reduce { with } };
        last = Some(plan.push(Step::Recv { peer: kid, dst: acc, action }, last.into_iter().collect()));
    }
    last
}

/// Rank `rank`'s double-binary-tree all-reduce plan for `count` elements of `elem` bytes on `n`
/// ranks, chunks of at most `chunk_bytes` per tree.
pub fn all_reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if let Some(p) = trivial_reduction(n, count, total, 0) {
        return p;
    }
    let trees = dtree(n, rank);
    let chunk_elems = (chunk_bytes / elem).max(1);
    let pieces: Vec<Vec<Piece>> = partition(count, 2)
        .into_iter()
        .map(|(first, len)| {
            chunks(len, chunk_elems).map(|(o, l)| Piece { off: (first + o) * elem, len: l * elem }).collect()
        })
        .collect();
    let depth = height(n, |r| dtree(n, r)[0]).max(height(n, |r| dtree(n, r)[1]));
    let lag = 2 * depth + 1;
    let rounds = pieces.iter().map(Vec::len).max().unwrap_or(0);
    let mut ups: Vec<Vec<Up>> = pieces.iter().map(|p| vec![Up::default(); p.len()]).collect();
    for j in 0..rounds + lag {
        for t in 0..2 {
            let node = &trees[t];
            if let Some(&p) = pieces[t].get(j) {
                let (acc, input) = (Region::recv(p.off, p.len), Region::send(p.off, p.len));
                let last = reduce_children(&mut plan, node, acc, input, node.parent.is_none());
                let sent = node.parent.map(|up| {
                    let src = if last.is_some() { acc } else { input };
                    plan.push(Step::Send { peer: up, src }, last.into_iter().collect())
                });
                ups[t][j] = Up { last, sent };
            }
            if j < lag {
                continue;
            }
            let k = j - lag;
            let Some(&p) = pieces[t].get(k) else { continue };
            let acc = Region::recv(p.off, p.len);
            let up = ups[t][k];
            let ready = match node.parent {
                // Storing overwrites what this rank sent up (in place, even a leaf's input).
                Some(parent) => plan
                    .push(Step::Recv { peer: parent, dst: acc, action: Action::Store }, up.sent.into_iter().collect()),
                None => up.last.expect("the root of a tree with more than one rank has a child"),
            };
            for kid in node.kids() {
                plan.push(Step::Send { peer: kid, src: acc }, vec![ready]);
            }
        }
    }
    plan
}

/// Pipelined broadcast down the binary tree rooted at `root`: each chunk is stored and
/// forwarded to both children as soon as it arrives.
pub fn broadcast(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    broadcast_on(rooted(n, rank, root), count, elem, chunk_bytes)
}

/// Pipelined reduce up the binary tree rooted at `root`.
pub fn reduce(rank: usize, n: usize, count: usize, elem: usize, chunk_bytes: usize, root: usize) -> Plan {
    reduce_on(rooted(n, rank, root), n, count, elem, chunk_bytes)
}

/// Pipelined broadcast over any tree, given this rank's place in it (the root has no parent):
/// every chunk is stored and forwarded to the children as soon as it arrives.
pub fn broadcast_on(node: Node, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if count == 0 {
        return plan;
    }
    if node.parent.is_none() {
        plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(0, total) }, vec![]);
    }
    for (off, len) in byte_chunks(count, elem, chunk_bytes) {
        let (src, deps) = match node.parent {
            None => (Region::send(off, len), vec![]),
            Some(parent) => {
                let i =
                    plan.push(Step::Recv { peer: parent, dst: Region::recv(off, len), action: Action::Store }, vec![]);
                (Region::recv(off, len), vec![i])
            }
        };
        for kid in node.kids() {
            plan.push(Step::Send { peer: kid, src }, deps.clone());
        }
    }
    plan
}

/// Pipelined reduce over any tree of `n` ranks, given this rank's place in it: each chunk is
/// reduced with the children's partial results and sent up; the root finishes the operator.
/// Partial results of non-root ranks live in scratch memory (NCCL's `recvbuff` only matters at
/// the root).
pub fn reduce_on(node: Node, n: usize, count: usize, elem: usize, chunk_bytes: usize) -> Plan {
    let mut plan = Plan::default();
    let total = count * elem;
    if let Some(p) = trivial_reduction(n, count, total, 0) {
        return p;
    }
    let is_root = node.parent.is_none();
    for (off, len) in byte_chunks(count, elem, chunk_bytes) {
        let acc = if is_root { Region::recv(off, len) } else { Region::scratch(off, len) };
        let input = Region::send(off, len);
        let last = reduce_children(&mut plan, &node, acc, input, is_root);
        if let Some(up) = node.parent {
            let src = if last.is_some() { acc } else { input };
            plan.push(Step::Send { peer: up, src }, last.into_iter().collect());
        }
    }
    if node.kids().next().is_some() && !is_root {
        plan = plan.with_scratch(total);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every child names its parent, every non-root rank has exactly one parent that lists it,
    /// and walking up from any rank reaches the root.
    fn assert_tree(n: usize, node_of: impl Fn(usize) -> Node, root: usize) {
        let mut listed = vec![0; n];
        for r in 0..n {
            let node = node_of(r);
            for k in node.kids() {
                assert!(k < n && k != r, "n={n} r={r} kid {k}");
                assert_eq!(node_of(k).parent, Some(r), "n={n}: {k}'s parent should be {r}");
                listed[k] += 1;
            }
            assert_eq!(node.parent.is_none(), r == root, "n={n} r={r}");
        }
        for (r, &count) in listed.iter().enumerate() {
            assert_eq!(count, usize::from(r != root), "n={n} r={r}");
        }
        assert!(height(n, &node_of) <= 2 * (usize::BITS - n.leading_zeros()) as usize);
    }

    #[test]
    fn trees_are_trees() {
        for n in 1..70 {
            assert_tree(n, |r| btree(n, r), 0);
            assert_tree(n, |r| dtree(n, r)[0], 0);
            let root1 = if n % 2 == 1 && n > 1 { 1 } else { n - 1 };
            assert_tree(n, |r| dtree(n, r)[1], root1);
            for root in [0, n / 2, n - 1] {
                assert_tree(n, |r| rooted(n, r, root), root);
            }
        }
    }

    #[test]
    fn double_tree_rank_is_interior_in_at_most_one_tree() {
        for n in 2..70 {
            for r in 0..n {
                let [a, b] = dtree(n, r);
                let interior = |x: &Node| x.kids().next().is_some() && x.parent.is_some();
                assert!(!(interior(&a) && interior(&b)), "n={n} r={r}: {a:?} {b:?}");
            }
        }
    }

    #[test]
    fn nccl_example_shapes() {
        // The 14-rank illustration in NCCL's trees.cc: 0 -> 8 -> {4, 12}, 12 -> {10, 13}.
        assert_eq!(btree(14, 0).children, [Some(8), None]);
        assert_eq!(btree(14, 8).children, [Some(4), Some(12)]);
        assert_eq!(btree(14, 12).children, [Some(10), Some(13)]);
        assert_eq!(btree(14, 13).parent, Some(12));
        assert_eq!(btree(14, 7).parent, Some(6));
    }
}
