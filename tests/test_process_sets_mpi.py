"""Process sets on 2-4 ranks (cases: tests/mpi/process_set_cases.py,
tests/mpi/dynamic_set_cases.py and tests/mpi/split_set_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

STATIC = CaseResults("tests/mpi/process_set_cases.py")
SPLIT = CaseResults("tests/mpi/split_set_cases.py")
DYNAMIC = CaseResults("tests/mpi/dynamic_set_cases.py")


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("case", case_names("tests/mpi/process_set_cases.py"))
def test_static_process_sets(case, np_):
    STATIC.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names("tests/mpi/dynamic_set_cases.py"))
def test_dynamic_process_sets(case, np_):
    DYNAMIC.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("case", case_names("tests/mpi/split_set_cases.py"))
def test_sets_from_split_communicators(case, np_):
    SPLIT.check(case, np_)
