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


FIRST_SEND = "the_first_send_of_a_set_needs_no_other_member"
FOUR = CaseResults(MODULE, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "CASES": FIRST_SEND,
                                "HOROVOD_STALL_CHECK_DISABLE": "1"})


@pytest.mark.mpi
def test_the_first_send_of_a_set_needs_no_other_member_at_np4():
    """With stall checks off, so nothing but the fix can bring the idle
    member in."""
    FOUR.check(FIRST_SEND, 4)
