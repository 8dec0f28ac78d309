"""One rank refuses an operation; every rank hears of it (cases:
tests/mpi/refusal_cases.py). The stall shutdown time stays at its default
(never), so without the refusal reaching the coordinator the others would
wait forever: the per-case timeout turns that into a failure."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/refusal_cases.py"
RESULTS = CaseResults(MODULE, case_timeout=40, timeout=400)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_refusals(case, np_):
    RESULTS.check(case, np_)


SETS = CaseResults("tests/mpi/set_refusal_cases.py", case_timeout=40)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("tests/mpi/set_refusal_cases.py"))
def test_refusals_in_a_process_set(case):
    SETS.check(case, 3)


CACHED = CaseResults("tests/mpi/cached_mismatch_cases.py",
                     env={"HOROVOD_STALL_CHECK_DISABLE": "1"}, case_timeout=40)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names("tests/mpi/cached_mismatch_cases.py"))
def test_a_cached_tensor_changed_on_one_rank(case, np_):
    CACHED.check(case, np_)
