"""The Chainer frontend (ChainerMN's API) on 2 and 4 ranks under mpirun
(cases: tests/mpi/chainer_cases.py)."""

import os
import shutil
import tempfile

import pytest

from mpi_harness import ROOT, CaseResults, case_names, mpirun

MODULE = "tests/mpi/chainer_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_chainer(case, np_):
    RESULTS.check(case, np_)


# Stall checks and the deadlock and silence limits off: no watchdog ping asks
# an idle rank into a negotiation cycle.
UNWATCHED = CaseResults(MODULE, env={"HOROVOD_STALL_CHECK_DISABLE": "1",
                                     "COORDINATOR_DEADLOCK_SECONDS": "0",
                                     "COORDINATOR_SILENT_RANK_SECONDS": "0",
                                     "CASES": "one_group_wraps_its_sub_communicator_while_the_"
                                              "others_do_not"})


@pytest.mark.mpi
def test_a_group_registers_its_set_while_the_other_ranks_have_nothing_to_do():
    """The ranks outside the group wait in mpi4py, their background threads
    idle: the group's add asks rank 0 to bring them into its cycle (as a
    join does), where it waited for a ping that never came."""
    UNWATCHED.check("one_group_wraps_its_sub_communicator_while_the_others_do_not", 3)


PEER_LEAVES = os.path.join(ROOT, "tests", "scripts", "chainer_peer_leaves.py")


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["gather_obj", "alltoall", "recv_obj"])  # one per way of waiting
def test_a_rank_leaving_after_its_own_exception_fails_the_others_waiting_in_a_method(op):
    """Rank 1 raises while ranks 0 and 2 wait for it in `op`: they raise a
    ShutdownError naming its exception, where mpi4py's collectives (and
    recv_obj's probe) held them for good."""
    outcomes = tempfile.mkdtemp(prefix="chainer-leaves-")
    try:
        proc = mpirun([PEER_LEAVES, op], np_=3, env={"OUTCOMES": outcomes}, timeout=120)
        for rank in (0, 2):
            path = os.path.join(outcomes, str(rank))
            assert os.path.exists(path), (rank, proc.stdout[-2000:] + proc.stderr[-2000:])
            seconds, outcome = open(path).read().splitlines()[:2]
            assert outcome.startswith("ShutdownError"), (rank, outcome)
            assert "rank 1 is exiting after an uncaught ValueError: a bug in rank 1's training" \
                in outcome, (rank, outcome)
            assert float(seconds) < 60, (rank, seconds)
    finally:
        shutil.rmtree(outcomes, ignore_errors=True)
