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


SETS_MODULE = "tests/mpi/join_set_cases.py"
SETS_RESULTS = CaseResults(SETS_MODULE, env={"HOROVOD_STALL_CHECK_DISABLE": "1"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [3, 4])
@pytest.mark.parametrize("case", case_names(SETS_MODULE))
def test_join_beside_process_sets(case, np_):
    SETS_RESULTS.check(case, np_)
