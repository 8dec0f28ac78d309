"""Each native kernel agrees with its NumPy reference (coordinator/native.py)."""

import numpy as np
import pytest

from coordinator import dtypes, fusion, native

needs_halfops = pytest.mark.skipif(native.halfops is None,
                                   reason="native kernels not built (no C compiler at install)")
needs_minmax = pytest.mark.skipif(native.minmax is None,
                                  reason="native kernels not built (no C compiler at install)")

dtypes.bfloat16()  # loaded on first need; these tests cover its kernels too
KINDS = sorted(native.KINDS.items(), key=lambda kv: kv[1])


def _values(dtype, n, seed):
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-6, 1e-3, 1, 300], n)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 6e-8, 3e-5,
                         1.0009765625, 2.0 ** -14, -(2.0 ** -24)], np.float32)
    with np.errstate(over="ignore"):
        return np.concatenate([specials, vals]).astype(dtype)


def _same(a, b):
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    both_nan = np.isnan(a32) & np.isnan(b32)
    return np.array_equal(a32[~both_nan], b32[~both_nan]) and np.array_equal(
        np.isnan(a32), np.isnan(b32))


@needs_halfops
@pytest.mark.parametrize("op", [0, 1, 2, 3], ids=["sum", "min", "max", "prod"])
@pytest.mark.parametrize("dtype,kind", KINDS, ids=lambda v: str(v))
def test_reduce_matches_numpy_reference(dtype, kind, op):
    for n in (1, 7, 8, 9, 1000, 4099):
        a = _values(dtype, n, seed=n)
        b = _values(dtype, n, seed=n + 1)[::-1].copy()
        ref = b.copy()
        native.reduce_reference(op, kind, a, ref)
        out = b.copy()
        native.halfops.reduce(op, kind, a, out)
        assert _same(out, ref), (n, np.nonzero(out.astype(np.float32) != ref.astype(np.float32)))


@needs_halfops
@pytest.mark.parametrize("dtype,kind", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 3.0, 1e-4])
def test_scale_matches_numpy_reference(dtype, kind, factor):
    a = _values(dtype, 5000, seed=3)
    ref = a.copy()
    native.scale_reference(kind, ref, factor)
    out = a.copy()
    native.halfops.scale(kind, out, factor)
    assert _same(out, ref)


@needs_halfops
def test_reduce_rejects_mismatched_buffers():
    with pytest.raises(ValueError, match="equal, even sizes"):
        native.halfops.reduce(0, 0, np.zeros(3, np.float16), np.zeros(4, np.float16))
    with pytest.raises(ValueError, match="unknown reduce op"):
        native.halfops.reduce(9, 0, np.zeros(3, np.float16), np.zeros(3, np.float16))


# ---- float32/float64 Min and Max (native/minmax.c) ------------------------------
MINMAX = sorted(native.MINMAX_KINDS.items(), key=lambda kv: kv[1])
UINT = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}
QUIET_NAN = {np.dtype(np.float32): 0x7fc00000, np.dtype(np.float64): 0x7ff8000000000000}


def _specials(dtype):
    """Zeros of both signs, infinities, NaNs (negative, signalling, with a
    payload), the extremes and subnormals."""
    dtype = np.dtype(dtype)
    info = np.finfo(dtype)
    vals = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, info.max,
                     -info.max, info.tiny, info.smallest_subnormal,
                     -info.smallest_subnormal], dtype)
    u = UINT[dtype]
    inf, sign = np.array(np.inf, dtype).view(u), ~(~u(0) >> u(1))
    nans = np.array([inf | u(1), inf | sign | u(5)], u).view(dtype)  # signalling, payloads
    return np.concatenate([vals, nans])


