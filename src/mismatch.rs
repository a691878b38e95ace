//! Collective mismatch detection.
//!
//! Before the data of an operation, every rank sends each peer its plan talks to a small
//! signature ([`SIG_LEN`] bytes): what it called (collective, count, type, operator, root), the
//! operation's number on that link, and how many bytes it will send to and expects from that
//! peer. The bytes follow on the same ordered stream, so this costs no round trip. The peer
//! reads the signature before any data of the operation and compares it with its own: a
//! difference fails the operation with `ncclInvalidUsage` naming both sides, before a byte of
//! mismatched data is read. `OXCCL_CHECK_MISMATCH=0` turns it off.
//!
//! Peers of a matched operation are symmetric (if rank a's plan talks to b, b's talks to a),
//! so every link of the operation carries a signature both ways.

use crate::algo::{Collective, Plan, Step};
use crate::error::{Error, Result};
use crate::types::{DataType, ReduceOp};

/// Bytes of one signature on the wire.
pub const SIG_LEN: usize = 48;
const MAGIC: u32 = 0x4f58_5347; // "OXSG"
/// Signature tag of a group of several operations.
pub(crate) const GROUP_TAG: u8 = 0xff;

/// What one rank called: a single collective, or a group of several operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Collective tag (`coll_tag`), or `GROUP_TAG` for a group of several operations.
    pub tag: u8,
    /// `ncclDataType_t` value.
    pub dtype: u8,
    /// `ncclRedOp_t` value (0 for collectives that do not reduce).
    pub op: u8,
    /// Root or peer argument (`u32::MAX` when none); number of operations for a group.
    pub root: u32,
    /// Count argument (0 for a group).
    pub count: u64,
}

/// One signature: the caller's [`Desc`], the operation's number on this link, and the bytes
/// this link carries each way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signature {
    /// What was called.
    pub desc: Desc,
    /// Operation number on this link (1 for the first operation between the two ranks).
    pub seq: u64,
    /// Bytes the sender will send on this link in this operation.
    pub send_bytes: u64,
    /// Bytes the sender expects to receive on this link in this operation.
    pub recv_bytes: u64,
}

fn coll_tag(c: Collective) -> u8 {
    match c {
        Collective::AllReduce => 1,
        Collective::Broadcast { .. } => 2,
        Collective::Reduce { .. } => 3,
        Collective::AllGather => 4,
        Collective::ReduceScatter => 5,
        Collective::AllToAll => 6,
        Collective::Gather { .. } => 7,
        Collective::Scatter { .. } => 8,
        Collective::Send { .. } => 9,
        Collective::Recv { .. } => 10,
    }
}

fn tag_name(t: u8) -> &'static str {
    const NAMES: [&str; 11] = [
        "?",
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "alltoall",
        "gather",
        "scatter",
        "send",
        "recv",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown operation")
}

impl Desc {
    /// The description of one collective call.
    pub fn single(coll: Collective, count: usize, dtype: DataType, op: ReduceOp) -> Desc {
        Desc {
            tag: coll_tag(coll),
            dtype: dtype as u8,
            op: if coll.reduces() { op as u8 } else { 0 },
            root: coll.rank_arg().map_or(u32::MAX, |r| r as u32),
            count: count as u64,
        }
    }

    /// The description of a group of `n` operations.
    pub fn group(n: usize) -> Desc {
        Desc { tag: GROUP_TAG, dtype: 0, op: 0, root: n as u32, count: 0 }
    }

    fn is_p2p(&self) -> bool {
        self.tag == 9 || self.tag == 10
    }

    /// Human-readable form, e.g. `broadcast(count=1024,float,root=0)`.
    pub fn describe(&self) -> String {
        if self.tag == GROUP_TAG {
            return format!("a group of {} operations", self.root);
        }
        let dtype = DataType::from_raw(self.dtype as i32).map(|d| d.name()).unwrap_or("?type");
        let mut s = format!("{}(count={},{dtype}", tag_name(self.tag), self.count);
        if matches!(self.tag, 1 | 3 | 5) {
            s += &format!(",{}", ReduceOp::from_raw(self.op as i32).map(|o| o.name()).unwrap_or("?op"));
        }
        if self.root != u32::MAX {
            s += &format!(",{}={}", if self.is_p2p() { "peer" } else { "root" }, self.root);
        }
        s + ")"
    }
}

