"""Adasum's pairwise combination (coordinator/ops/adasum.py) on one process."""

import numpy as np

from coordinator.ops.adasum import combine


def test_equal_vectors_average_and_orthogonal_ones_add():
    a = np.array([1.0, 2.0, 0.0, 0.0], np.float32)
    b = np.array([0.0, 0.0, 3.0, 4.0], np.float32)
    np.testing.assert_allclose(combine(a, a.copy(), [(0, 4)]), a)
    np.testing.assert_allclose(combine(a, b, [(0, 4)]), a + b)
    # Each segment on its own: equal in the first two, orthogonal in the rest.
    c = np.array([1.0, 2.0, 5.0, 0.0], np.float32)
    d = np.array([1.0, 2.0, 0.0, 6.0], np.float32)
    np.testing.assert_allclose(combine(c, d, [(0, 2), (2, 4)]), [1.0, 2.0, 5.0, 6.0])


def test_tiny_float32_values_are_combined_as_in_float64():
    """Squares of values near 1e-37 underflow in float32: the norms came out
    0 and the combination fell back to the plain sum, twice the average of
    equal vectors. Horovod accumulates the dot products in double."""
    a = np.full(8, 1e-37, np.float32)
    b = a * np.float32(3.0)  # parallel: the result is (a + b) / 2 scaled as Adasum says
    out = combine(a, b, [(0, 8)])
    x, y = a.astype(np.float64), b.astype(np.float64)
    dot = x @ y
    want = (1 - dot / (2 * (x @ x))) * x + (1 - dot / (2 * (y @ y))) * y
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-6)
    assert not np.allclose(out, a + b, rtol=1e-3, atol=0)


def test_huge_float32_values_are_combined_as_in_float64():
    a = np.full(8, 3e19, np.float32)  # the squares overflow float32
    b = a * np.float32(2.0)
    x, y = a.astype(np.float64), b.astype(np.float64)
    dot = x @ y
    want = (1 - dot / (2 * (x @ x))) * x + (1 - dot / (2 * (y @ y))) * y
    np.testing.assert_allclose(combine(a, b, [(0, 8)]).astype(np.float64), want, rtol=1e-6)
