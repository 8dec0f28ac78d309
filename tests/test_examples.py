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


@pytest.mark.mpi
def test_group_overhead_checks_the_result_then_times_both_sides():
    proc = mpirun(["examples/group_overhead.py", "--calls", "20", "--rounds", "3"], np_=2,
                  timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = re.search(r"2 ranks, 8 tensors: core ([\d.]+) us  floor ([\d.]+) us  ratio "
                     r"([\d.]+)  \(per round ([\d. ]+)\)", out)
    assert line, out
    assert all(float(v) > 0 for v in line.groups()[:3])
    assert len(line.group(4).split()) == 2, out  # rounds after the warm-up


@pytest.mark.mpi
def test_group_overhead_alone_times_the_core_only():
    proc = mpirun(["examples/group_overhead.py", "--alone", "--calls", "20", "--rounds", "1"],
                  np_=1, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"1 rank, 8 tensors: core [\d.]+ us\n", out) and "floor" not in out, out


@pytest.mark.mpi
def test_torch_submit_cost_checks_the_results_then_times_the_submissions():
    proc = mpirun(["examples/torch/submit_cost.py", "--steps", "5"], np_=2, timeout=180,
                  env={"OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = re.search(r"2 ranks, 161 tensors: submit ([\d.]+) us/tensor \(median of 5 steps\)",
                     out)
    assert line and float(line.group(1)) > 0, out


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [1, 2])
def test_step_overhead_checks_the_results_then_times_submission_and_waiting(np_):
    proc = mpirun(["examples/step_overhead.py", "--steps", "5", "--tensors", "7"], np_=np_,
                  timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = re.search(rf"{np_} ranks?, 7 tensors: submit ([\d.]+) us/tensor, synchronize "
                     r"([\d.]+) us/tensor, background thread ([\d.]+) ms/step, step ([\d.]+) "
                     r"ms \(median of 5 steps\)", out)
    assert line, out
    assert float(line.group(1)) > 0 and float(line.group(4)) > 0, out
