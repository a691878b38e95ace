"""Runs PyTorch's distributed_test suite (see suite.py) with Gloo and with "oxccl" at
world sizes 2 and 3 in one run, prints the pass/fail table, and fails when a test that Gloo
passes does not pass with "oxccl" (apart from the named exceptions below).

    python compare.py [--subset] [--sizes 2,3] [--json OUT] [NAME-PART ...]

Each (backend, size) runs in its own process (the suite reads its settings at import); the
ranks of every test are forked from it and talk over loopback only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: Tests that Gloo passes and "oxccl" fails by construction, with the reason.
EXPECTED = {
    "test_get_backend": "compares the group's backend name with the suite's BACKEND (\"gloo\")",
    "test_ddp_logging_data_cpu": "DDP logs ProcessGroup::getBackendName(), which torch's C++ spells "
    "\"custom\" for every backend registered from Python; the test compares it with \"oxccl\"",
}

#: Tests that fail on some runs only, with what was seen. They are reported on every run but do
#: not fail it; each is an open bug of issue [L] (torch backend), not a pass. Empty: the last one,
#: test_send_recv_any_source_autograd_profiler, lost profiler events (and could crash inside the
#: profiler) because an operation's event ended after wait() returned; Work.finish now ends it
#: first (tests/test_torch_clients.py::test_any_source_receives_under_the_profiler_count_every_event).
KNOWN_FLAKY: dict = {}


def run(backend: str, size: int, args, budget: float):
    env = dict(os.environ, OXCCL_SUITE_BACKEND=backend, WORLD_SIZE=str(size))
    env.setdefault("OXCCL_SOCKET_IFNAME", "lo")
    env.setdefault("OXCCL_TIMEOUT_MS", "60000")
    cmd = [sys.executable, os.path.join(HERE, "suite.py"), *args]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=budget).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        print(f"!! {backend} at {size} ranks ran past {budget:.0f} s: the tests not reported count as failed")
    rows = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    print(f"== {backend}, {size} ranks: {len(rows)} tests in {time.monotonic() - t0:.0f} s", flush=True)
    return {r["test"]: r for r in rows}


def main(argv) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subset", action="store_true")
    ap.add_argument("--sizes", default="2,3")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds per backend and size")
    ap.add_argument("k", nargs="*")
    a = ap.parse_args(argv)
    args = (["--subset"] if a.subset else []) + a.k
    results = []
    bad = []
    for size in [int(s) for s in a.sizes.split(",")]:
        g, o = run("gloo", size, args, a.budget), run("oxccl", size, args, a.budget)
        counts = collections.Counter()
        for name in sorted(set(g) | set(o)):
            gs = g.get(name, {}).get("status", "missing")
            os_ = o.get(name, {}).get("status", "missing")
            counts[(gs, os_)] += 1
            results.extend(x for x in (g.get(name), o.get(name)) if x)
            if gs == "pass" and os_ != "pass":
                why = EXPECTED.get(name)
                flaky = KNOWN_FLAKY.get(name)
                detail = o.get(name, {}).get("detail", "")
                if why:
                    print(f"   {size} ranks  {name}: gloo pass, oxccl {os_} (expected: {why})")
                elif flaky:
                    print(f"   {size} ranks  {name}: gloo pass, oxccl {os_}: {detail} (KNOWN FLAKY, not a pass: {flaky})")
                else:
                    print(f"   {size} ranks  {name}: gloo pass, oxccl {os_}: {detail}")
                    bad.append((size, name))
            elif os_ == "pass" and gs != "pass":
                print(f"   {size} ranks  {name}: gloo {gs}, oxccl pass")
        print(f"   {size} ranks table (gloo, oxccl): " + ", ".join(f"{k[0]}/{k[1]}: {v}" for k, v in sorted(counts.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=0)
    print(f"== {len(bad)} unexpected failures" + (": " + ", ".join(f"{n}@{s}" for s, n in bad) if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
