"""Hierarchical and 2D-torus allreduce are exact at np=4 and np=6 on a
simulated host layout (cases: tests/mpi/algorithm_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/algorithm_cases.py"
LAYOUTS = {
    # (algorithm, ranks per simulated host): the np values to run
    ("hierarchical", 2): (4, 6),
    ("hierarchical", 3): (6,),
    ("torus", 2): (4, 6),
    ("torus", 3): (6,),
}
RUNS = {
    key: CaseResults(MODULE, env={
        "COORDINATOR_SIMULATED_LOCAL_SIZE": str(key[1]),
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1" if key[0] == "hierarchical" else "0",
        "HOROVOD_TORUS_ALLREDUCE": "1" if key[0] == "torus" else "0",
    })
    for key in LAYOUTS
}
PARAMS = [(alg, local, np_) for (alg, local), nps in LAYOUTS.items() for np_ in nps]


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(MODULE))
@pytest.mark.parametrize("algorithm,local_size,np_", PARAMS)
def test_host_aware_allreduce(algorithm, local_size, np_, case):
    RUNS[(algorithm, local_size)].check(case, np_)
