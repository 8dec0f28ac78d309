"""A thread blocked in a collective runs the coordinator's loop itself
(cases: tests/mpi/drive_cases.py), at 2 and 3 ranks, with driving off, and
with a driven turn that fails (one rank, a job each)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/drive_cases.py"
RESULTS = CaseResults(MODULE)
OFF = CaseResults(MODULE, env={"COORDINATOR_DRIVE_SECONDS": "0"})
FAILING = "a_failing_driven_turn_stops_the_coordinator_with_its_error"
FAILS = {mode: CaseResults(MODULE, env={"DRIVE_FAILS": mode, "CASES": FAILING})
         for mode in ("error", "interrupt")}


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", [c for c in case_names(MODULE) if c != FAILING])
def test_driving(case, np_):
    RESULTS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("case", [c for c in case_names(MODULE) if c != FAILING])
def test_with_driving_off_the_background_thread_takes_everything(case):
    OFF.check(case, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["error", "interrupt"])
def test_a_failing_driven_turn_stops_the_coordinator_as_the_background_thread_would(mode):
    FAILS[mode].check(FAILING, 1)
