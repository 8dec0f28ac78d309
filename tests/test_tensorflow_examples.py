"""The TensorFlow examples learn the digits on 2 ranks, and the overhead
comparison runs end to end."""

import re
import sys

import pytest

from mpi_harness import ROOT, mpi_env, mpirun, run_job

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}


def _accuracies(out):
    return [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", out)]


@pytest.mark.mpi
def test_keras_digits_example_learns_and_ranks_agree():
    proc = mpirun(["examples/tensorflow/keras_digits.py", "--epochs", "6"], np_=2, env=ENV,
                  timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracies = _accuracies(out)
    assert len(accuracies) == 6 + 1, out  # one line per epoch (rank 0 only), then the summary
    assert accuracies[-1] >= 0.9, out
    assert "done: 2 ranks" in out and re.search(r"median step time [0-9.]+ ms", out), out


@pytest.mark.mpi
def test_gradient_tape_digits_example_learns_and_ranks_agree():
    proc = mpirun(["examples/tensorflow/gradient_tape_digits.py", "--epochs", "6"], np_=2,
                  env=ENV, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    accuracies = _accuracies(out)
    assert len(accuracies) == 6 + 1, out
    assert accuracies[-1] >= 0.9, out
    assert "done: 2 ranks" in out


@pytest.mark.mpi
@pytest.mark.slow
def test_compare_overhead_times_all_four_configurations():
    proc = run_job([sys.executable, "examples/tensorflow/compare_overhead.py",
                    "--runs", "1", "--epochs", "2"], cwd=ROOT, env=mpi_env(ENV), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for what in ("step", "epoch"):
        times = re.search(rf"median {what} time: distributed ([0-9.]+) ms  raw MPI ([0-9.]+) ms  "
                          r"baseline ([0-9.]+) ms  alone ([0-9.]+) ms", out)
        assert times and all(float(t) > 0 for t in times.groups()), out
    assert re.search(r"overhead of distribution .*: [+-][0-9.]+% per step, [+-][0-9.]+% per "
                     r"epoch", out), out
    assert re.search(r"floor: raw MPI / baseline - 1: [+-][0-9.]+% per step", out), out


@pytest.mark.mpi
def test_keras_digits_raw_mpi_floor_trains_the_same_model_on_every_rank():
    """The raw-MPI configuration really averages: the example asserts that
    both ranks end with identical weights (it exits non-zero otherwise), and
    it learns."""
    proc = mpirun(["examples/tensorflow/keras_digits.py", "--raw-mpi", "--epochs", "4"], np_=2,
                  env=ENV, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "done: 2 ranks, raw MPI" in out, out
    assert _accuracies(out)[-1] >= 0.85, out
