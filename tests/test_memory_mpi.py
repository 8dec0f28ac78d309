"""Memory: no per-step allocation in steady state; buffers bounded by the
fusion threshold (cases: tests/mpi/memory_cases.py)."""

import pytest

from mpi_harness import CaseResults

RESULTS = CaseResults("tests/mpi/memory_cases.py",
                      env={"HOROVOD_FUSION_THRESHOLD": str(1 << 20)})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_steady_state_training_allocates_nothing_per_step(np_):
    RESULTS.check("steady_state_training_allocates_nothing_per_step", np_)
