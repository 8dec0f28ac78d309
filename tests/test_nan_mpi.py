"""A NaN on one rank survives Min and Max allreduce in every float dtype, on
every path of the allreduce, and through the hierarchical and 2D-torus
algorithms (cases: tests/mpi/nan_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/nan_cases.py"
# Default pack limit (128 KiB) and segment size (4 MiB): the cases size their
# tensors from the running configuration.
ENV = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}
RUNS = {
    "flat": CaseResults(MODULE, env=ENV),
    # Two simulated hosts of two ranks each at np=4 (see test_algorithms_mpi.py).
    "hierarchical": CaseResults(MODULE, env=dict(ENV, COORDINATOR_SIMULATED_LOCAL_SIZE="2",
                                                 HOROVOD_HIERARCHICAL_ALLREDUCE="1")),
    "torus": CaseResults(MODULE, env=dict(ENV, COORDINATOR_SIMULATED_LOCAL_SIZE="2",
                                          HOROVOD_TORUS_ALLREDUCE="1")),
}
PARAMS = [("flat", 2), ("flat", 3), ("hierarchical", 4), ("torus", 4)]


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(MODULE))
@pytest.mark.parametrize("algorithm,np_", PARAMS)
def test_min_max_nan(algorithm, np_, case):
    RUNS[algorithm].check(case, np_)
