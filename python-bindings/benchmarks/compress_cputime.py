"""CPU time and wall time per call of the compressed all-reduce, out of place and in place.

One rank per process (start every rank yourself, e.g. in network namespaces); rank 0 writes
the unique id to ID_FILE (which must not exist yet), the others wait for it. Per wire mode and
placement, ROUNDS rounds of one warm-up call and CALLS timed calls, float32 sum of COUNT
elements; per round it prints the wall time per call and this process's CPU time per call
(every thread: CLOCK_PROCESS_CPUTIME_ID), which a loaded machine's scheduling does not inflate.

    python python-bindings/benchmarks/compress_cputime.py RANK NRANKS ID_FILE [COUNT] [ROUNDS] [CALLS]

docs/PERFORMANCE.md ("Compressed all-reduce between two hosts on 1 Gbit/s") runs it with two
ranks in each of two shaped network namespaces.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import oxccl


def main() -> None:
    rank, nranks, id_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 16 << 20
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    calls = int(sys.argv[6]) if len(sys.argv) > 6 else 4
    if rank == 0:
        uid = oxccl.get_unique_id()
        with open(id_file + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.rename(id_file + ".tmp", id_file)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(id_file):
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: no {id_file} after 120 s")
            time.sleep(0.05)
        with open(id_file, "rb") as f:
            uid = f.read()
    comm = oxccl.Communicator(rank, nranks, uid)
    x = (np.arange(count, dtype=np.float32) % 1000) * (rank + 1)
    y = np.empty_like(x)
    z = x.copy()
    rows: dict = {}
    for _ in range(rounds):
        for mode in ("off", "bf16", "fp8", "int8"):
            comm.compress = mode
            for place in ("out", "in"):

                def call():
                    if place == "out":
                        comm.all_reduce(x, y)
                    else:
                        comm.all_reduce(z, None)

                call()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    call()
                wall, cpu = (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls
                rows.setdefault((mode, place), []).append(f"wall {wall * 1e3:.0f} cpu {cpu * 1e3:.0f}")
    for (mode, place), v in rows.items():
        print(f"rank {rank} {mode:4} {place:3} (ms per call): " + " | ".join(v), flush=True)
    comm.destroy()


if __name__ == "__main__":
    main()
