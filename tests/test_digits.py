"""The bundled digits (coordinator/digits.py) are scikit-learn's, and the
split is scikit-learn's train_test_split for the same arguments: the values
pinned here are what scikit-learn 1.9.1 gave (checked array for array
against it when the data was bundled)."""

import numpy as np
import pytest

from coordinator.digits import load_digits, train_test_split


def test_the_digits_are_scikit_learns():
    d = load_digits()
    assert d.images.shape == (1797, 8, 8) and d.data.shape == (1797, 64)
    assert d.images.dtype == d.data.dtype == np.float64 and d.target.dtype == np.int64
    assert (d.data == d.images.reshape(1797, 64)).all()
    assert d.data.min() == 0 and d.data.max() == 16 and d.data.sum() == 561718
    assert np.bincount(d.target).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert d.data[0].astype(int).tolist()[:16] == [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10,
                                                    15, 5, 0]
    assert d.target[:10].tolist() == list(range(10))


def test_the_split_is_scikit_learns():
    d = load_digits()
    x = (d.data / 16).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, d.target, test_size=0.25,
                                                        random_state=0)
    assert (len(x_train), len(x_test)) == (1347, 450) and x_train.dtype == np.float32
    assert y_train[:8].tolist() == [2, 8, 9, 7, 2, 1, 4, 9]
    assert y_test[:8].tolist() == [2, 8, 2, 6, 6, 7, 1, 9]
    # every sample once, in one part or the other
    rows = {r.tobytes() for r in x_train} | {r.tobytes() for r in x_test}
    assert len(rows) == len({r.tobytes() for r in x})
    again = train_test_split(x, d.target, test_size=0.25, random_state=0)
    assert all((a == b).all() for a, b in zip(again, (x_train, x_test, y_train, y_test)))
    other = train_test_split(x, d.target, test_size=0.25, random_state=1)
    assert (other[3] != y_test).any()


def test_a_split_of_unequal_lengths_is_refused():
    with pytest.raises(ValueError, match="3 samples but 2 labels"):
        train_test_split(np.zeros(3), np.zeros(2), test_size=0.5, random_state=0)
