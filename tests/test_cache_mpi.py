"""A response cache smaller than a step, and none at all
(`--disable-cache`), on 3 ranks (a set of two beside the global one):
evictions, stale ids described again, every tensor in rounds, results
right (cases: tests/mpi/cache_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

CASES = {capacity: CaseResults("tests/mpi/cache_cases.py", case_timeout=30,
                               env={"HOROVOD_CACHE_CAPACITY": capacity})
         for capacity in ("2", "0")}


@pytest.mark.mpi
@pytest.mark.parametrize("capacity", sorted(CASES))
@pytest.mark.parametrize("case", case_names("tests/mpi/cache_cases.py"))
def test_a_small_response_cache_or_none(case, capacity):
    CASES[capacity].check(case, 3)
