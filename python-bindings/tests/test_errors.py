"""Wrong arguments raise clear Python exceptions before anything reaches the network.

Uses a 1-rank communicator in this process: every check here is local to the rank."""

from __future__ import annotations

import numpy as np
import pytest

import oxccl


@pytest.fixture(scope="module")
def comm():
    c = oxccl.Communicator(0, 1, oxccl.get_unique_id())
    yield c
    c.destroy()


def test_one_rank_communicator(comm):
    assert (comm.rank, comm.size) == (0, 1) == comm.query_rank_and_size()
    assert comm.cuda_device == -1
    x = np.arange(10, dtype=np.float64)
    out = np.zeros_like(x)
    comm.all_reduce(x, out)
    np.testing.assert_array_equal(out, np.arange(10))


def test_compress_setting(comm):
    assert comm.compress == "off"
    for mode in ("bf16", "fp8", "int8", "off"):
        comm.compress = mode
        assert comm.compress == mode
    with pytest.raises(ValueError):
        comm.compress = "zip"
    # One rank, one host: an all-reduce stays exact.
    comm.compress = "int8"
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    out = np.zeros_like(x)
    comm.all_reduce(x, out)
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize(
    "dtype", [np.bool_, np.int16, np.uint16, np.complex64, np.float128 if hasattr(np, "float128") else np.complex128]
)
def test_types_nccl_lacks_are_rejected(comm, dtype):
    with pytest.raises(TypeError, match=r"NCCL has no type for; supported: int8"):
        comm.all_reduce(np.zeros(4, dtype=dtype))


def test_non_native_byte_order_is_rejected(comm):
    with pytest.raises(TypeError, match="non-native byte order"):
        comm.all_reduce(np.zeros(4, dtype=np.dtype(np.float32).newbyteorder()))


def test_send_and_recv_types_must_match(comm):
    with pytest.raises(TypeError, match=r"different element types \(float32 vs float64\)"):
        comm.all_reduce(np.zeros(4, np.float32), np.zeros(4, np.float64))


def test_non_contiguous_is_rejected(comm):
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="not C-contiguous; pass numpy.ascontiguousarray"):
        comm.all_reduce(a[:, 1])
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(np.zeros(4, np.float32), a.T.copy(order="F").T[:, ::2].reshape(-1)[:4][::-1])


def test_sizes_must_match(comm):
    with pytest.raises(ValueError, match="has 5 elements but recv .* has 4: they must be equal"):
        comm.all_reduce(np.zeros(5, np.float32), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"must hold 1 x 3 = 3 elements \(one block per rank\), not 4"):
        comm.all_gather(np.zeros(3, np.int32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"must hold 1 x 2 = 2 elements"):
        comm.reduce_scatter(np.zeros(3, np.int32), np.zeros(2, np.int32))


def test_read_only_output_is_rejected(comm):
    a = np.zeros(4, np.float32)
    a.setflags(write=False)
    with pytest.raises(ValueError, match="read-only but receives the result"):
        comm.all_reduce(a)
    comm.all_reduce(a, np.zeros(4, np.float32))  # fine as the input


def test_not_an_array(comm):
    with pytest.raises(TypeError, match="is a list; pass an array"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="not an array oxccl can read"):
        comm.all_reduce(object())


def test_bad_root_peer_and_operator(comm):
    with pytest.raises(ValueError, match="root 1 is out of range for 1 ranks"):
        comm.broadcast(np.zeros(2, np.float32), root=1)
    with pytest.raises(ValueError, match="peer -1 is out of range"):
        comm.send(np.zeros(2, np.float32), -1)
    with pytest.raises(ValueError, match="unknown reduction operator 'median'"):
        comm.all_reduce(np.zeros(2, np.float32), op="median")
    with pytest.raises(TypeError, match="reduction operator must be"):
        comm.all_reduce(np.zeros(2, np.float32), op=1.5)


def test_library_errors_carry_result_name_and_detail(comm):
    # 99 is above ncclNumOps and was never created with ncclRedOpCreatePreMulSum.
    with pytest.raises(oxccl.Error) as e:
        comm.all_reduce(np.zeros(2, np.float32), op=99)
    assert e.value.result_name == "ncclInvalidArgument"
    assert "ncclAllReduce" in e.value.detail and "99" in e.value.detail


def test_device_memory_without_cuda_support_is_refused(comm):
    class FakeDeviceArray:  # what cupy exposes, on memory this process never mapped
        __cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0xDEAD0000, False),
            "version": 3,
            "strides": None,
        }

    with pytest.raises(
        oxccl.NotAvailableError, match=r"is CUDA memory, but this liboxccl communicator has no CUDA device"
    ):
        comm.all_reduce(FakeDeviceArray())


def test_bad_unique_ids(comm):
    with pytest.raises(ValueError, match="must be 128 bytes"):
        oxccl.Communicator(0, 1, b"short")
    with pytest.raises(TypeError, match="must be the bytes of get_unique_id"):
        oxccl.Communicator(0, 1, 12345)
    with pytest.raises(oxccl.Error, match="not one made by ncclGetUniqueId"):
        oxccl.Communicator(0, 1, bytes(128))
    with pytest.raises(oxccl.Error, match="rank 2 is out of range for nranks 2"):
        oxccl.Communicator(2, 2, oxccl.get_unique_id())


def test_unique_id_is_picklable_bytes():
    import pickle

    uid = oxccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 and pickle.loads(pickle.dumps(uid)) == uid
    assert uid[:4] == b"OXID"


def test_destroyed_communicator():
    c = oxccl.Communicator(0, 1, oxccl.get_unique_id())
    with c:
        pass
    c.destroy()  # idempotent
    with pytest.raises(ValueError, match="communicator was destroyed"):
        c.all_reduce(np.zeros(2, np.float32))
    assert "destroyed" in repr(c)


def test_group_keeps_temporaries_alive_and_requires_group_symbols(comm):
    if not oxccl.lib().has("ncclGroupStart"):
        with pytest.raises(oxccl.NotAvailableError, match="ncclGroupStart is not available"):
            with oxccl.group():
                pass
        return
    out = np.zeros(3, np.float32)
    with oxccl.group():
        comm.all_reduce(np.ones(3, np.float32), out)
    np.testing.assert_array_equal(out, 1)
