"""A rank waiting in MPI_Init for ranks that never start MPI, or in
MPI_Finalize for a rank stopped for good, is ended, with a message naming
them, by a watcher process (coordinator/mpi_watch.py). Here without MPI: a
"rank" is a process with a launcher's environment, whose MPI call is a
sleep; tests/test_lifecycle_mpi.py runs real jobs."""

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import uuid

import pytest

from coordinator.mpi_watch import explain, mpi_finalize_watched, mpi_start_watched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A rank whose MPI_Init (or MPI_Finalize: argv[4]) takes argv[2]: "hang"
# (for good), "quick" (returns at once) or "dies" (the process ends inside it).
RANK = """
import os, sys, time
sys.path.insert(0, sys.argv[3])
from coordinator import mpi_watch
watched = getattr(mpi_watch, f"mpi_{sys.argv[4]}_watched")
with watched(float(sys.argv[1])) as watcher:
    print("watcher", watcher.pid, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
    elif sys.argv[2] == "dies":
        os._exit(3)
print("returned", watcher.returncode, flush=True)
"""


def job_env(namespace, rank, size, local_size):
    env = dict(os.environ)
    env.update({"PMIX_NAMESPACE": namespace, "OMPI_COMM_WORLD_RANK": str(rank),
                "OMPI_COMM_WORLD_SIZE": str(size),
                "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size)})
    return env


def start_rank(namespace, rank, size, limit, body, local_size=None, call="start"):
    return subprocess.Popen([sys.executable, "-c", RANK, str(limit), body, ROOT, call],
                            env=job_env(namespace, rank, size, local_size or size),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_idle(namespace, rank, size):
    """A rank of the job that has not called init()."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env=job_env(namespace, rank, size, size))


@contextlib.contextmanager
def ended(*procs):
    """Kills and reaps the peers `procs` once the body is done."""
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def wait_for_watcher(proc):
    line = proc.stdout.readline()
    assert line.startswith("watcher "), line
    return int(line.split()[1])


def test_the_watcher_ends_a_rank_stuck_in_mpi_init_naming_the_late_ranks():
    ns = f"test-{uuid.uuid4()}"
    stopped, idle = start_idle(ns, 1, 5), start_idle(ns, 2, 5)
    os.kill(stopped.pid, signal.SIGSTOP)
    waiting = start_rank(ns, 3, 5, 600, "hang", local_size=4)
    with ended(stopped, idle, waiting):
        wait_for_watcher(waiting)
        rank = start_rank(ns, 0, 5, 1, "hang", local_size=4)
        wait_for_watcher(rank)
        _, err = rank.communicate(timeout=120)
        # SIGTERM: a rank in MPI_Init runs no Python, so no exception to see.
        assert rank.returncode == -signal.SIGTERM, err
        assert re.match(r"\[0\] ERROR coordinator: init\(\) has waited \d+ s in MPI_Init "
                        r"for the other ranks of the job to start MPI "
                        r"\(HOROVOD_START_TIMEOUT=1\): ", err), err
        assert (f"rank 1 (pid {stopped.pid}) is stopped (SIGSTOP, or a debugger holds it); "
                f"rank 2 (pid {idle.pid}) is running but has not called init(); "
                "rank 4 runs on other hosts, which this host cannot see.") in err, err
        assert "rank 3" not in err  # in MPI_Init, under its own watcher
        assert f"this rank (pid {rank.pid}) is ended" in err
        # Rank 3's watcher, told by rank 0's, ends its rank too, saying why
        # (its own limit is 600 s).
        _, err = waiting.communicate(timeout=120)
        assert waiting.returncode == -signal.SIGTERM, err
        assert re.match(r"\[3\] ERROR coordinator: init\(\) has waited \d+ s in MPI_Init "
                        r"for the other ranks of the job to start MPI "
                        r"\(HOROVOD_START_TIMEOUT=600\): rank 1 ", err), err


def test_in_mpi_finalize_a_rank_stopped_for_the_silent_limit_is_named():
    ns = f"test-{uuid.uuid4()}"
    stopped, idle = start_idle(ns, 1, 3), start_idle(ns, 2, 3)
    os.kill(stopped.pid, signal.SIGSTOP)
    with ended(stopped, idle):
        rank = start_rank(ns, 0, 3, 1, "hang", call="finalize")
        wait_for_watcher(rank)
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == -signal.SIGTERM, err
        # Rank 2, running (say, still training), is waited for.
        assert re.match(r"\[0\] ERROR coordinator: MPI_Finalize waits for every rank of the "
                        rf"job, and rank 1 \(pid {stopped.pid}\) has been stopped \(SIGSTOP, "
                        r"or a debugger holds it\) for \d+ s "
                        r"\(COORDINATOR_SILENT_RANK_SECONDS=1\)\. MPI_Finalize cannot be "
                        rf"interrupted, so this rank \(pid {rank.pid}\) is ended", err), err
        assert "rank 2" not in err


def test_in_mpi_finalize_a_running_rank_of_this_host_is_waited_for():
    """Rank 2 did not confirm the shutdown, and runs (say, still training):
    waited for, as a slow rank, well past the limit."""
    ns = f"test-{uuid.uuid4()}"
    with ended(start_idle(ns, 1, 3), start_idle(ns, 2, 3)):
        rank = start_rank(ns, 0, 3, 1, "hang", call="finalize")
        with ended(rank):
            wait_for_watcher(rank)
            with pytest.raises(subprocess.TimeoutExpired):
                rank.communicate(timeout=4)  # four times its limit


def test_in_mpi_finalize_a_rank_on_another_host_gets_the_silent_limit():
    """Rank 2 did not confirm the shutdown and runs on another host, where
    nothing can be seen of it: the wait itself gets the limit."""
    ns = f"test-{uuid.uuid4()}"
    with ended(start_idle(ns, 1, 3)):
        rank = start_rank(ns, 0, 3, 1, "hang", call="finalize", local_size=2)
        wait_for_watcher(rank)
        _, err = rank.communicate(timeout=120)
        assert rank.returncode == -signal.SIGTERM, err
        assert re.match(r"\[0\] ERROR coordinator: MPI_Finalize waits for every rank of the "
                        r"job, and this rank has waited there \d+ s after a shutdown that not "
                        r"every rank confirmed, for a rank stopped or whose coordinator thread "
                        r"cannot run: rank 2 runs on other hosts, which this host cannot see "
                        r"\(COORDINATOR_SILENT_RANK_SECONDS=1\)\. MPI_Finalize cannot be "
                        rf"interrupted, so this rank \(pid {rank.pid}\) is ended", err), err
        assert "rank 1" not in err


# A rank whose MPI_Finalize another finalizer runs later (mpi4py's, at the
# interpreter's end, where the program started MPI): the watcher started by
# watch_finalize_until_exit(argv[1]) watches until the process ends; argv[2]
# "hang": that finalize waits for good, "quick": the process ends at once.
UNTIL_EXIT = """
import sys, time
sys.path.insert(0, sys.argv[3])
from coordinator import mpi_watch
watcher = mpi_watch.watch_finalize_until_exit(float(sys.argv[1]))
print("watcher", watcher.pid, flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
"""


@pytest.mark.parametrize("body", ["hang", "quick"])
def test_a_watcher_until_exit_ends_a_rank_held_by_a_stopped_one_or_goes_with_it(body):
    ns = f"test-{uuid.uuid4()}"
    stopped = start_idle(ns, 1, 2)
    os.kill(stopped.pid, signal.SIGSTOP)
    with ended(stopped):
        rank = subprocess.Popen([sys.executable, "-c", UNTIL_EXIT, "1", body, ROOT],
                                env=job_env(ns, 0, 2, 2), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wait_for_watcher(rank)
        # (the watcher holds the same stdout and stderr: they close once it
        # has gone too)
        _, err = rank.communicate(timeout=120)
    if body == "quick":
        assert rank.returncode == 0 and err == "", err
        return
    assert rank.returncode == -signal.SIGTERM, err
    assert re.match(r"\[0\] ERROR coordinator: MPI_Finalize waits for every rank of the job, "
                    rf"and rank 1 \(pid {stopped.pid}\) has been stopped", err), err


def test_the_watcher_goes_once_mpi_init_returns_and_says_nothing():
    rank = start_rank(f"test-{uuid.uuid4()}", 0, 2, 600, "quick")
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == 0, err
    assert "returned 0" in out and err == ""


def test_the_watcher_goes_quietly_with_a_rank_that_dies_in_mpi_init():
    rank = start_rank(f"test-{uuid.uuid4()}", 0, 2, 600, "dies")
    # The watcher holds the same stdout and stderr: they close once it has
    # gone too.
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == 3 and out.startswith("watcher ") and err == "", (out, err)


@pytest.mark.parametrize("limit,environ", [
    (0, {"OMPI_COMM_WORLD_SIZE": "4"}),  # HOROVOD_START_TIMEOUT=0: wait for good
    (30, {"OMPI_COMM_WORLD_SIZE": "1"}),  # alone: MPI_Init waits for nobody
    (30, {}),  # not started by a launcher (a singleton)
])
def test_no_watcher_where_mpi_init_waits_for_nobody_or_it_is_off(limit, environ):
    with mpi_start_watched(limit, environ) as watcher:
        assert watcher is None
    # COORDINATOR_SILENT_RANK_SECONDS=0: MPI_Finalize waits for good.
    with mpi_finalize_watched(limit, environ) as watcher:
        assert watcher is None


def test_a_watcher_that_cannot_start_is_a_warning_not_a_failed_init(monkeypatch):
    def no_processes(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_processes)
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("coordinator").addHandler(handler)
    before = len(os.listdir("/proc/self/fd"))
    try:
        with mpi_start_watched(30, {"OMPI_COMM_WORLD_SIZE": "2"}) as watcher:
            assert watcher is None
    finally:
        logging.getLogger("coordinator").removeHandler(handler)
    assert len(said) == 1 and said[0].startswith(
        "no watcher for MPI_Init ([Errno 11] Resource temporarily unavailable)"), said
    assert len(os.listdir("/proc/self/fd")) == before  # the pipe is closed


@pytest.mark.parametrize("found,size,local,expected", [
    ({0: (10, "S", True), 1: (11, "S", True)}, 2, "2",
     "every rank of this host is in MPI_Init"),
    ({0: (10, "S", True)}, 2, "1",
     "every rank this host runs is in MPI_Init; the late one is among the others: "
     "rank 1 runs on other hosts, which this host cannot see"),
    ({0: (10, "S", True), 2: (12, "R", True)}, 4, "2",
     "every rank this host runs is in MPI_Init; the late one is among the others: "
     "ranks 1, 3 run on other hosts, which this host cannot see"),
    # Fewer ranks here than the launcher put here: some may have exited.
    ({0: (10, "S", True), 1: (11, "Z", False)}, 3, "3",
     "rank 1 (pid 11) has exited; rank 2: not seen on this host (on another host, "
     "or exited)"),
    ({0: (10, "S", True), 1: (11, "t", False), 2: (12, "T", False)}, 3, "",
     "rank 1 (pid 11) is stopped (SIGSTOP, or a debugger holds it); "
     "rank 2 (pid 12) is stopped (SIGSTOP, or a debugger holds it)"),
])
def test_the_message_says_what_this_host_can_tell(found, size, local, expected):
    environ = {"OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_LOCAL_SIZE": local}
    assert explain(environ, found) == expected
