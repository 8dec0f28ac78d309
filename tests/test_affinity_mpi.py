"""HOROVOD_THREAD_AFFINITY (coordrun --thread-affinity) on 2 ranks of one
machine (cases: tests/mpi/affinity_cases.py)."""

import pytest

from mpi_harness import CaseResults

# Reversed, so that a thread left on its local rank's own number would fail;
# then a core no machine here has.
PINNED = CaseResults("tests/mpi/affinity_cases.py", env={"HOROVOD_THREAD_AFFINITY": "1,0"})
MISSING = CaseResults("tests/mpi/affinity_cases.py", env={"HOROVOD_THREAD_AFFINITY": "4095"})
CASE = "the_background_thread_runs_on_its_local_ranks_core"


@pytest.mark.mpi
def test_each_ranks_background_thread_is_pinned_to_its_listed_core():
    PINNED.check(CASE, 2)


@pytest.mark.mpi
def test_a_core_the_process_may_not_use_is_a_warning_not_an_error():
    MISSING.check(CASE, 2)
    output = MISSING.run(2)["output"]
    assert output.count("cannot pin the background thread") == 2, output[-2000:]
    assert "to core 4095" in output
