"""ChainerMN's multi_node_snapshot and MultiNodeEarlyStoppingTrigger on the
coordinator at 2 and 3 ranks, including the disagreements that made
ChainerMN's ranks wait for each other forever (cases:
tests/mpi/chainer_extension_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/chainer_extension_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_chainer_extensions(case, np_):
    RESULTS.check(case, np_)
