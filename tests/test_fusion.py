"""Packing and unpacking fused buffers, with scale factors and conversions."""

import ml_dtypes
import numpy as np
import pytest

from coordinator.fusion import FusionBuffers, as_bytes, pack, unpack


def test_pack_then_unpack_round_trips_with_scaling():
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (2, 4), (), (0,)]]
    bufs = FusionBuffers()
    buf = bufs.get("reduce", sum(t.size for t in tensors), np.float32)
    assert pack(tensors, buf, 2.0) == buf.size
    outs = [np.empty_like(t) for t in tensors]
    unpack(buf, outs, 0.25)
    for t, o in zip(tensors, outs):
        np.testing.assert_allclose(o, t * 0.5, rtol=1e-6)


def test_integer_scaling_truncates_toward_zero_like_horovod():
    buf = np.empty(3, np.int32)
    pack([np.array([3, -3, 4], np.int32)], buf, 0.5)
    assert buf.tolist() == [1, -1, 2]


def test_bfloat16_is_converted_to_float32_and_back():
    bf = np.array([1.5, -2.25, 3.0], dtype=ml_dtypes.bfloat16)
    buf = np.empty(3, np.float32)
    pack([bf], buf)
    assert buf.tolist() == [1.5, -2.25, 3.0]
    out = np.empty(3, dtype=ml_dtypes.bfloat16)
    unpack(buf * 2, [out])
    assert out.astype(np.float32).tolist() == [3.0, -4.5, 6.0]


def test_buffers_are_reused_and_grow_only_when_needed():
    bufs = FusionBuffers()
    a = bufs.get("reduce", 100, np.float32)
    b = bufs.get("reduce", 50, np.float64)
    assert a.base is b.base or np.shares_memory(a, b)
    assert bufs.nbytes() == 400
    bufs.get("reduce", 200, np.float32)
    assert bufs.nbytes() == 800


@pytest.mark.parametrize("dtype", [np.bool_, np.int16, np.float64])
def test_as_bytes_is_a_view(dtype):
    arr = np.zeros((2, 3), dtype)
    view = as_bytes(arr)
    assert view.dtype == np.uint8 and view.size == arr.nbytes
    assert np.shares_memory(view, arr)


def test_buffers_beyond_the_limit_are_not_kept():
    bufs = FusionBuffers(limit=1024)
    small = bufs.get("reduce", 100, np.float32)
    big = bufs.get("reduce", 1000, np.float32)
    assert big.size == 1000 and not np.shares_memory(small, big)
    assert bufs.nbytes() == 400


def test_pack_of_same_dtype_sources_fills_only_their_prefix():
    sources = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0], np.float32),
               np.full((2, 2), 9.0, np.float32)]
    buf = np.full(20, -1.0, np.float32)
    assert pack(sources, buf) == 11
    np.testing.assert_array_equal(buf[:11], np.concatenate([s.reshape(-1) for s in sources]))
    assert (buf[11:] == -1.0).all()


def test_pack_converts_sources_of_another_dtype():
    sources = [np.array([1.5, 2.5], np.float64), np.array([3, 4], np.int32)]
    buf = np.zeros(4, np.float32)
    assert pack(sources, buf) == 4
    np.testing.assert_array_equal(buf, np.array([1.5, 2.5, 3, 4], np.float32))
