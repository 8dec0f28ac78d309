"""Tensors taken just before and just after cycles are switched back on
meet (cases: tests/mpi/mode_switch_cases.py), with the stall check off: a
case that does not finish fails by its timeout instead of waiting for the
stall report."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/mode_switch_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_CHECK_DISABLE": "1"}, timeout=200,
                      case_timeout=20)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_mode_switch(case, np_):
    RESULTS.check(case, np_)
