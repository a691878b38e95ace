"""oxccl.empty / oxccl.zeros: page-aligned numpy buffers."""

import numpy as np
import pytest

import oxccl


@pytest.mark.parametrize("shape", [0, 1, 1000, (3, 5), (64, 1024, 3)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float64"])
def test_aligned_and_shaped(shape, dtype):
    a = oxccl.zeros(shape, dtype)
    assert a.shape == ((shape,) if isinstance(shape, int) else shape) and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.size == 0 or a.__array_interface__["data"][0] % 4096 == 0  # empty arrays have no data
    assert not a.any()


def test_other_alignments_and_errors():
    for align in (64, 1 << 16):
        assert oxccl.empty(100, "float16", align).__array_interface__["data"][0] % align == 0
    with pytest.raises(ValueError, match="power of two"):
        oxccl.empty(10, align=48)
