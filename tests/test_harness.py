"""The test harness launches a job once more only when Open MPI's launcher
failed before any rank ran; a job that failed on its own is never rerun."""

import os
import subprocess

from coordinator import run

import mpi_harness


class FakeRun:
    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.calls = 0

    def __call__(self, cmd, **kwargs):
        self.calls += 1
        rc, err = self.outcomes.pop(0)
        return subprocess.CompletedProcess(cmd, rc, stdout="", stderr=err)


LISTENER = ("--------\nThe PMIx server's listener thread failed to start. We cannot\n"
            "continue.\n--------\n")


def test_a_launcher_that_failed_to_start_is_tried_once_more(monkeypatch):
    fake = FakeRun([(213, LISTENER), (0, "")])
    monkeypatch.setattr(mpi_harness.subprocess, "run", fake)
    proc = mpi_harness.mpirun(["x.py"])
    assert (proc.returncode, fake.calls) == (0, 2)


def test_a_launcher_that_fails_twice_reports_the_second_failure(monkeypatch):
    fake = FakeRun([(213, LISTENER), (213, LISTENER + "again")])
    monkeypatch.setattr(mpi_harness.subprocess, "run", fake)
    proc = mpi_harness.mpirun(["x.py"])
    assert (proc.returncode, fake.calls) == (213, 2)
    assert proc.stderr.endswith("again")


def test_a_job_that_failed_by_itself_runs_once(monkeypatch):
    fake = FakeRun([(1, "Traceback ...\nValueError: bad\n"), (0, "")])
    monkeypatch.setattr(mpi_harness.subprocess, "run", fake)
    proc = mpi_harness.mpirun(["x.py"])
    assert (proc.returncode, fake.calls) == (1, 1)


def test_each_launch_keeps_its_session_in_a_directory_removed_after_it(monkeypatch):
    seen = []

    def fake(cmd, env=None, **kwargs):
        base = env[run.SESSION_BASE]
        seen.append((base, os.path.isdir(base)))
        return subprocess.CompletedProcess(cmd, 213 if len(seen) == 1 else 0, stdout="",
                                           stderr=LISTENER)

    monkeypatch.setattr(mpi_harness.subprocess, "run", fake)
    for name in run.SESSION_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert mpi_harness.mpirun(["x.py"]).returncode == 0
    assert len(seen) == 2 and seen[0][0] != seen[1][0]  # a fresh one for the second try
    assert all(existed and not os.path.exists(base) for base, existed in seen)
