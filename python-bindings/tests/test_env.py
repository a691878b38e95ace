"""Communicator.from_env(): the launcher variables and rendezvous rules of liboxccl's
src/bootstrap/env.rs, the address-based unique id built in Python (checked against the id
liboxccl builds), and real 2-rank joins through each launch form."""

from __future__ import annotations

import hashlib
import socket

import pytest

import oxccl
from oxccl import env
from ranks import run_processes


def test_launcher_precedence_and_values():
    assert env.detect({}) is None
    assert env.detect({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == env.Launch(1, 4, 1, "torchrun")
    both = {"OXCCL_RANK": "2", "OXCCL_NRANKS": "3", "RANK": "0", "WORLD_SIZE": "8"}
    assert env.detect(both) == env.Launch(2, 3, 0, "oxccl")
    assert (
        env.detect(
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
        ).launcher
        == "mpirun"
    )
    assert env.detect({"PMI_RANK": "0", "PMI_SIZE": "2"}) == env.Launch(0, 2, 0, "pmi")
    assert env.detect({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"}) == env.Launch(7, 8, 3, "slurm")
    # Only a rank without a size is not a launch; empty values count as unset.
    assert env.detect({"RANK": "1", "WORLD_SIZE": " "}) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK=x is not a non-negative integer"),
    ],
)
def test_bad_launcher_values(bad, match):
    with pytest.raises(ValueError, match=match):
        env.detect(bad)


def test_rendezvous_rules():
    assert env.rendezvous({"OXCCL_UNIQUE_ID": "ab" * 128, "OXCCL_COMM_ID": "h:1"}) == ("unique_id", "ab" * 128)
    assert env.rendezvous({"NCCL_COMM_ID": "h:1", "MASTER_ADDR": "m", "MASTER_PORT": "5"}) == ("address", "h:1")
    assert env.rendezvous({"OXCCL_COMM_ID": "o:2", "NCCL_COMM_ID": "n:1"}) == ("address", "o:2")
    assert env.rendezvous({"MASTER_ADDR": "m", "MASTER_PORT": "29500"}) == ("address", "m:29501")
    assert env.rendezvous({"MASTER_ADDR": "m", "MASTER_PORT": "1", "OXCCL_MASTER_PORT": "7"}) == ("address", "m:7")
    assert env.rendezvous({"MASTER_ADDR": "::1", "MASTER_PORT": "9"}) == ("address", "[::1]:10")
    with pytest.raises(ValueError, match="MASTER_PORT is not"):
        env.rendezvous({"MASTER_ADDR": "m"})
    with pytest.raises(ValueError, match="port 65536 is out of range"):
        env.rendezvous({"MASTER_ADDR": "m", "MASTER_PORT": "65535"})
    with pytest.raises(ValueError, match="no rendezvous point"):
        env.rendezvous({})


def test_secret_derivation():
    assert env.env_secret({}) == bytes(16)
    a, b = env.env_secret({"OXCCL_SECRET": "x"}), env.env_secret({"NCCL_SECRET": "x"})
    assert a == b and len(a) == 16 and a != bytes(16)
    assert env.env_secret({"OXCCL_SECRET": "y"}) != a
    # 32 hex digits are the key itself; other text is stretched (PBKDF2-HMAC-SHA256).
    assert env.env_secret({"OXCCL_SECRET": "00" * 15 + "fF"}) == bytes(15) + b"\xff"
    assert a == hashlib.pbkdf2_hmac("sha256", b"x", b"oxccl-env-secret-v3", 200_000, 16)


@pytest.mark.parametrize("addr", ["127.0.0.1:{port}", "[::1]:{port}", "localhost:{port}"])
@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_address_id_matches_liboxccl(addr, secret):
    hostport = addr.format(port=41234)
    if hostport.startswith("[::1]") and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    extra = {"OXCCL_COMM_ID": hostport, **({"OXCCL_SECRET": secret} if secret else {})}
    (theirs,) = run_processes("workers.unique_id_hex", 1, env=extra, timeout=60)
    ours = env.address_id(hostport, env.env_secret(extra)).hex()
    assert ours == theirs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "launch",
    [
        {"RANK": "{rank}", "WORLD_SIZE": "{size}", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "PORT-1"},
        {"OXCCL_RANK": "{rank}", "OXCCL_NRANKS": "{size}", "OXCCL_COMM_ID": "127.0.0.1:PORT", "OXCCL_SECRET": "k"},
        {"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "{size}", "NCCL_COMM_ID": "127.0.0.1:PORT"},
    ],
    ids=["torchrun", "oxccl-comm-id-secret", "mpirun-nccl-comm-id"],
)
def test_from_env_joins(launch):
    port = _free_port()
    launch = {k: v.replace("PORT-1", str(port - 1)).replace("PORT", str(port)) for k, v in launch.items()}
    results = run_processes("workers.from_env_all_reduce", 2, args=(launch,), timeout=120)
    for rank, (r, n, x, _) in enumerate(results):
        assert (r, n) == (rank, 2) and x == [3] * 5
    if "MASTER_ADDR" in launch:
        # Rank 0 sets OXCCL_COMM_ID only while it starts the root, and restores the environment.
        assert [leaked for *_, leaked in results] == [False, False]


def test_from_env_with_a_unique_id_in_hex():
    import oxccl

    uid = oxccl.get_unique_id()
    launch = {"OXCCL_RANK": "{rank}", "OXCCL_NRANKS": "{size}", "OXCCL_UNIQUE_ID": uid.hex()}
    assert [x for _, _, x, _ in run_processes("workers.from_env_all_reduce", 2, args=(launch,), timeout=120)] == [
        [3] * 5
    ] * 2


def test_a_rank_with_the_wrong_secret_cannot_join():
    import oxccl

    uid = oxccl.get_unique_id()
    results = run_processes(
        "workers.join_expect_error", 2, args=(uid, b"\x55" * 16), timeout=120, env={"OXCCL_TIMEOUT_MS": "3000"}
    )
    assert results[1] != "joined" and results[0] != "joined", results


def test_communicator_creation_is_bounded_by_its_timeout():
    """Communicator(timeout=): two ranks of two join and all-reduce; two ranks of three give
    up within the 2 s given (OXCCL_TIMEOUT_MS is 120 s). The first to give up reports
    ncclTimeout, not before 2 s; it leaves, so the root may end the rendezvous for the other
    one a moment earlier than its own timeout (ncclInvalidUsage, "the bootstrap root ended the
    rendezvous"), which is also an answer within the bound."""
    env = {"OXCCL_TIMEOUT_MS": "120000", "OXCCL_TEST_UID": oxccl.get_unique_id().hex()}
    got = run_processes("workers.join_bounded", 2, args=(2, 30.0), env=env, timeout=120)
    assert [(name, total) for name, _, total in got] == [("ok", [3, 3, 3])] * 2, got
    env["OXCCL_TEST_UID"] = oxccl.get_unique_id().hex()
    got = run_processes("workers.join_bounded", 2, args=(3, 2.0), env=env, timeout=120)
    assert any(name == "ncclTimeout" and took >= 1.9 for name, took, _ in got), got
    for name, took, _ in got:
        assert name in ("ncclTimeout", "ncclInvalidUsage") and took <= 6.0, got
