"""One rank of the compressed-wire DDP training test (test_torch_compress.py), run as a script:

    python ddp_compress_worker.py RANK SIZE ADDR PORT

It joins a default "oxccl" process group over a TCP store at ADDR:PORT, then for each wire
encoding (off, bf16, fp8, int8) makes a new "oxccl" group with that encoding and trains the same
small MLP with DistributedDataParallel over it for STEPS SGD steps from the same start, each
rank on its shard of a fixed synthetic regression set. Per step it records the loss of the
model on the whole data set (computed by this rank alone, in float64) and a SHA-256 of the
model's parameter bytes. Prints one JSON line: {"losses": {mode: [...]}, "hashes": {mode:
[...]}, "compress": {mode: the group's setting}}.

The host identity (OXCCL_HOSTID or the network namespace) and the interface come from the
environment the test gives.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import oxccl.torch  # noqa: F401  (registers the backend)
from oxccl.torch import compat

MODES = ("off", "bf16", "fp8", "int8")
STEPS = 60
SAMPLES = 512
FEATURES = 16
HIDDEN = 48
LR = 0.2


def data():
    """The fixed data set: inputs, and the targets of a random teacher MLP plus a little noise."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w1, w2 = 0.4 * torch.randn(FEATURES, 8, generator=g), torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def model():
    """The student: Linear(16, 48), tanh, Linear(48, 1): 865 parameters, one DDP bucket."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def full_loss(m: torch.nn.Module, x, y) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(m.double()(x.double()), y.double()))


def train(rank: int, size: int, group, x, y):
    net = model()
    ddp = DDP(net, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    xs, ys = x.chunk(size)[rank], y.chunk(size)[rank]
    losses, hashes = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        opt.step()
        # The loss on the whole set, from a float64 copy (the model itself stays float32).
        copy = model()
        copy.load_state_dict(net.state_dict())
        losses.append(full_loss(copy, x, y))
        hashes.append(digest(net))
    return losses, hashes


def backend_of(group):
    """The ProcessGroupOxccl behind ``group`` (torch's per-device backend, or the group)."""
    return group._get_backend(torch.device("cpu")) if compat.PER_DEVICE else group


def main(rank: int, size: int, addr: str, port: int) -> None:
    # One thread per rank: two ranks' thread pools on a small machine only wait on each other.
    torch.set_num_threads(1)
    host = f"[{addr}]" if ":" in addr else addr
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("oxccl", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size, timeout=timeout)
    x, y = data()
    out = {"losses": {}, "hashes": {}, "compress": {}}
    try:
        for mode in MODES:
            group = dist.new_group(backend="oxccl")
            backend_of(group).comm.compress = mode
            out["compress"][mode] = backend_of(group).comm.compress
            out["losses"][mode], out["hashes"][mode] = train(rank, size, group, x, y)
            dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
