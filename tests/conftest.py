import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chainer_presence import CHAINER_REASON, NO_CHAINER  # noqa: E402


# Seconds each test file took in the suite (make test at 7acaad9, with
# --durations=0; files under 15 s are left out). make test's workers take
# whole files (--dist loadfile --no-loadscope-reorder), in the order of the
# collection: the longest first, so that no worker is left running a long
# file at the end while the other has nothing to do. In the NumPy-2 part the
# last file was the longest, and one worker idled 70 s of its 5.5 min. The
# figures only order the files: a stale one costs time, never a result.
FILE_SECONDS = {
    "test_elastic_mpi.py": 246,
    "test_lifecycle_mpi.py": 217,
    "test_faults.py": 213,
    "test_random_collectives_mpi.py": 172,
    "test_tensorflow.py": 166,
    "test_tensorflow_examples.py": 132,
    "test_gpu_fallback.py": 98,
    "test_large_mpi.py": 93,
    "test_torch_mpi.py": 77,
    "test_multihost.py": 61,
    "test_mixed_frameworks.py": 60,
    "test_tensorflow_legacy.py": 46,
    "test_run.py": 46,
    "test_nan_mpi.py": 43,
    "test_chainer_mpi.py": 38,
    "test_chainer_model_parallel_example.py": 35,
    "test_chainer_model_parallel_mpi.py": 33,
    "test_keras.py": 30,
    "test_process_sets_mpi.py": 26,
    "test_elastic.py": 25,
    "test_core_mpi.py": 25,
    "test_algorithms_mpi.py": 25,
    "test_memory_mpi.py": 24,
    "test_chainer_example.py": 22,
    "test_join_mpi.py": 21,
    "test_chainer_except_hook.py": 21,
    "test_riders_mpi.py": 19,
    "test_refusals_mpi.py": 19,
    "test_fork_mpi.py": 18,
    "test_examples.py": 18,
    "test_chainer_extensions_mpi.py": 18,
}


def _file_seconds(item):
    return FILE_SECONDS.get(item.path.name, 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_seconds, reverse=True)  # stable: a file's own order is kept
    if not NO_CHAINER:
        return
    skip = pytest.mark.skip(reason=CHAINER_REASON)
    for item in items:
        if "chainer" in item.nodeid.lower():
            item.add_marker(skip)
