"""frontends.tensorflow.keras on 2 ranks under mpirun (cases: tests/mpi/keras_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/keras_cases.py"
RESULTS = CaseResults(MODULE, env={"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"},
                      timeout=400, case_timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_keras(case, np_):
    RESULTS.check(case, np_)
