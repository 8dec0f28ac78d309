"""The examples train to a useful accuracy on 2 ranks."""

import re

import pytest

from mpi_harness import mpirun


@pytest.mark.mpi
def test_numpy_digits_example_learns_and_ranks_agree():
    proc = mpirun(["examples/numpy_digits.py", "--epochs", "8"], np_=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", out)]
    assert len(accuracies) == 8 + 1, out  # one line per epoch, then the summary
    assert accuracies[-1] >= 0.9, out
    assert "done: 2 ranks" in out
