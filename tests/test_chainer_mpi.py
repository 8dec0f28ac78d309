"""The Chainer frontend (ChainerMN's API) on 2 and 4 ranks under mpirun
(cases: tests/mpi/chainer_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/chainer_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_chainer(case, np_):
    RESULTS.check(case, np_)
