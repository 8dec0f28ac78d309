"""A rank that dies ends the job within seconds, naming the rank; no survivor
hangs or finishes normally."""

import time

import pytest

from mpi_harness import mpirun


@pytest.mark.mpi
@pytest.mark.parametrize("np_,victim", [(2, 1), (3, 2), (3, 0)])
def test_killed_rank_makes_every_survivor_raise_naming_it(np_, victim):
    start = time.monotonic()
    proc = mpirun(["tests/scripts/rank_dies.py", "kill", str(victim)], np_=np_, timeout=90)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 30, elapsed
    assert "FINISHED AS IF NOTHING HAPPENED" not in out
    assert f"rank {victim} (pid" in out and "exited while the job was running" in out, out
    survivors = [r for r in range(np_) if r != victim]
    for r in survivors:
        assert f"coordinator: rank {r} exiting" in out or "RankFailedError" in out, out


@pytest.mark.mpi
def test_rank_with_uncaught_exception_ends_the_job_and_says_why():
    start = time.monotonic()
    proc = mpirun(["tests/scripts/rank_dies.py", "raise", "1"], np_=3, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert "ZeroDivisionError" in out
    assert "rank 1 is exiting after an uncaught ZeroDivisionError" in out, out
    assert "FINISHED AS IF NOTHING HAPPENED" not in out