def _pairs(dtype, n=None):
    """Every pair of specials, then random values with ties; n elements if given."""
    sp = _specials(dtype)
    a, b = np.repeat(sp, len(sp)), np.tile(sp, len(sp))
    rng = np.random.default_rng(0)
    ra = rng.integers(-3, 4, 5000).astype(dtype) * rng.choice([1e-40, 1, 1e30], 5000)
    rb = np.where(rng.random(5000) < 0.3, ra, rng.integers(-3, 4, 5000)).astype(dtype)
    with np.errstate(over="ignore"):
        a, b = np.concatenate([a, ra.astype(dtype)]), np.concatenate([b, rb.astype(dtype)])
    if n is not None:
        a, b = np.resize(a, n), np.resize(b, n)
    return a, b


def _minmax(fn, op, kind, a, b):
    out = b.copy()
    fn(op, kind, a, out)
    return out


def _bits(x):
    return x.view(UINT[x.dtype])


@pytest.mark.parametrize("op", [1, 2], ids=["min", "max"])
@pytest.mark.parametrize("dtype,kind", MINMAX, ids=lambda v: str(v))
def test_minmax_reference_is_numpy_with_zero_sign_and_nan_fixed(dtype, kind, op):
    """Equal to np.minimum/np.maximum (NaN wherever either operand is NaN),
    except that the result's bits do not depend on the order of the operands:
    NaN is the default quiet NaN, min(-0, +0) = -0 and max(-0, +0) = +0."""
    a, b = _pairs(dtype)
    out = _minmax(native.minmax_reference, op, kind, a, b)
    np.testing.assert_array_equal(out, (np.minimum if op == 1 else np.maximum)(a, b))
    nan = np.isnan(a) | np.isnan(b)
    assert np.all(_bits(out)[nan] == QUIET_NAN[np.dtype(dtype)])
    zeros = (a == 0) & (b == 0)
    sign = np.signbit(a) | np.signbit(b) if op == 1 else np.signbit(a) & np.signbit(b)
    assert np.array_equal(np.signbit(out[zeros]), sign[zeros])
    assert np.array_equal(_bits(out), _bits(_minmax(native.minmax_reference, op, kind, b, a)))


@needs_minmax
@pytest.mark.parametrize("op", [1, 2], ids=["min", "max"])
@pytest.mark.parametrize("dtype,kind", MINMAX, ids=lambda v: str(v))
def test_minmax_matches_numpy_reference_bit_for_bit(dtype, kind, op):
    for n in (1, 3, 4, 5, 7, 8, 9, 1000, 4099, None):  # vector loops and their tails
        a, b = _pairs(dtype, n)
        out = _minmax(native.minmax.reduce, op, kind, a, b)
        ref = _minmax(native.minmax_reference, op, kind, a, b)
        diff = np.nonzero(_bits(out) != _bits(ref))[0]
        assert diff.size == 0, (n, a[diff[:5]], b[diff[:5]], out[diff[:5]], ref[diff[:5]])


@needs_minmax
def test_minmax_examples_from_the_issue():
    for dtype, kind in MINMAX:
        for op, want in ((1, -0.0), (2, 0.0)):
            for a, b in ((-0.0, 0.0), (0.0, -0.0)):
                out = _minmax(native.minmax.reduce, op, kind, np.full(9, a, dtype),
                              np.full(9, b, dtype))
                assert np.all(out == 0) and np.all(np.signbit(out) == np.signbit(want))
        # Min of {1, NaN, 3}, combined in either order, is NaN.
        for first, second in (([1.0], [np.nan]), ([np.nan], [3.0])):
            acc = np.resize(np.array(first, dtype), 9)
            acc = _minmax(native.minmax.reduce, 1, kind, np.resize(np.array(second, dtype), 9),
                          acc)
            acc = _minmax(native.minmax.reduce, 1, kind, np.full(9, 3.0, dtype), acc)
            assert np.all(np.isnan(acc))


