"""init() when a rank of the job never calls it (run by
tests/test_lifecycle_mpi.py, with COORDINATOR_DEADLOCK_SECONDS short).

argv[1]:
  leaves  the last rank starts MPI (mpi4py) and leaves without init();
  alone   every rank starts the coordinator, then the last one shuts it down
          and calls init() again while the others finish their program;
  late    the last rank calls init() a little late, within the limit.
Each rank prints what init() did; the ranks that called it must hear, in
bounded time, which rank did not (they waited for ever)."""

import sys
import time

from mpi4py import MPI

import coordinator as hvd

mode = sys.argv[1]
world = MPI.COMM_WORLD
last = world.rank == world.size - 1


def init_and_report():
    start = time.monotonic()
    try:
        hvd.init()
    except hvd.HorovodInternalError as exc:
        print(f"rank {world.rank}: init raised {type(exc).__name__} after "
              f"{time.monotonic() - start:.0f} s: {exc}", flush=True)
        return False
    print(f"rank {world.rank}: init ok, size {hvd.size()}", flush=True)
    return True


if mode == "leaves":
    if last:
        print(f"rank {world.rank}: leaving without init()", flush=True)
        sys.exit(0)
    init_and_report()
elif mode == "alone":
    hvd.init()
    hvd.barrier()
    if last:
        hvd.shutdown()
        init_and_report()
    else:
        print(f"rank {world.rank}: done", flush=True)
elif mode == "late":
    if last:
        time.sleep(2)
    if init_and_report():
        import numpy as np

        print(f"rank {world.rank}: sum {hvd.allreduce(np.ones(1), op=hvd.Sum)[0]:.0f}",
              flush=True)