impl Signature {
    /// Encodes the signature into its wire form.
    pub fn encode(&self) -> [u8; SIG_LEN] {
        let mut b = [0u8; SIG_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4] = self.desc.tag;
        b[5] = self.desc.dtype;
        b[6] = self.desc.op;
        b[8..12].copy_from_slice(&self.desc.root.to_be_bytes());
        b[12..20].copy_from_slice(&self.desc.count.to_be_bytes());
        b[20..28].copy_from_slice(&self.seq.to_be_bytes());
        b[28..36].copy_from_slice(&self.send_bytes.to_be_bytes());
        b[36..44].copy_from_slice(&self.recv_bytes.to_be_bytes());
        b
    }

    /// Decodes a signature received from the network; any byte string is accepted as input
    /// and a malformed one gives an error (never a panic).
    pub fn decode(b: &[u8]) -> Result<Signature> {
        if b.len() != SIG_LEN {
            return Err(Error::remote(format!("operation signature of {} bytes (expected {SIG_LEN})", b.len())));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if u32_at(0) != MAGIC || b[7] != 0 || b[44..].iter().any(|&x| x != 0) {
            return Err(Error::remote(
                "peer sent bytes that are not an operation signature (different oxccl version, mismatch \
                 detection off on one side, or corrupted stream)",
            ));
        }
        Ok(Signature {
            desc: Desc { tag: b[4], dtype: b[5], op: b[6], root: u32_at(8), count: u64_at(12) },
            seq: u64_at(20),
            send_bytes: u64_at(28),
            recv_bytes: u64_at(36),
        })
    }
}

/// Bytes `plan` sends to and receives from `peer`.
pub fn link_bytes(plan: &Plan, peer: usize) -> (u64, u64) {
    let (mut s, mut r) = (0u64, 0u64);
    for n in &plan.nodes {
        match n.step {
            Step::Send { peer: p, src } if p == peer => s += src.len as u64,
            Step::Recv { peer: p, dst, .. } if p == peer => r += dst.len as u64,
            _ => {}
        }
    }
    (s, r)
}

/// Compares the signature `theirs` received from rank `peer` with `mine` (the one this rank
/// sent to that peer); `Err(ncclInvalidUsage)` names both sides when they do not match.
pub fn check(rank: usize, mine: &Signature, peer: usize, theirs: &Signature) -> Result<()> {
    let (a, b) = (&mine.desc, &theirs.desc);
    let collective = |d: &Desc| d.tag != GROUP_TAG && !d.is_p2p();
    let same_call = if collective(a) && collective(b) {
        a == b
    } else if a.tag == GROUP_TAG || b.tag == GROUP_TAG {
        // A group may hold anything (e.g. sends matched by the peer's plain receives): only the
        // link's bytes can be compared.
        true
    } else {
        // Point-to-point on one side must be point-to-point on the other.
        a.is_p2p() && b.is_p2p()
    };
    // A group's link bytes are not comparable with a single call's (the sides' signatures are
    // counted over different plans), so a group is only checked for its sequence number.
    let grouped = a.tag == GROUP_TAG || b.tag == GROUP_TAG;
    let bytes_agree = grouped || (mine.send_bytes == theirs.recv_bytes && mine.recv_bytes == theirs.send_bytes);
    if mine.seq == theirs.seq && same_call && bytes_agree {
        return Ok(());
    }
    let mut msg = format!(
        "collective mismatch: rank {rank} called {} as operation #{} with rank {peer}, but rank {peer} called {} as operation #{}",
        a.describe(),
        mine.seq,
        b.describe(),
        theirs.seq
    );
    if same_call && !bytes_agree {
        msg += &format!(
            " (rank {rank} sends {} B and expects {} B on this link; rank {peer} sends {} B and expects {} B)",
            mine.send_bytes, mine.recv_bytes, theirs.send_bytes, theirs.recv_bytes
        );
    }
    Err(Error::invalid_usage(msg))
}

/// The signature exchange of one operation, driven by the engine: per peer, the bytes still to
/// send, the bytes received so far, and whether the peer's signature was checked.
pub struct Exchange {
    rank: usize,
    peers: Vec<Option<PeerSig>>,
}

struct PeerSig {
    mine: Signature,
    out: [u8; SIG_LEN],
    /// The bytes a matching peer sends (this signature with the two byte counts swapped):
    /// the common case is one comparison, no decoding.
    expect: [u8; SIG_LEN],
    sent: usize,
    input: [u8; SIG_LEN],
    got: usize,
    checked: bool,
}

impl Exchange {
    /// An exchange for `rank` of `n` ranks with no peers yet.
    pub fn new(rank: usize, n: usize) -> Exchange {
        Exchange { rank, peers: (0..n).map(|_| None).collect() }
    }

