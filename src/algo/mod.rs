//! Collective schedules, free of I/O ("sans-IO").
//!
//! An algorithm turns a collective call into a [`Plan`]: for one rank, a list of [`Step`]s that
//! send a region of a buffer to a peer, receive bytes from a peer (storing them or reducing
//! them into a buffer), or copy locally, each step waiting for the steps it depends on. The
//! [`engine`](crate::engine) runs a plan over real links; tests run plans over in-memory
//! links with hundreds of ranks.
//!
//! Contract: messages between two ranks are matched by order. For every pair (a, b), the
//! sequence of `Send { peer: b }` steps in a's plan must have the same lengths, in the same
//! order, as the `Recv { peer: a }` steps in b's plan.
#![forbid(unsafe_code)]

pub mod cache;
pub mod chain;
pub mod collective;
pub mod compress;
pub mod det;
pub mod direct;
pub mod hier;
pub mod oneshot;
pub mod rd;
pub mod ring;
pub mod select;
#[cfg(test)]
pub(crate) mod sim;
pub mod tree;
pub mod tuning;
pub mod validate;
pub mod window;

pub use crate::reduce::codec::Encoding;
pub use collective::{build, build_on, Collective};
pub use select::{select, Request, Route};

/// Pipeline chunk in bytes where neither the settings nor the cost model choose one (the
/// one-shot and hierarchical all-reduce).
pub const DEFAULT_CHUNK: usize = 512 << 10;
pub use tuning::{Algo, AlgoSet, Choice, TransportKind};

/// Which of the call's buffers a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The caller's send buffer (read-only).
    Send,
    /// The caller's receive buffer.
    Recv,
    /// Temporary memory owned by the engine for this call ([`Plan::scratch`] bytes).
    Scratch,
}

/// A byte range of one of the call's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Which call of a group the buffer belongs to (0 for a single collective).
    pub call: usize,
    /// Which buffer.
    pub buf: Buf,
    /// Byte offset in it.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Region {
    /// A region of the send buffer.
    pub const fn send(off: usize, len: usize) -> Region {
        Region { call: 0, buf: Buf::Send, off, len }
    }
    /// A region of the receive buffer.
    pub const fn recv(off: usize, len: usize) -> Region {
        Region { call: 0, buf: Buf::Recv, off, len }
    }
    /// A region of the call's scratch memory.
    pub const fn scratch(off: usize, len: usize) -> Region {
        Region { call: 0, buf: Buf::Scratch, off, len }
    }
    /// The same bytes, `off` bytes further and `len` long.
    pub const fn sub(self, off: usize, len: usize) -> Region {
        Region { call: self.call, buf: self.buf, off: self.off + off, len }
    }
}

/// What to do with received bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Store them into `dst` directly.
    Store,
    /// `dst = with op incoming`.
    Reduce {
        /// The local operand.
        with: Region,
    },
    /// Like `Reduce`, then finish the operator (divide by the rank count for `Avg`).
    ReduceFinal {
        /// The local operand.
        with: Region,
    },
}

/// One step of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send `src` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Bytes to send.
        src: Region,
    },
    /// Receive `dst.len` bytes from `peer` and apply `action` into `dst`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where the result goes.
        dst: Region,
        /// How it is combined.
        action: Action,
    },
    /// Copy `src` to `dst` (memmove semantics; a copy onto itself is skipped).
    Copy {
        /// From.
        src: Region,
        /// To.
        dst: Region,
    },
    /// Finish the operator on `dst` (divide by the rank count for `Avg`); no-op otherwise.
    Finish {
        /// Region to finish.
        dst: Region,
    },
    /// The fixed-order reduction ([`crate::reduce::fold`]): `src` holds one `dst.len`-byte
    /// piece per rank, end to end in rank order; `dst` = their left fold, operator finished
    /// (`Avg` divided by the number of pieces). `dst` must not overlap `src`.
    Fold {
        /// The pieces, in rank order.
        src: Region,
        /// Where the result goes.
        dst: Region,
    },
    /// Writes the `f32` elements of `src` in wire encoding `enc` into `dst`
    /// (`dst.len == enc.size(src.len / 4)`; [`crate::reduce::codec`]). `dst` must not overlap `src`.
    Encode {
        /// The `f32` elements.
        src: Region,
        /// Their encoding.
        dst: Region,
        /// The wire encoding.
        enc: Encoding,
    },
    /// Reads `src` (written by [`Step::Encode`] with `enc`) back into the `f32` elements of
    /// `dst`, or, with `add`, adds them into `dst` in `f32`. `dst` must not overlap `src`.
    Decode {
        /// The encoded bytes.
        src: Region,
        /// The `f32` elements.
        dst: Region,
        /// The wire encoding.
        enc: Encoding,
        /// `dst += decoded` instead of `dst = decoded`.
        add: bool,
    },
}

/// A step with the indices of the steps that must complete before it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The work.
    pub step: Step,
    /// Indices (into [`Plan::nodes`]) of steps this one waits for.
    pub deps: Vec<usize>,
}

/// One rank's schedule for one collective.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Steps in issue order; per-peer send/recv order is the order here.
    pub nodes: Vec<Node>,
    /// Scratch bytes each call needs (indexed by [`Region::call`]; missing means none).
    pub scratch: Vec<usize>,
}

