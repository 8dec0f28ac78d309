"""init/shutdown semantics and stalls, under mpirun."""

import os
import re

import pytest

from mpi_harness import CaseResults, case_names, mpirun

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")

LIFECYCLE = CaseResults("tests/mpi/lifecycle_cases.py")
STALLS = CaseResults("tests/mpi/stall_cases.py",
                     env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}, case_timeout=120)
DEADLOCKS = CaseResults("tests/mpi/deadlock_cases.py",
                        env={"COORDINATOR_DEADLOCK_SECONDS": "2"}, case_timeout=60)
QUIET_DEADLOCKS = CaseResults("tests/mpi/deadlock_cases.py",
                              env={"COORDINATOR_DEADLOCK_SECONDS": "2",
                                   "HOROVOD_STALL_CHECK_DISABLE": "1"}, case_timeout=60)
FRAMEWORK_DEADLOCKS = CaseResults("tests/mpi/framework_deadlock_cases.py",
                                  env={"COORDINATOR_DEADLOCK_SECONDS": "2",
                                       "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""},
                                  timeout=300, case_timeout=90)
SET_STALLS = CaseResults("tests/mpi/set_stall_cases.py",
                         env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}, case_timeout=60)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names("tests/mpi/lifecycle_cases.py"))
def test_lifecycle(case, np_):
    LIFECYCLE.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_stalled_tensor_fails_naming_the_missing_rank(np_):
    STALLS.check("stalled_tensor_fails_on_every_rank_naming_the_missing_rank", np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", ["after_a_stall_every_rank_stays_in_step",
                                  "a_rank_late_again_and_again_stays_in_step"])
def test_after_stalls_each_ranks_nth_submission_meets_the_others_nth(case, np_):
    STALLS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_rank_0_late_past_the_report_time_leaves_the_next_steps_whole(np_):
    STALLS.check("rank_0_late_past_the_report_time_leaves_the_next_steps_whole", np_)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("tests/mpi/set_stall_cases.py"))
def test_stalls_in_a_process_set(case):
    SET_STALLS.check(case, 3)


@pytest.mark.mpi
def test_a_send_nobody_receives_is_a_stall_naming_the_receiver():
    STALLS.check("a_send_nobody_receives_is_a_stall_naming_the_receiver", 2)


@pytest.mark.mpi
def test_stall_warning_names_tensor_missing_rank_and_wait():
    output = STALLS.run(2)["output"]
    assert "WARNING" in output and "'stalled'" in output
    assert "rank 1 did not submit it" in output
    assert "rank 0 has waited" in output


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names("tests/mpi/deadlock_cases.py"))
def test_deadlocks(case, np_):
    DEADLOCKS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("tests/mpi/deadlock_cases.py"))
def test_deadlocks_with_stall_checks_disabled(case):
    QUIET_DEADLOCKS.check(case, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names("tests/mpi/framework_deadlock_cases.py"))
def test_uneven_data_without_join_is_a_deadlock_error_in_keras_and_pytorch(case):
    FRAMEWORK_DEADLOCKS.check(case, 2)


def job_of_three(script, mode, env, ok=None, more=()):
    """The output of `script mode *more` run at np=3, once its exit status
    said whether it succeeded (`ok`; None: not checked)."""
    proc = mpirun([os.path.join(SCRIPTS, script), mode, *more], np_=3, env=env, timeout=150)
    out = proc.stdout + proc.stderr
    if ok is not None:
        assert (proc.returncode == 0) == ok, out
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["leaves", "alone"])
def test_init_fails_naming_a_rank_that_never_calls_it(mode):
    # init's first collective waited for ever for a rank that left without
    # init() (having started MPI) or that alone called init() again after a
    # shutdown.
    out = job_of_three("init_without_a_peer.py", mode, {"COORDINATOR_DEADLOCK_SECONDS": "3"})
    waiting = [0, 1] if mode == "leaves" else [2]
    # (rank 0 gathers who came; a rank that rank 0 never answers knows only
    # that rank 0 did not come)
    missing = "rank 2 of 3" if mode == "leaves" else "rank 0 of 3"
    for rank in waiting:
        assert re.search(rf"rank {rank}: init raised DeadlockError after \d+ s: init\(\): "
                         rf"{missing} did not call init\(\) within 3 s", out), out


