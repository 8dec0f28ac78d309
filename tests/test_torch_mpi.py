"""frontends.torch under mpirun at 2 and 3 ranks (cases: tests/mpi/torch_*_cases.py),
and the PyTorch digits example."""

import re

import pytest

from mpi_harness import CaseResults, case_names, mpirun

OPS = "tests/mpi/torch_ops_cases.py"
TRAINING = "tests/mpi/torch_training_cases.py"
STATE = "tests/mpi/torch_state_cases.py"
ENV = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30", "OMP_NUM_THREADS": "1"}
OPS_RESULTS = CaseResults(OPS, env=ENV)
TRAINING_RESULTS = CaseResults(TRAINING, env=ENV)
STATE_RESULTS = CaseResults(STATE, env=ENV)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(OPS))
def test_torch_ops(case, np_):
    OPS_RESULTS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(TRAINING))
def test_torch_training(case, np_):
    TRAINING_RESULTS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(STATE))
def test_torch_optimizer_state(case, np_):
    STATE_RESULTS.check(case, np_)


@pytest.mark.mpi
def test_torch_digits_example_reaches_95_percent_on_2_ranks():
    proc = mpirun(["examples/torch/train_digits.py"], np_=2, timeout=240,
                  env={"OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    epochs = re.findall(r"epoch +\d+: train loss (\d+\.\d+) +test accuracy (\d\.\d+)", out)
    assert len(epochs) == 12, out
    losses = [float(loss) for loss, _ in epochs]
    assert losses[-1] < losses[0] / 4, out
    final = float(re.search(r"done: 2 ranks, final test accuracy (\d\.\d+)", out).group(1))
    assert final >= 0.95, out