impl Plan {
    /// Appends a step and returns its index.
    pub fn push(&mut self, step: Step, deps: Vec<usize>) -> usize {
        self.nodes.push(Node { step, deps });
        self.nodes.len() - 1
    }
    /// Appends `other` (a single call's plan) as call number `call` of this plan: its regions
    /// are renumbered to `call` and its dependencies shifted. Running the merged plan runs
    /// both calls concurrently; per-peer order is this plan's messages, then `other`'s.
    pub fn append(&mut self, other: Plan, call: usize) {
        let base = self.nodes.len();
        let fix = |r: &mut Region| r.call = call;
        for mut node in other.nodes {
            match &mut node.step {
                Step::Send { src, .. } => fix(src),
                Step::Recv { dst, action, .. } => {
                    fix(dst);
                    if let Action::Reduce { with } | Action::ReduceFinal { with } = action {
                        fix(with);
                    }
                }
                Step::Copy { src, dst } => {
                    fix(src);
                    fix(dst);
                }
                Step::Finish { dst } => fix(dst),
                Step::Fold { src, dst } | Step::Encode { src, dst, .. } | Step::Decode { src, dst, .. } => {
                    fix(src);
                    fix(dst);
                }
            }
            node.deps.iter_mut().for_each(|d| *d += base);
            self.nodes.push(node);
        }
        if self.scratch.len() <= call {
            self.scratch.resize(call + 1, 0);
        }
        self.scratch[call] = self.scratch[call].max(other.scratch.first().copied().unwrap_or(0));
    }
    /// Sets the scratch bytes of call 0.
    pub fn with_scratch(mut self, bytes: usize) -> Plan {
        if self.scratch.is_empty() {
            self.scratch.push(0);
        }
        self.scratch[0] = bytes;
        self
    }
    /// Largest receive that needs staging (a reduce), in bytes.
    pub fn max_staged_recv(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|n| match n.step {
                Step::Recv { dst, action: Action::Reduce { .. } | Action::ReduceFinal { .. }, .. } => Some(dst.len),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }
    /// Ranks this plan talks to.
    pub fn peers(&self) -> Vec<usize> {
        let mut p = Vec::new();
        self.peers_into(&mut p);
        p
    }

    /// [`Plan::peers`] into `out` (cleared first; its memory is reused).
    pub fn peers_into(&self, out: &mut Vec<usize>) {
        out.clear();
        out.extend(self.nodes.iter().filter_map(|n| match n.step {
            Step::Send { peer, .. } | Step::Recv { peer, .. } => Some(peer),
            _ => None,
        }));
        out.sort_unstable();
        out.dedup();
    }
}

/// The plan of a reduction that needs no communication: empty for `count == 0`; on one rank,
/// copy the `total` input bytes to offset `out` of the receive buffer and finish the operator.
/// `None` otherwise.
pub fn trivial_reduction(n: usize, count: usize, total: usize, out: usize) -> Option<Plan> {
    let mut plan = Plan::default();
    if count > 0 && n == 1 {
        let c = plan.push(Step::Copy { src: Region::send(0, total), dst: Region::recv(out, total) }, vec![]);
        plan.push(Step::Finish { dst: Region::recv(out, total) }, vec![c]);
    }
    (count == 0 || n == 1).then_some(plan)
}

/// Splits `count` elements into `parts` nearly equal contiguous ranges `(first, len)`.
pub fn partition(count: usize, parts: usize) -> Vec<(usize, usize)> {
    let base = count / parts;
    let extra = count % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = (start, len);
            start += len;
            r
        })
        .collect()
}

/// Byte ranges `(off, len)` of the chunks of `count` elements of `elem` bytes, each at most
/// `chunk_bytes` long (but at least one element).
pub fn byte_chunks(count: usize, elem: usize, chunk_bytes: usize) -> Vec<(usize, usize)> {
    chunks(count, (chunk_bytes / elem).max(1)).map(|(o, l)| (o * elem, l * elem)).collect()
}

/// Splits `len` elements into chunks of at most `chunk` elements `(first, len)`.
pub fn chunks(len: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(chunk.max(1))).filter_map(move |c| chunk_at(len, chunk, c))
}

/// Chunk `c` of [`chunks`]`(len, chunk)`, if there is one, without walking the ones before it.
pub fn chunk_at(len: usize, chunk: usize, c: usize) -> Option<(usize, usize)> {
    let chunk = chunk.max(1);
    let first = c.checked_mul(chunk).filter(|&f| f < len)?;
    Some((first, chunk.min(len - first)))
}

/// The lengths, in plan order, of the messages `plan` sends to `peer` (`sending`) or receives
/// from it: two ranks' plans pair up when a's sends to b equal b's receives from a.
#[cfg(test)]
pub(crate) fn message_lens(plan: &Plan, peer: usize, sending: bool) -> Vec<usize> {
    plan.nodes
        .iter()
        .filter_map(|x| match x.step {
            Step::Send { peer: p, src } if sending && p == peer => Some(src.len),
            Step::Recv { peer: p, dst, .. } if !sending && p == peer => Some(dst.len),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_covers_everything() {
        for count in [0, 1, 5, 7, 100, 1001] {
            for parts in 1..9 {
                let p = partition(count, parts);
                assert_eq!(p.len(), parts);
                assert_eq!(p.iter().map(|x| x.1).sum::<usize>(), count);
                let mut next = 0;
                for (s, l) in p {
                    assert_eq!(s, next);
                    next += l;
                }
            }
        }
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(0, 4).count(), 0);
        for (len, chunk) in [(10, 4), (12, 4), (1, 8), (0, 3), (7, 0)] {
            let all: Vec<_> = chunks(len, chunk).collect();
            for c in 0..all.len() + 2 {
                assert_eq!(chunk_at(len, chunk, c), all.get(c).copied(), "len {len} chunk {chunk} c {c}");
            }
        }
        assert_eq!(chunk_at(10, 4, usize::MAX), None);
    }
}
