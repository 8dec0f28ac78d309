"""Whether Chainer is installed. Chainer 7.8.1 imports only with NumPy 1, so
an environment with NumPy 2 (make test's second pass, the GPU machine's
image) has none: its tests skip there, saying why, as TensorFlow's do where
TensorFlow is missing (tests/conftest.py)."""

import importlib.util

NO_CHAINER = importlib.util.find_spec("chainer") is None
CHAINER_REASON = "Chainer is not installed (Chainer 7.8.1 needs NumPy 1)"
