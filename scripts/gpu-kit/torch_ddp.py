#!/usr/bin/env python3
"""GPU check kit: torch DistributedDataParallel on CUDA tensors, 2 ranks, a few SGD steps, with
the backend named on the command line ("oxccl": oxccl's torch backend; "nccl": torch's own
NCCL backend, run by the kit with oxccl's libnccl.so.2 preloaded). The trained parameters must
equal a single-process reference trained on the whole batch (to 1e-5 relative). Exit 77 (SKIP)
without torch or CUDA.

Usage: torch_ddp.py oxccl|nccl
"""
import os
import socket
import sys
import tempfile

STEPS = 5


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP
except ImportError as e:
    skip(f"no torch ({e})")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def train(net, x, y, dev):
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()


def rank_main(rank, size, port, backend, out):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)  # a CUDA context before the communicator
    if backend == "oxccl":
        import oxccl.torch  # noqa: F401  (registers the backend)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    kw = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60), **kw)
    if backend == "nccl":
        libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libnccl" in line or "liboxccl" in line})
        print(f"rank {rank}: NCCL libraries mapped: {libs}; torch.cuda.nccl.version() = {torch.cuda.nccl.version()}")
    t = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    want = size * (size + 1) / 2
    assert torch.all(t == want).item(), f"all_reduce gave {t[:4].tolist()}, want {want}"
    x, y = data()
    n = x.shape[0] // size
    net = DDP(model().to(dev), device_ids=[dev.index])
    train(net, x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n], dev)
    torch.cuda.synchronize()
    if rank == 0:
        torch.save([p.detach().cpu() for p in net.module.parameters()], out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    backend = sys.argv[1] if len(sys.argv) > 1 else "oxccl"
    if not torch.cuda.is_available():
        skip("torch sees no CUDA device")
    if backend == "nccl":
        pre = os.environ.get("LD_PRELOAD", "")
        if "libnccl.so.2" not in pre or not os.path.exists(pre.split(":")[0]):
            skip(f"LD_PRELOAD does not name the kit's libnccl.so.2 ({pre!r})")
        if not dist.is_nccl_available():
            skip("this torch was built without NCCL")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        mp.spawn(rank_main, args=(2, port, backend, out), nprocs=2, join=True)
        got = torch.load(out)
    ref = model().to("cuda:0")
    x, y = data()
    train(ref, x, y, torch.device("cuda", 0))
    worst = 0.0
    for a, b in zip(got, [p.detach().cpu() for p in ref.parameters()]):
        worst = max(worst, ((a - b).abs() / (b.abs() + 1e-3)).max().item())
    print(f"max relative difference to the single-process reference: {worst:.3g}")
    if worst > 1e-5:
        print("FAIL: the DDP parameters differ from the reference")
        return 1
    print(f"NOTE: DDP ({backend}) {STEPS} steps equal the reference (max rel diff {worst:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