@needs_minmax
def test_minmax_rejects_bad_arguments():
    f = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="need equal sizes"):
        native.minmax.reduce(1, 0, f, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="multiples of 8"):
        native.minmax.reduce(1, 1, f, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="unknown min/max op"):
        native.minmax.reduce(0, 0, f, f.copy())
    with pytest.raises(ValueError, match="unknown float kind"):
        native.minmax.reduce(1, 2, f, f.copy())


@needs_halfops
@pytest.mark.parametrize("op", [1, 2], ids=["min", "max"])
@pytest.mark.parametrize("dtype,kind", KINDS, ids=lambda v: str(v))
def test_half_min_max_bits_do_not_depend_on_operand_order(dtype, kind, op):
    """The 16-bit kernels follow the float32/float64 rule for zeros and NaN."""
    a = _values(dtype, 4099, seed=5)
    b = _values(dtype, 4099, seed=6)[::-1].copy()
    a[:4], b[:4] = np.array([-0.0, 0.0, np.nan, 1.0], dtype), np.array([0.0, -0.0, 2.0, -np.nan],
                                                                       dtype)
    ab, ba = _minmax(native.halfops.reduce, op, kind, a, b), _minmax(native.halfops.reduce, op,
                                                                     kind, b, a)
    assert np.array_equal(ab.view(np.uint16), ba.view(np.uint16))
    ref = _minmax(native.reduce_reference, op, kind, a, b)
    assert np.array_equal(ab.view(np.uint16), ref.view(np.uint16))
    assert list(np.signbit(ab[:2].astype(np.float32))) == [op == 1] * 2


# ---- one-call copies into and out of fusion buffers (native/fusecopy.c) ---------
needs_fusecopy = pytest.mark.skipif(fusion.fusecopy is None,
                                    reason="native kernels not built (no C compiler at install)")


def _tensors(dtype, sizes, seed):
    """Tensors of `sizes` elements (some 2-D), specials and signalling NaNs
    among them for the float dtypes."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        if np.dtype(dtype).kind == "f" and np.dtype(dtype).itemsize >= 4:
            vals = np.resize(_specials(dtype), n)
            vals[: n // 2] = rng.standard_normal(n // 2) * 1e3
        else:
            vals = rng.integers(0, 100, n).astype(dtype)
        out.append(vals.reshape(n // 4, 4) if n % 4 == 0 and n else vals)
    return out


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _same_values(a, b):
    """The same bits, but where both are NaN: a product of two NaNs is either
    one of them (NumPy 1 and 2 pick differently), quieted."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and _same_bits(a[~nan], b[~nan])


SIZES = [(1,), (0, 5, 8), (3, 0, 4099, 12, 1, 161), [32] * 161,
         (70001, 3)]  # (over 256 KiB: copied with the GIL let go)


@needs_fusecopy
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{len(s)}-tensors")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, -2.0, 1e-40, np.nan, np.inf])
def test_fusecopy_scaled_copies_match_numpy_bit_for_bit(dtype, sizes, scale):
    # (where both operands are NaN, either NaN's payload is right)
    agree = _same_bits if scale == scale else _same_values
    sources = _tensors(dtype, sizes, seed=len(sizes))
    total = sum(sizes)
    scaled = fusion._SCALED_KINDS[np.dtype(dtype)]
    ref, out = np.full(total + 3, 7, dtype), np.full(total + 3, 7, dtype)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        assert fusion.pack_reference(sources, ref, scale) == total
        # A factor of 1 copies (kind 0), as NumPy's way does: no multiplication
        # quiets a signalling NaN.
        assert fusion.fusecopy.pack(0 if scale == 1.0 else scaled, sources, out, scale) == total
        assert agree(out, ref)  # and the 3 elements past the tensors are untouched
        assert fusion.pack(sources, out, scale) == total
        assert agree(out, ref)
        for divisor in (1, 3):
            outs = [np.empty_like(s) for s in sources]
            refs = [np.empty_like(s) for s in sources]
            kind = 0 if scale == 1.0 and divisor == 1 else scaled
            assert fusion.unpack_reference(ref, refs, scale, divisor) == total
            assert fusion.fusecopy.unpack(kind, ref, outs, scale / divisor) == total
            assert all(agree(o, r) for o, r in zip(outs, refs))
            outs = [np.empty_like(s) for s in sources]
            assert fusion.unpack(ref, outs, scale, divisor) == total
            assert all(agree(o, r) for o, r in zip(outs, refs))


