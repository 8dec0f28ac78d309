"""init() when a rank of the job never starts MPI (run by
tests/test_lifecycle_mpi.py, with HOROVOD_START_TIMEOUT short). MPI starts
in init(); MPI_Init returns only once every rank has called it, and cannot
be interrupted.

argv[1]:
  stopped  the last rank stops itself (SIGSTOP) before init();
  idle     the last rank sleeps instead of calling init();
  late     the last rank calls init() once the others wait in MPI_Init.
Each rank prints what init() did."""

import os
import signal
import sys
import time

from coordinator.mpi_watch import _is_watcher, _stat, census

mode = sys.argv[1]
rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
last = rank == size - 1


def others_in_mpi_init():
    found = census(os.environ["PMIX_NAMESPACE"])
    return all(r in found and found[r][2] for r in range(size - 1))


def watchers_left():
    """This process's children that are watchers."""
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and _is_watcher(e) and (_stat(e) or ("?", 0))[1] == os.getpid()]


if last and mode == "stopped":
    os.kill(os.getpid(), signal.SIGSTOP)
elif last and mode == "idle":
    time.sleep(600)
elif last and mode == "late":
    while not others_in_mpi_init():
        time.sleep(0.05)

import coordinator as hvd  # noqa: E402
import numpy as np  # noqa: E402

hvd.init()
print(f"rank {rank}: init ok, sum {hvd.allreduce(np.ones(1), op=hvd.Sum)[0]:.0f}, "
      f"watchers left {watchers_left()}", flush=True)
