"""The examples' data, bundled: the 1,797 8x8 handwritten digits of the UCI
"Optical Recognition of Handwritten Digits" test set (E. Alpaydin and C.
Kaynak, 1998; CC BY 4.0), as scikit-learn ships them, in `digits.npz`
(pixels 0..16 and labels, as uint8: 45 KB).

`load_digits()` and `train_test_split()` give what scikit-learn's functions
of those names give for the arguments the examples use, array for array and
in the same order, so that the examples and their tests need not install
scikit-learn: Keras 3 imports it (and SciPy) whenever it is installed, 1.0 to
1.3 s of CPU in every process that imports TensorFlow.
"""

import math
import os
from types import SimpleNamespace

import numpy as np

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


def load_digits():
    """An object with `images` (1797, 8, 8) and `data` (1797, 64), float64
    pixels 0..16, and `target` (1797,), int64 labels 0..9."""
    with np.load(PATH) as f:
        images, target = f["images"], f["target"]
    images = images.astype(np.float64)
    return SimpleNamespace(images=images, data=images.reshape(len(images), -1),
                           target=target.astype(np.int64))


def train_test_split(x, y, test_size, random_state):
    """(x_train, x_test, y_train, y_test): a shuffled split with
    ceil(test_size * n) test samples, the permutation drawn from
    np.random.RandomState(random_state), as scikit-learn splits without
    stratifying."""
    if len(x) != len(y):
        raise ValueError(f"train_test_split: {len(x)} samples but {len(y)} labels")
    n = len(x)
    n_test = math.ceil(test_size * n)
    order = np.random.RandomState(random_state).permutation(n)
    test, train = order[:n_test], order[n_test:]
    return x[train], x[test], y[train], y[test]
