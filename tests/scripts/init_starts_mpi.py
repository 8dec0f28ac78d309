"""A program that tells mpi4py not to start MPI (as Horovod's own
test_process_sets_static.py does): init starts it, and it is finalized at
exit; init after shutdown works too. Prints "OK <rank>" at the end."""

import mpi4py

mpi4py.rc.initialize = False

import numpy as np  # noqa: E402

import coordinator as hvd  # noqa: E402
from mpi4py import MPI  # noqa: E402

assert not MPI.Is_initialized()
for attempt in range(2):
    hvd.init()
    assert MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
    out = hvd.allreduce(np.full(3, hvd.rank() + 1.0), op=hvd.Sum, name=f"x{attempt}")
    assert out.tolist() == [sum(range(1, hvd.size() + 1))] * 3, out
    hvd.shutdown()
assert not MPI.Is_finalized()  # (at exit)
print(f"OK {MPI.COMM_WORLD.rank}", flush=True)
