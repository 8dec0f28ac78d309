"""A response cache smaller than a step on 3 ranks (a set of two beside the
global one): evictions, stale ids described again, results right (cases:
tests/mpi/cache_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

CASES = CaseResults("tests/mpi/cache_cases.py", env={"HOROVOD_CACHE_CAPACITY": "2"},
                    case_timeout=30)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [3])
@pytest.mark.parametrize("case", case_names("tests/mpi/cache_cases.py"))
def test_a_small_response_cache(case, np_):
    CASES.check(case, np_)
