"""Each native kernel agrees with its NumPy reference (coordinator/native.py)."""

import numpy as np
import pytest

from coordinator import native

pytestmark = pytest.mark.skipif(native.halfops is None,
                                reason="native kernels not built (no C compiler at install)")

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


@pytest.mark.parametrize("dtype,kind", KINDS, ids=lambda v: str(v))
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 3.0, 1e-4])
def test_scale_matches_numpy_reference(dtype, kind, factor):
    a = _values(dtype, 5000, seed=3)
    ref = a.copy()
    native.scale_reference(kind, ref, factor)
    out = a.copy()
    native.halfops.scale(kind, out, factor)
    assert _same(out, ref)


def test_reduce_rejects_mismatched_buffers():
    with pytest.raises(ValueError, match="equal, even sizes"):
        native.halfops.reduce(0, 0, np.zeros(3, np.float16), np.zeros(4, np.float16))
    with pytest.raises(ValueError, match="unknown reduce op"):
        native.halfops.reduce(9, 0, np.zeros(3, np.float16), np.zeros(3, np.float16))
