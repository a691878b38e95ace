"""Point-to-point messages with tags and receives from any source, over NCCL send/recv.

NCCL matches sends and receives per peer in order and has neither tags nor any-source
receives; torch's Gloo backend has both. Here every message is a fixed-size header
(magic, tag, byte count) followed by its payload. A receive for tag T from rank S reads
S's messages in order: one with tag T lands in the caller's tensor; one with another tag is
kept (stashed) for the receive that asks for it, so data is never swapped between tags.

Receives from any source: every send also bumps a counter in the group's c10d store
(``oxccl/p2p/<dst>/<src>/<tag>``); a receive from any source takes a stashed message with
its tag, or polls those counters for a peer that announced more messages with the tag than
this rank has read, then receives from it. The poll is bounded by the group's timeout.
"""

from __future__ import annotations

import collections
import time
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..comm import Communicator, group
from .ops import as_bytes

MAGIC = 0x6F78_6363_6C50_3250  # "oxcclP2P"
HEADER = 3  # int64 words: magic, tag, bytes


def _key(dst: int, src: int, tag: int) -> str:
    return f"oxccl/p2p/{dst}/{src}/{tag}"


class Messages:
    """This rank's tagged message state for one communicator (used on the worker thread)."""

    def __init__(self, comm: Communicator, store: Optional[dist.Store], timeout_s: float):
        self.comm = comm
        self.store = store
        self.timeout_s = timeout_s
        self.stash: Dict[int, Deque[Tuple[int, torch.Tensor]]] = collections.defaultdict(collections.deque)
        self.seen: Dict[Tuple[int, int], int] = collections.defaultdict(int)

    # -- sending ---------------------------------------------------------------------------

    def announce(self, dst: int, tag: int) -> None:
        if self.store is not None:
            self.store.add(_key(dst, self.comm.rank, tag), 1)

    @staticmethod
    def header(tag: int, payload: torch.Tensor) -> torch.Tensor:
        return torch.tensor([MAGIC, tag, payload.numel()], dtype=torch.int64)

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> None:
        """Sends ``payload`` (flat uint8) with ``tag`` to ``dst``."""
        self.announce(dst, tag)
        self.comm.send(self.header(tag, payload), dst)
        if payload.numel():
            self.comm.send(payload, dst)

    # -- receiving -------------------------------------------------------------------------

    def _check(self, h: torch.Tensor, src: int) -> Tuple[int, int]:
        magic, tag, n = (int(x) for x in h.tolist())
        if magic != MAGIC:
            raise RuntimeError(
                f"recv from rank {src}: the peer's message is not a tagged oxccl message "
                "(was it sent by a collective or by a liboxccl user outside torch?)"
            )
        self.seen[(src, tag)] += 1
        return tag, n

    def _take_stashed(self, src: int, tag: int) -> Optional[torch.Tensor]:
        q = self.stash.get(src)
        if not q:
            return None
        for i, (t, data) in enumerate(q):
            if t == tag:
                del q[i]
                return data
        return None

    @staticmethod
    def _deliver(data: torch.Tensor, out: torch.Tensor, src: int, tag: int) -> None:
        if data.numel() != out.numel():
            raise RuntimeError(
                f"recv from rank {src} tag {tag}: the message has {data.numel()} bytes but the "
                f"receiving tensor has {out.numel()}"
            )
        out.copy_(data)

    def recv(self, out: torch.Tensor, src: int, tag: int) -> None:
        """Receives the next message with ``tag`` from ``src`` into ``out`` (flat uint8)."""
        data = self._take_stashed(src, tag)
        if data is not None:
            self._deliver(data, out, src, tag)
            return
        h = torch.empty(HEADER, dtype=torch.int64)
        while True:
            self.comm.recv(h, src)
            got, n = self._check(h, src)
            if got == tag and n == out.numel():
                if n:
                    self.comm.recv(out, src)
                return
            data = torch.empty(n, dtype=torch.uint8)
            if n:
                self.comm.recv(data, src)
            if got == tag:
                self._deliver(data, out, src, tag)  # raises: sizes differ
            self.stash[src].append((got, data))

    def recv_any(self, out: torch.Tensor, tag: int) -> int:
        """Receives the next message with ``tag`` from whichever rank sent one; returns it."""
        for src, q in self.stash.items():
            if any(t == tag for t, _ in q):
                self.recv(out, src, tag)
                return src
        if self.store is None:
            raise RuntimeError("recv from any source needs the group's store (none was given)")
        me, n = self.comm.rank, self.comm.size
        deadline = time.monotonic() + self.timeout_s
        step = 0.0005
        while True:
            for src in range(n):
                if src != me and self.store.add(_key(me, src, tag), 0) > self.seen[(src, tag)]:
                    self.recv(out, src, tag)
                    return src
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"recv from any source (tag {tag}): no rank sent a message within "
                    f"{self.timeout_s:.1f} s (the group's timeout)"
                )
            time.sleep(step)
            step = min(step * 2, 0.02)

    # -- batches (batch_isend_irecv) -------------------------------------------------------

    def batch(self, sends: List[Tuple[torch.Tensor, int, int]], recvs: List[Tuple[torch.Tensor, int, int]]) -> None:
        """Runs sends (payload, dst, tag) and receives (out, src, tag) together, as NCCL
        groups: headers first, then payloads. A received message whose tag is not the one
        its receive asked for is stashed; a receive left without its message is an error."""
        for p, dst, tag in sends:
            self.announce(dst, tag)
        pending = []
        for out, src, tag in recvs:
            data = self._take_stashed(src, tag)
            if data is not None:
                self._deliver(data, out, src, tag)
            else:
                pending.append((out, src, tag, torch.empty(HEADER, dtype=torch.int64)))
        with group():
            for p, dst, tag in sends:
                self.comm.send(self.header(tag, p), dst)
            for _, src, _, h in pending:
                self.comm.recv(h, src)
        landing = []
        for out, src, tag, h in pending:
            got, n = self._check(h, src)
            buf = out if (got == tag and n == out.numel()) else torch.empty(n, dtype=torch.uint8)
            landing.append((out, src, tag, got, buf))
        with group():
            for p, dst, _ in sends:
                if p.numel():
                    self.comm.send(p, dst)
            for _, src, _, _, buf in landing:
                if buf.numel():
                    self.comm.recv(buf, src)
        missing = []
        for out, src, tag, got, buf in landing:
            if buf is not out:
                self.stash[src].append((got, buf))
        for out, src, tag, got, buf in landing:
            if buf is not out:
                data = self._take_stashed(src, tag)
                if data is None:
                    missing.append(f"rank {src} sent tag {got} where tag {tag} was expected")
                else:
                    self._deliver(data, out, src, tag)
        if missing:
            raise RuntimeError("batch_isend_irecv: " + "; ".join(missing) + " (its data is kept for a later recv)")


def payload(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor to send."""
    return as_bytes(t)