    /// Empties the exchange for a new operation of `rank` of `n` ranks, keeping its memory.
    pub fn reset(&mut self, rank: usize, n: usize) {
        self.rank = rank;
        self.peers.clear();
        self.peers.resize_with(n, || None);
    }

    /// Adds `peer` with the signature this rank sends it.
    pub fn add(&mut self, peer: usize, mine: Signature) {
        let expect = Signature { send_bytes: mine.recv_bytes, recv_bytes: mine.send_bytes, ..mine }.encode();
        self.peers[peer] =
            Some(PeerSig { mine, out: mine.encode(), expect, sent: 0, input: [0; SIG_LEN], got: 0, checked: false });
    }

    /// The bytes still to send to `peer` (empty when done or not a peer).
    pub fn pending_out(&self, peer: usize) -> &[u8] {
        self.peers.get(peer).and_then(|p| p.as_ref()).map_or(&[][..], |p| &p.out[p.sent..])
    }

    /// Records that `n` more bytes went out to `peer`.
    pub fn sent(&mut self, peer: usize, n: usize) {
        if let Some(Some(p)) = self.peers.get_mut(peer) {
            p.sent = (p.sent + n).min(SIG_LEN);
        }
    }

    /// Whether the signature of `peer` is still to be received and checked.
    pub fn wants_input(&self, peer: usize) -> bool {
        self.peers.get(peer).and_then(|p| p.as_ref()).is_some_and(|p| !p.checked)
    }

    /// The buffer the rest of `peer`'s signature goes into.
    pub fn input_buf(&mut self, peer: usize) -> &mut [u8] {
        match self.peers.get_mut(peer) {
            Some(Some(p)) => &mut p.input[p.got..],
            _ => &mut [],
        }
    }

    /// Records `n` more bytes received from `peer`; once the signature is whole, checks it.
    pub fn received(&mut self, peer: usize, n: usize) -> Result<()> {
        let rank = self.rank;
        let Some(Some(p)) = self.peers.get_mut(peer) else { return Ok(()) };
        p.got += n;
        if p.got < SIG_LEN {
            return Ok(());
        }
        p.checked = true;
        if p.input == p.expect {
            return Ok(());
        }
        let theirs = Signature::decode(&p.input).map_err(|e| e.context(format!("rank {peer}")))?;
        check(rank, &p.mine, peer, &theirs)
    }

    /// The bytes of `peer`'s signature received so far.
    pub fn received_so_far(&self, peer: usize) -> &[u8] {
        self.peers.get(peer).and_then(|p| p.as_ref()).map_or(&[][..], |p| &p.input[..p.got.min(SIG_LEN)])
    }

    /// The signature this rank sends `peer` in this operation, if it talks to that peer.
    pub fn mine(&self, peer: usize) -> Option<&Signature> {
        self.peers.get(peer).and_then(|p| p.as_ref()).map(|p| &p.mine)
    }

    /// Whether every signature went out and every peer's was checked.
    pub fn done(&self) -> bool {
        self.peers.iter().flatten().all(|p| p.checked && p.sent == SIG_LEN)
    }
}
