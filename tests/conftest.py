import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Chainer 7.8.1 imports only with NumPy 1, so an environment with NumPy 2 (make
# test's second pass, the GPU machine's image) has no Chainer: its tests skip
# there, saying why, as TensorFlow's do where TensorFlow is missing.
NO_CHAINER = importlib.util.find_spec("chainer") is None
CHAINER_REASON = "Chainer is not installed (Chainer 7.8.1 needs NumPy 1)"


def pytest_collection_modifyitems(config, items):
    if not NO_CHAINER:
        return
    skip = pytest.mark.skip(reason=CHAINER_REASON)
    for item in items:
        if "chainer" in item.nodeid.lower():
            item.add_marker(skip)
