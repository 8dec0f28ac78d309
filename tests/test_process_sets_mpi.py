"""Process sets on 2-4 ranks (cases: tests/mpi/process_set_cases.py,
tests/mpi/dynamic_set_cases.py and tests/mpi/split_set_cases.py)."""

import os

import pytest

from mpi_harness import CaseResults, case_names, mpirun

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")

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


@pytest.mark.mpi
def test_sets_registered_back_to_back_get_their_communicators_whatever_a_later_one_waits_for():
    """X = {0, 1, 2} then Y = {0, 2, 3}, rank 3 coming to Y only once X is
    made: made in a thread each, Open MPI's Create_group calls blocked each
    other and X never finished now and then (2 of 3 jobs of 16 rounds); made
    in order, every round finishes (tests/scripts/communicators_in_order.py)."""
    run = mpirun([os.path.join(SCRIPTS, "communicators_in_order.py"), "60", "16"], np_=4,
                 timeout=120)
    out = run.stdout + run.stderr
    assert sorted(line for line in out.splitlines() if line[:3] in ("OK ", "STU")) == [
        f"OK {r}" for r in range(4)], out[-3000:]
    assert run.returncode == 0, out[-3000:]


def test_init_starts_mpi_where_the_program_told_mpi4py_not_to():
    """mpi4py.rc.initialize = False: init starts MPI, as Horovod's does, and it
    is finalized at exit (the process aborted in init: MPI_Comm_rank before
    MPI_Init; found with Horovod's test_process_sets_static.py)."""
    run = mpirun([os.path.join(SCRIPTS, "init_starts_mpi.py")], np_=2, timeout=120)
    out = run.stdout + run.stderr
    assert sorted(line for line in out.splitlines() if line.startswith("OK ")) == [
        "OK 0", "OK 1"], out[-3000:]
    assert run.returncode == 0, out[-3000:]
