"""Every op past 2**31 elements and bytes, at np=2 (cases:
tests/mpi/large_cases.py). Before, a 2.5 GiB broadcast failed with MPI_ERR_ARG
and no reason: the count passed to MPI overflowed an int."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/large_cases.py"
RESULTS = CaseResults(MODULE, timeout=900, case_timeout=300)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("case", case_names(MODULE))
def test_past_two_gib(case):
    RESULTS.check(case, 2)
