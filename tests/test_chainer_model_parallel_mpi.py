"""ChainerMN's model parallelism on the coordinator (chainermn.functions,
MultiNodeChainList, the multi-node NStep RNN) at 2 and 3 ranks, checked
against the same model run in one process (cases:
tests/mpi/chainer_model_parallel_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/chainer_model_parallel_cases.py"
# A message whose peer never comes fails after 10 s (one case waits for that).
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_chainer_model_parallel(case, np_):
    RESULTS.check(case, np_)
