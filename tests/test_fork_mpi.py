"""Processes forked from a rank after init() (a DataLoader's workers, an
os.fork): they keep rank() and size(), as in Horovod, and their collectives
raise at once, naming the fork, instead of waiting for good for a
background thread that does not run there or using the parent's MPI
connections; one that exits normally neither finalizes the parent's MPI
nor stops its coordinator (tests/scripts/forked_after_init.py)."""

import os
import re

import pytest

from mpi_harness import mpirun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "forked_after_init.py")
FORK = (r"this process \(pid \d+\) is a fork of rank {rank}'s process \(pid \d+\), made "
        r"after init\(\) \(a DataLoader worker, say\); the coordinator and MPI run in that "
        r"process alone, so this one cannot take part in collectives")


def run(mode):
    proc = mpirun([SCRIPT, mode], np_=2, env={"TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def raised(out, call, what, rank):
    pattern = (rf"{call} raised NotInitializedError: {re.escape(what)}: "
               + FORK.format(rank=rank))
    assert re.search(pattern, out), f"{pattern!r} not in:\n{out}"


@pytest.mark.mpi
def test_an_os_fork_after_init_refuses_collectives_and_exits_normally():
    out = run("core")
    for rank in (0, 1):
        assert f"child of {rank}: rank {rank} size 2" in out, out
        raised(out, "allreduce", "allreduce of tensor 'c'", rank)
        raised(out, "barrier", "barrier", rank)
        raised(out, "join", "join", rank)
        raised(out, "broadcast_object", "broadcast_object 'broadcast_object'", rank)
        raised(out, "init", "init()", rank)
        # Its own exit status, through its atexit handlers (no MPI_Finalize
        # of its parent's MPI, no shutdown of its parent's coordinator).
        assert f"rank {rank}: child exit status 3, sum after 3" in out, out
    assert out.count("shutdown returned") == 2, out


@pytest.mark.mpi
def test_a_dataloader_worker_has_its_rank_and_its_allreduce_raises():
    out = run("torch")
    for rank in (0, 1):
        lines = re.findall(rf"worker of {rank} \(pid (\d+)\): rank {rank}", out)
        assert len(lines) == 4, out
        raised(out, "allreduce", "allreduce of tensor 'allreduce.w'", rank)
        assert f"rank {rank}: sum after 3" in out, out


@pytest.mark.mpi
def test_a_fork_of_a_chainermn_rank_leaves_its_parents_messages_alone():
    out = run("chainer")
    for rank in (0, 1):
        assert f"child of {rank}: rank {rank}" in out, out
        for call in ("allreduce_obj", "send_obj", "recv_obj", "allreduce", "send"):
            raised(out, call, call, rank)
        assert (f"rank {rank}: child exit status 0, got 'from {1 - rank}', sum after 3"
                in out), out
