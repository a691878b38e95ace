"""PyTorch's own ``distributed_test`` suite (``DistributedTest._DistTestBase``) against the
"oxccl" backend and against Gloo, as torch's ``test_distributed_spawn.py`` runs it.

The suite reads ``BACKEND`` when it is imported and decides which tests to attempt (its
"gloo gates") and, inside tests, which branch to take. Both runs import it with
``BACKEND=gloo``, so the same tests and branches run; in the "oxccl" run, every process group
that would be created as "gloo" (``init_process_group``, ``new_group``) is created as
"oxccl" instead. ``test_get_backend`` then fails by construction (it compares the group's
backend name with "gloo").

Run one backend and world size (results as JSON lines on stdout; the environment is read
when the suite is imported, so it is set by the caller)::

    OXCCL_SUITE_BACKEND=oxccl WORLD_SIZE=2 python suite.py [--subset | NAME-PART ...]

``compare.py`` runs both backends at sizes 2 and 3 and prints the table.
"""

from __future__ import annotations

import os
import sys

_REAL = os.environ.get("OXCCL_SUITE_BACKEND", "gloo")
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

if _REAL == "oxccl":
    import oxccl.torch  # noqa: F401  (registers the backend)

    def _swap(backend):
        if backend is None or str(backend).lower() == "gloo":
            return "oxccl"
        return backend

    _init, _new_group = c10d.init_process_group, c10d.new_group

    def init_process_group(backend=None, *args, **kwargs):
        return _init(_swap(backend), *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return _new_group(ranks, timeout, _swap(backend) if backend is not None else None, *args, **kwargs)

    for _m in (dist, c10d):
        _m.init_process_group = init_process_group
        _m.new_group = new_group

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):
    """Each test in ``WORLD_SIZE`` forked processes (torch's test_distributed_spawn spawns
    them; forking skips re-importing torch in every rank, ~20 s a test on a busy 2-core host)."""

    def setUp(self):
        super().setUp()
        import torch.multiprocessing as tmp

        self._start_processes(tmp.get_context("fork").Process)


#: The fixed subset CI runs: every op of the backend's contract (gather, scatter, coalesced
#: all-gather / reduce-scatter, all_to_all with uneven splits, any-source recv, barrier,
#: monitored_barrier, sparse all_reduce, complex tensors, profiler names, comm hooks) and
#: the 20 tests that failed before the backend was registered per device type.
SUBSET = [
    "test_all_reduce_sum",
    "test_all_reduce_sum_complex",
    "test_all_reduce_sum_async",
    "test_all_reduce_max",
    "test_all_reduce_coalesced_sum",
    "test_sparse_all_reduce_sum",
    "test_broadcast",
    "test_reduce_sum",
    "test_gather",
    "test_gather_checks",
    "test_gather_full_group",
    "test_gather_object",
    "test_gather_object_subgroup",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_complex",
    "test_scatter_full_group",
    "test_scatter_object_list",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_object_default_pg",
    "test_all_to_all_single_equal_split",
    "test_all_to_all_single_unequal_split",
    "test_all_to_all_single_unequal_split_complex",
    "test_all_to_all",
    "test_all_to_all_complex",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_send_recv",
    "test_send_recv_autograd_profiler",
    "test_send_recv_torch_profiler",
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    "test_send_recv_any_source_torch_profiler",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    "test_barrier",
    "test_barrier_full_group",
    "test_barrier_timeout_full_group",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_subgroup",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_failure_order",
    "test_monitored_barrier_wait_all_ranks",
    "test_grads_same_across_ranks_with_no_sync",
    "test_ddp_comm_hook_logging",
    "test_ddp_hook_parity_allreduce",
    "test_ddp_hook_parity_powerSGD",
    "test_ddp_hook_parity_post_localSGD",
    "test_post_localSGD_optimizer_parity",
    "test_periodic_model_averager",
    "test_new_subgroups",
    "test_get_backend",
]


def main(argv) -> int:
    import argparse
    import json
    import time
    import unittest

    ap = argparse.ArgumentParser()
    ap.add_argument("--subset", action="store_true", help="the fixed CI subset")
    ap.add_argument("k", nargs="*", help="run the tests whose name contains one of these")
    a = ap.parse_args(argv)
    backend, size = _REAL, int(os.environ["WORLD_SIZE"])
    names = sorted(n for n in dir(TestDistBackendWithFork) if n.startswith("test_"))
    if a.subset:
        want = [n for n in SUBSET if n in names]
    elif a.k:
        want = [n for n in names if any(k in n for k in a.k)]
    else:
        want = names
    for name in want:
        t0 = time.monotonic()
        result = unittest.TestResult()
        TestDistBackendWithFork(name).run(result)
        if result.errors or result.failures:
            status = "fail"
            lines = (result.errors + result.failures)[0][1].strip().splitlines()
            errs = [i for i, ln in enumerate(lines) if "Error" in ln or "Exception" in ln]
            # the error line and the few after it (an assertion's "Expected 3 but got 4.")
            at = errs[-1] if errs else len(lines) - 1
            detail = " | ".join(ln.strip() for ln in lines[at : at + 4] if ln.strip())[:400]
        elif result.skipped:
            status, detail = "skip", result.skipped[0][1][:200]
        else:
            status, detail = "pass", ""
        print(
            json.dumps(
                {"test": name, "backend": backend, "world_size": size, "status": status,
                 "seconds": round(time.monotonic() - t0, 2), "detail": detail}
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    # The spawned ranks re-import this file as __mp_main__: only the parent runs tests.
    sys.exit(main(sys.argv[1:]))
