"""Packing and unpacking fused buffers, with scale factors and conversions."""

import ml_dtypes
import numpy as np
import pytest

from coordinator.fusion import FusionBuffers, as_bytes, pack, scale_inplace, unpack


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


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8,
                                   np.uint16, np.uint32, np.uint64])
def test_an_integer_average_is_the_exact_quotient_toward_zero_at_any_magnitude(dtype):
    """The sum divided by the rank count, rounded toward zero, exactly: in
    float64, int64 sums past 2**53 lost their low bits (3 * (10**17 + 1) / 3
    gave 10**17)."""
    info = np.iinfo(dtype)
    sums = [info.min, info.min + 1, -7, -6, -1, 0, 1, 5, 6, 7, info.max - 1, info.max]
    sums = np.array([v for v in sums if v >= info.min], dtype)
    for divisor in (2, 3, 7):
        arr = sums.copy()
        scale_inplace(arr, 1.0, divisor)
        want = [int(v) // divisor if v >= 0 else -(-int(v) // divisor) for v in sums]
        assert arr.tolist() == want, (divisor, arr, want)
    if dtype == np.int64:
        arr = np.array([3 * (10**17 + 1)], dtype)
        scale_inplace(arr, 1.0, 3)
        assert arr.tolist() == [10**17 + 1]


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
