"""send/recv through the coordinator on 2 and 3 ranks (cases:
tests/mpi/p2p_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/p2p_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_p2p(case, np_):
    RESULTS.check(case, np_)
