"""Checks run on every rank of a :class:`ranks.RankPool` (``check(comm, *args)``).

Each check issues the same collectives on every rank, then compares this rank's result with
a reference built from every rank's (deterministic) input; it returns the number of results
it verified, so the parent can assert that something was checked.
"""

from __future__ import annotations

import time

import numpy as np

import oxccl
from data import OPS, is_int, make, np_dtype, reduce_ref, same


def setup(rank: int, size: int, uid: bytes):
    return oxccl.Communicator(rank, size, uid)


def teardown(comm) -> None:
    comm.destroy()


def _inputs(comm, name, count, seed):
    return [make(name, count, r, seed) for r in range(comm.size)]


def all_reduce(comm, name, count, seed):
    done = 0
    for op in OPS:
        inputs = _inputs(comm, name, count, seed)
        want = reduce_ref(op, inputs, name)
        mine = inputs[comm.rank]
        send = mine.copy()
        recv = np.full_like(mine, 7) if count else np.empty_like(mine)
        assert comm.all_reduce(send, recv, op=op) is recv
        same(recv, want, f"all_reduce {name} {op} out-of-place")
        same(send, mine, f"all_reduce {name} {op}: send buffer changed")
        buf = mine.copy()
        assert comm.all_reduce(buf, op=op) is buf
        same(buf, want, f"all_reduce {name} {op} in place")
        done += 2
    return done


def broadcast(comm, name, count, seed):
    done = 0
    for root in range(comm.size):
        inputs = _inputs(comm, name, count, seed)
        mine = inputs[comm.rank]
        recv = np.zeros_like(mine)
        comm.broadcast(mine.copy(), recv, root=root)
        same(recv, inputs[root], f"broadcast {name} root {root} out-of-place")
        buf = mine.copy()
        comm.broadcast(buf, root=root)
        same(buf, inputs[root], f"broadcast {name} root {root} in place")
        done += 2
    return done


def reduce(comm, name, count, seed):
    done = 0
    for op in OPS:
        for root in range(comm.size):
            inputs = _inputs(comm, name, count, seed)
            mine = inputs[comm.rank]
            want = reduce_ref(op, inputs, name)
            sentinel = make(name, count, comm.rank + 100, seed)
            recv = sentinel.copy()
            comm.reduce(mine.copy(), recv, op=op, root=root)
            # NCCL: recvbuff is only used on the root.
            same(recv, want if comm.rank == root else sentinel, f"reduce {name} {op} root {root} out-of-place")
            buf = mine.copy()
            comm.reduce(buf, op=op, root=root)
            if comm.rank == root:
                same(buf, want, f"reduce {name} {op} root {root} in place")
            done += 2
    return done


def all_gather(comm, name, count, seed):
    inputs = _inputs(comm, name, count, seed)
    want = np.concatenate(inputs)
    recv = np.zeros_like(want)
    comm.all_gather(inputs[comm.rank].copy(), recv)
    same(recv, want, f"all_gather {name} out-of-place")
    # In place: send is this rank's block of recv.
    buf = np.zeros_like(want)
    block = buf[comm.rank * count : (comm.rank + 1) * count]
    block[...] = inputs[comm.rank]
    comm.all_gather(block, buf)
    same(buf, want, f"all_gather {name} in place")
    return 2


def reduce_scatter(comm, name, count, seed):
    done = 0
    n = comm.size
    for op in OPS:
        inputs = _inputs(comm, name, count * n, seed)
        full = reduce_ref(op, inputs, name)
        want = full[comm.rank * count : (comm.rank + 1) * count]
        recv = np.zeros(count, dtype=np_dtype(name))
        comm.reduce_scatter(inputs[comm.rank].copy(), recv, op=op)
        same(recv, want, f"reduce_scatter {name} {op} out-of-place")
        buf = inputs[comm.rank].copy()
        comm.reduce_scatter(buf, buf[comm.rank * count : (comm.rank + 1) * count], op=op)
        same(buf[comm.rank * count : (comm.rank + 1) * count], want, f"reduce_scatter {name} {op} in place")
        done += 2
    return done


def all_to_all(comm, name, count, seed):
    n = comm.size
    inputs = _inputs(comm, name, count * n, seed)
    want = np.concatenate([inputs[src][comm.rank * count : (comm.rank + 1) * count] for src in range(n)])
    recv = np.zeros_like(want)
    comm.all_to_all(inputs[comm.rank].copy(), recv)
    same(recv, want, f"all_to_all {name}")
    return 1


def gather(comm, name, count, seed):
    done = 0
    for root in range(comm.size):
        inputs = _inputs(comm, name, count, seed)
        recv = np.zeros(count * comm.size, dtype=np_dtype(name)) if comm.rank == root else None
        comm.gather(inputs[comm.rank].copy(), recv, root=root)
        if comm.rank == root:
            same(recv, np.concatenate(inputs), f"gather {name} root {root}")
            done += 1
    return done


def scatter(comm, name, count, seed):
    done = 0
    for root in range(comm.size):
        full = make(name, count * comm.size, root, seed)
        send = full.copy() if comm.rank == root else None
        recv = np.zeros(count, dtype=np_dtype(name))
        comm.scatter(send, recv, root=root)
        same(recv, full[comm.rank * count : (comm.rank + 1) * count], f"scatter {name} root {root}")
        done += 1
    return done


