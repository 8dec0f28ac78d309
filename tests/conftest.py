import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chainer_presence import CHAINER_REASON, NO_CHAINER  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not NO_CHAINER:
        return
    skip = pytest.mark.skip(reason=CHAINER_REASON)
    for item in items:
        if "chainer" in item.nodeid.lower():
            item.add_marker(skip)