@pytest.mark.mpi
@pytest.mark.parametrize("mode,what", [
    ("stopped", "is stopped (SIGSTOP, or a debugger holds it)"),
    ("idle", "is running but has not called init()"),
])
def test_a_rank_that_never_starts_mpi_ends_the_job_naming_it(mode, what):
    # MPI starts in init(), and MPI_Init waited for ever for a rank that
    # never got there; it cannot be interrupted, so a watcher process ends
    # a rank that waited too long, and the launcher ends the job.
    out = job_of_three("init_before_mpi.py", mode, {"HOROVOD_START_TIMEOUT": "3"}, ok=False)
    # Both waiting ranks say so: the first to find its wait too long tells
    # the other's watcher.
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\] ERROR coordinator: init\(\) has waited \d+ s in "
                         r"MPI_Init for the other ranks of the job to start MPI "
                         r"\(HOROVOD_START_TIMEOUT=3\): "
                         rf"rank 2 \(pid \d+\) {re.escape(what)}", out), out
    assert "init ok" not in out


@pytest.mark.mpi
def test_ranks_waiting_in_mpi_init_go_on_when_the_last_one_comes():
    out = job_of_three("init_before_mpi.py", "late", {"HOROVOD_START_TIMEOUT": "60"}, ok=True)
    for rank in range(3):
        assert f"rank {rank}: init ok, sum 3, watchers left []" in out, out
    assert "ERROR" not in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("started_by", ["init", "mpi4py-first"])
def test_a_rank_stopped_before_its_shutdown_ends_the_job_from_mpi_finalize(started_by):
    # The others' shutdown waits for it until its deadline (30 s, cut to 3 s
    # by the script), as before; then MPI_Finalize waited for it for ever. A
    # watcher process names it and ends them. Also where the program started
    # MPI (importing mpi4py's MPI first): mpi4py's own finalizer, which had
    # no watcher, waited there for good.
    out = job_of_three("stopped_at_exit.py", "stopped", {"COORDINATOR_SILENT_RANK_SECONDS": "2"},
                       ok=False, more=[started_by] if started_by != "init" else [])
    for rank in (0, 1):
        assert f"rank {rank}: done" in out, out
        assert re.search(rf"\[{rank}\] ERROR coordinator: MPI_Finalize waits for every rank of "
                         r"the job, and rank 2 \(pid \d+\) has been stopped \(SIGSTOP, or a "
                         r"debugger holds it\) for \d+ s \(COORDINATOR_SILENT_RANK_SECONDS=2\)"
                         r"\. MPI_Finalize cannot be interrupted", out), out
    # (Rank 2 may yet print "done": the launcher continues a stopped rank
    # as it ends the job.)


@pytest.mark.mpi
@pytest.mark.parametrize("started_by", ["init", "mpi4py-first"])
def test_mpi_finalize_waits_for_a_rank_stopped_for_less_than_the_limit(started_by):
    # Continued once the others wait in MPI_Finalize, well within the
    # limit: waited for, as in Horovod, and the job ends well (mpi4py-first:
    # in mpi4py's finalizer, under the watcher started at exit).
    out = job_of_three("stopped_at_exit.py", "paused", {"COORDINATOR_SILENT_RANK_SECONDS": "30"},
                       ok=True, more=[started_by] if started_by != "init" else [])
    for rank in range(3):
        assert f"rank {rank}: done" in out, out
    assert "ERROR" not in out, out


@pytest.mark.mpi
def test_init_waits_for_a_rank_that_comes_within_the_limit():
    out = job_of_three("init_without_a_peer.py", "late", {"COORDINATOR_DEADLOCK_SECONDS": "20"},
                       ok=True)
    for rank in range(3):
        assert f"rank {rank}: sum 3" in out, out
