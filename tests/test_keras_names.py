"""frontends.tensorflow.keras's Adasum and PartialDistributedOptimizer on 2
ranks under mpirun (cases: tests/mpi/keras_names_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/keras_names_cases.py"
RESULTS = CaseResults(MODULE, env={"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
                      timeout=300, case_timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(MODULE))
def test_keras_names(case):
    RESULTS.check(case, 2)
