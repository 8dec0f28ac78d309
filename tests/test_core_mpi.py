"""The core API on 2, 3 and 4 ranks under mpirun (cases: tests/mpi/core_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/core_cases.py"
# Small pack and segment sizes so that every path of the allreduce runs.
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
                                   "COORDINATOR_PACK_LIMIT": "16384",
                                   "COORDINATOR_SEGMENT_BYTES": "262144"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_core(case, np_):
    RESULTS.check(case, np_)