def send_recv(comm, name, count, seed):
    """A ring without a group: rank 0 sends first, every other rank receives first."""
    n, r = comm.size, comm.rank
    inputs = _inputs(comm, name, count, seed)
    got = np.zeros_like(inputs[r])
    if r == 0:
        comm.send(inputs[r], (r + 1) % n)
        comm.recv(got, (r - 1) % n)
    else:
        comm.recv(got, (r - 1) % n)
        comm.send(inputs[r], (r + 1) % n)
    same(got, inputs[(r - 1) % n], f"send/recv {name} from rank {(r - 1) % n}")
    return 1


def group_send_recv(comm, name, count, seed):
    """Inside a group every rank sends to and receives from every other rank at once
    (would deadlock without the group for large messages)."""
    n, r = comm.size, comm.rank
    inputs = _inputs(comm, name, count, seed)
    got = {p: np.zeros_like(inputs[r]) for p in range(n) if p != r}
    with oxccl.group():
        for p in got:
            comm.send(inputs[r], p)
            comm.recv(got[p], p)
    for p, g in got.items():
        same(g, inputs[p], f"grouped send/recv {name} from rank {p}")
    return len(got)


def group_collectives(comm, seed):
    """Several all-reduces in one group, with temporaries the group must keep alive."""
    n = comm.size
    outs, wants = [], []
    with comm.group():
        for i, name in enumerate(["float32", "int32", "float64"]):
            inputs = [make(name, 100 + i, r, seed) for r in range(n)]
            wants.append(reduce_ref("sum", inputs, name))
            out = np.zeros_like(inputs[0])
            comm.all_reduce(inputs[comm.rank].copy(), out)  # the temporary copy dies here
            outs.append(out)
    for i, (o, w) in enumerate(zip(outs, wants)):
        same(o, w, f"grouped all_reduce {i}")
    return len(outs)


def barrier(comm, delay):
    """Rank r arrives `r * delay` seconds late; returns (arrival, departure) wall times."""
    time.sleep(comm.rank * delay)
    arrive = time.time()
    comm.barrier()
    return arrive, time.time()


def buffer_kinds(comm, seed):
    """All-reduce in place through each kind of buffer object; returns the kinds checked."""
    import array

    n, r = comm.size, comm.rank
    kinds = []
    inputs = [make("float32", 64, k, seed) for k in range(n)]
    want = reduce_ref("sum", inputs, "float32")

    class DLPackOnly:
        """Exposes only the DLPack protocol of a numpy array."""

        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    a = inputs[r].copy()
    comm.all_reduce(DLPackOnly(a))
    same(a, want, "all_reduce through __dlpack__")
    kinds.append("dlpack")

    b = array.array("f", inputs[r].tolist())
    comm.all_reduce(b)
    same(np.frombuffer(b, dtype=np.float32), want, "all_reduce through the buffer protocol (array.array)")
    kinds.append("buffer-protocol")

    class ArrayInterface:
        def __init__(self, a):
            self.a = a
            self.__array_interface__ = a.__array_interface__

    c = inputs[r].copy()
    comm.all_reduce(ArrayInterface(c))
    same(c, want, "all_reduce through __array_interface__")
    kinds.append("array-interface")

    d = inputs[r].reshape(8, 8).copy()
    comm.all_reduce(d)
    same(d.reshape(-1), want, "all_reduce of a 2-D array")
    kinds.append("2-d")
    return kinds


def torch_tensors(comm, seed):
    """All-reduce CPU torch tensors of every type torch shares with NCCL."""
    import torch

    n, r = comm.size, comm.rank
    done = []
    for name in ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16"]:
        inputs = [make(name, 50, k, seed) for k in range(n)]
        want = reduce_ref("sum", inputs, name)
        t = (
            torch.from_numpy(inputs[r].view(np.uint16)).view(torch.bfloat16)
            if name == "bfloat16"
            else torch.from_numpy(inputs[r].copy())
        )
        t = t.clone()
        comm.all_reduce(t)
        got = t.view(torch.uint16).numpy().view(np_dtype(name)) if name == "bfloat16" else t.numpy()
        same(got, want, f"all_reduce torch {name}")
        done.append(name)
    return done


def large_all_reduce(comm, name, count, seed):
    """A message long enough to be cut into many pipelined chunks."""
    inputs = _inputs(comm, name, count, seed)
    want = reduce_ref("sum", inputs, name) if not is_int(name) else None
    buf = inputs[comm.rank].copy()
    comm.all_reduce(buf)
    same(buf, want, f"all_reduce {name} of {count} elements")
    return 1


def deterministic_all_reduce(comm, count):
    """With ``comm.deterministic`` on, a float32 all-reduce of values over many magnitudes equals
    the left fold in rank order computed here in float32, whatever the size; it is turned off
    again afterwards."""
    assert not comm.deterministic
    comm.deterministic = True
    assert comm.deterministic
    try:
        rng = [np.random.default_rng(1000 + r) for r in range(comm.size)]
        inputs = [
            (g.choice([-1.0, 1.0], count) * 2.0 ** g.integers(-30, 30, count) * g.random(count)).astype(np.float32)
            for g in rng
        ]
        want = inputs[0].copy()
        for x in inputs[1:]:
            want = want + x  # float32 + float32, in rank order
        done = 0
        for n in (count, count // 3 + 1):
            recv = np.zeros(n, np.float32)
            comm.all_reduce(inputs[comm.rank][:n].copy(), recv)
            assert recv.tobytes() == want[:n].tobytes(), f"deterministic all_reduce of {n} differs"
            done += 1
        return done
    finally:
        comm.deterministic = False