@needs_fusecopy
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.float16, np.bool_,
                                   np.float32])
def test_fusecopy_plain_copies_match_numpy(dtype):
    sources = _tensors(dtype, (5, 0, 1000, 3), seed=1)
    ref, out = np.zeros(1008, dtype), np.zeros(1008, dtype)
    fusion.pack_reference(sources, ref)
    assert fusion.fusecopy.pack(0, sources, out, 1.0) == 1008
    assert _same_bits(out, ref)
    outs = [np.empty_like(s) for s in sources]
    assert fusion.fusecopy.unpack(0, ref, outs, 1.0) == 1008
    assert all(_same_bits(o, s) for o, s in zip(outs, sources))


@needs_fusecopy
def test_fusecopy_leaves_conversions_and_odd_buffers_to_numpy():
    buf = np.zeros(8, np.float32)
    strided = np.arange(8, dtype=np.float32)[::2]
    assert fusion.fusecopy.pack(1, [np.ones(2, np.float32), strided], buf, 2.0) is None
    assert fusion.fusecopy.pack(0, [np.ones(2, np.float64)], buf, 1.0) is None  # a conversion
    assert fusion.fusecopy.pack(0, [np.ones(2, np.int32)], buf, 1.0) is None  # same size
    if dtypes.BFLOAT16 is not None:  # a dtype with no buffer format, as buffer or tensor
        bf16 = np.ones(4, dtypes.BFLOAT16)
        assert fusion.fusecopy.pack(0, [bf16[:2], bf16[2:]], np.zeros(4, dtypes.BFLOAT16),
                                    1.0) is None
        assert fusion.fusecopy.unpack(0, bf16, [np.zeros(4, dtypes.BFLOAT16)], 1.0) is None
        out = np.zeros(4, dtypes.BFLOAT16)
        assert fusion.pack([bf16[:2], bf16[2:]], out) == 4 and (out == 1).all()
    assert not buf.any()  # nothing copied
    readonly = np.zeros(2, np.float32)
    readonly.flags.writeable = False
    assert fusion.fusecopy.unpack(0, buf, [np.zeros(2, np.float32), readonly], 1.0) is None
    # The public functions then take NumPy's way: the same values.
    assert fusion.pack([np.ones(2, np.float32), strided], buf, 2.0) == 6
    np.testing.assert_array_equal(buf[:6], [2, 2, 0, 4, 8, 12])
    out = [np.zeros(3, np.float16), np.zeros(3, np.float16)]
    assert fusion.unpack(buf, out, 1.0, 2) == 6
    np.testing.assert_array_equal(np.concatenate(out), [1, 1, 0, 2, 4, 6])


@needs_fusecopy
def test_fusecopy_refuses_more_than_the_buffer_holds_and_a_wrong_kind():
    with pytest.raises(ValueError, match="hold 12 bytes; the fusion buffer 8"):
        fusion.fusecopy.pack(0, [np.ones(3, np.float32)], np.zeros(2, np.float32), 1.0)
    with pytest.raises(ValueError, match="hold 12 bytes; the fusion buffer 8"):
        fusion.fusecopy.unpack(1, np.zeros(2, np.float32), [np.ones(3, np.float32)], 1.0)
    with pytest.raises(ValueError, match="kind 2 does not match an item size of 4"):
        fusion.fusecopy.pack(2, [np.ones(1, np.float32)], np.zeros(2, np.float32), 1.0)
    with pytest.raises(TypeError, match="list or a tuple"):
        fusion.fusecopy.pack(0, 5, np.zeros(2, np.float32), 1.0)
