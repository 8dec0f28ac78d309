"""Rank 0 raises (its own bug) while rank 1 waits in an MPI call of its own,
outside the coordinator (a raw barrier). Rank 0's MPI_Finalize at exit
waited for rank 1 for good, and rank 1 for rank 0: the job hung. Run with
COORDINATOR_EXIT_AFTER_ERROR_SECONDS set low."""

import time

from mpi4py import MPI

import coordinator as hvd

hvd.init()
hvd.allreduce([1.0], name="warm-up")
if hvd.rank() == 0:
    time.sleep(0.5)
    raise ValueError("a bug in rank 0's training")
MPI.COMM_WORLD.Barrier()
print("rank 1 passed the barrier", flush=True)
