"""join() as in Horovod, on 2 and 3 ranks (cases: tests/mpi/join_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/join_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_join(case, np_):
    RESULTS.check(case, np_)
