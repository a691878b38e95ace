#!/usr/bin/env python3
"""GPU check kit: torch steps on CUDA tensors with oxccl's torch backend, 2 rank processes.

  expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch's cuMemCreate allocator):
              all-reduces of 4 and 32 MiB f32 must be exact and take the direct flow (the INFO
              line "direct flow from"), with no WARN line saying a buffer cannot be shared.
  mallocasync PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (the device's default stream-ordered
              pool, which cannot be exported): all-reduces of 4 and 32 MiB f32 must be exact
              through the staged flow, with exactly one WARN line per rank saying a buffer
              cannot be shared and naming the default pool.
  capture     all-reduces captured in torch.cuda.graph on tensors allocated inside the capture
              (the graph's private pool: buffers the communicator never saw), 8 B, 64 KiB and
              4 MiB; three replays, each exact.

Each rank is a process of its own (this script again, with its stderr kept), so the library's
log lines can be checked. Exit 77 (SKIP) without torch or CUDA.

Usage: torch_steps.py expandable|mallocasync|capture
"""
import os
import socket
import subprocess
import sys

MODES = ("expandable", "mallocasync", "capture")


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def rank_main(mode, rank, size, port):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    import oxccl.torch  # noqa: F401  (registers the backend)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import datetime

    dist.init_process_group("oxccl", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    want = size * (size + 1) / 2
    if mode in ("expandable", "mallocasync"):
        for mib in (4, 32):
            t = torch.full((mib << 18,), float(rank + 1), device=dev)
            dist.all_reduce(t)
            torch.cuda.synchronize()
            assert torch.all(t == want).item(), f"{mib} MiB: all_reduce gave {t[:4].tolist()}, want {want}"
    else:
        warm = torch.ones(16, device=dev)
        dist.all_reduce(warm)  # the communicator's device state, outside any capture
        torch.cuda.synchronize()
        for count in (2, 16 << 10, 1 << 20):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                # Allocated inside the capture: from the graph's private pool.
                t = torch.full((count,), float(rank + 1), device=dev)
                dist.all_reduce(t)
            torch.cuda.current_stream().wait_stream(s)
            for replay in range(3):
                t.fill_(-1.0)
                g.replay()
                torch.cuda.synchronize()
                ok = torch.all(t == want).item()
                assert ok, f"{count * 4} bytes, replay {replay}: {t[:4].tolist()}, want {want}"
            del g
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: {mode} exact")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in MODES:
        print(f"usage: torch_steps.py {'|'.join(MODES)}", file=sys.stderr)
        return 2
    if len(sys.argv) == 5:
        rank_main(mode, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    try:
        import torch
    except ImportError as e:
        skip(f"no torch ({e})")
    if not torch.cuda.is_available():
        skip("torch sees no CUDA device")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, OXCCL_DEBUG="INFO")
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif mode == "mallocasync":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, str(r), "2", str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed after 120 s)"
        outs.append((p.returncode, out))
    bad = 0
    for r, (rc, out) in enumerate(outs):
        print(f"--- rank {r} (exit {rc})")
        print("\n".join(line for line in out.splitlines() if " INFO " not in line or "direct flow" in line))
        if rc != 0:
            bad += 1
        elif mode == "expandable" and "direct flow from" not in out:
            print(f"FAIL: rank {r} did not take the direct flow on expandable segments")
            bad += 1
        elif mode == "expandable" and "cannot be shared" in out:
            print(f"FAIL: rank {r} could not share an expandable-segments buffer")
            bad += 1
        elif mode == "mallocasync":
            warns = [line for line in out.splitlines() if "cannot be shared" in line]
            if len(warns) != 1 or "default pool" not in warns[0]:
                print(f"FAIL: rank {r}: want one WARN line naming the default pool, got {warns}")
                bad += 1
    if bad:
        return 1
    what = {
        "expandable": "direct flow on expandable segments",
        "mallocasync": "staged flow on cudaMallocAsync's default pool, one WARN",
        "capture": "captured all-reduces on fresh buffers",
    }[mode]
    print(f"NOTE: {what}: exact on both ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
