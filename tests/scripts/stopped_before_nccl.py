"""Rank 1 is stopped (SIGSTOP) as it joins the NCCL communicator of the
job's first device operation, and continued by rank 0 once it has warned
that rank 1 has not answered (or RESUME seconds later at the latest: not
after a time alone, which a loaded machine could pass first): `before`
(after the device lanes' MPI communicator is made, before the unique id is
shared) or `inside` the join itself (the others have joined already and wait
there for it). On a machine without a GPU: the fake CuPy and NCCL of
tests/gpu_fakes.py, whose join, like NCCL's, returns only once every member
has joined. Run with HOROVOD_STALL_CHECK_TIME_SECONDS=2. The others wait for
rank 1 without blocking their background threads, so rank 0 names rank 1
and nobody names rank 0. Every rank prints `RANK r: done` once the
allreduce is through.

    mpirun -n 3 python tests/scripts/stopped_before_nccl.py before|inside [RESUME]
"""

import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import gpu  # noqa: E402
from coordinator.ops import mpi_ops  # noqa: E402

WHERE = sys.argv[1]
RESUME = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0

me = MPI.COMM_WORLD.rank
pids = MPI.COMM_WORLD.allgather(os.getpid())
scratch = tempfile.mkdtemp(prefix=f"host-kernels-{me}-")
nccl = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup())
gpu._modules["cupy"] = gpu_fakes.fake_cupy(nccl, gpu_fakes.HostKernels(scratch))


def stop():
    print(f"RANK {me}: stopping {WHERE} the join at {time.time():.3f}", flush=True)
    peers.stop_self(RESUME, settle=0.5)


if me == 0:
    peers.continue_on_warning(1, pids[1])
if me == 1 and WHERE == "before":
    share_on = mpi_ops.Communicators.share_on

    def stop_then_share(comm, payload, nbytes):
        mpi_ops.Communicators.share_on = staticmethod(share_on)  # once
        stop()
        return share_on(comm, payload, nbytes)

    mpi_ops.Communicators.share_on = staticmethod(stop_then_share)
elif me == 1 and WHERE == "inside":
    join = nccl.NcclCommunicator

    def stop_then_join(size, uid, rank):
        nccl.NcclCommunicator = join  # once
        stop()
        return join(size, uid, rank)

    nccl.NcclCommunicator = stop_then_join

hvd.init()
x = gpu_fakes.FakeDeviceArray.of(np.full(3, me + 1.0, np.float32))
out = hvd.allreduce(x, op=hvd.Sum, name="d")
assert out.get()[0] == sum(range(1, hvd.size() + 1)), out.get()
print(f"RANK {me}: done", flush=True)
