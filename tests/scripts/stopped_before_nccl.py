"""Rank 1 is stopped (SIGSTOP) just before it joins the NCCL communicator of
the job's first device operation (after the device lanes' MPI communicator is
made, before the unique id is shared), and continued RESUME seconds later.
On a machine without a GPU: the fake CuPy and NCCL of tests/gpu_fakes.py,
whose join, like NCCL's, returns only once every member has joined. Run
with HOROVOD_STALL_CHECK_TIME_SECONDS=2. The others wait for rank 1 before
they join, without blocking their background threads, so rank 0 names rank
1 and nobody names rank 0. Every rank prints `RANK r: done` once the
allreduce is through."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import gpu  # noqa: E402
from coordinator.ops import mpi_ops  # noqa: E402

RESUME = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0

me = MPI.COMM_WORLD.rank
scratch = tempfile.mkdtemp(prefix=f"host-kernels-{me}-")
gpu._modules["cupy"] = gpu_fakes.fake_cupy(gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup()),
                                           gpu_fakes.HostKernels(scratch))

if me == 1:
    share_on = mpi_ops.Communicators.share_on

    def stop_then_share(comm, payload, nbytes):
        mpi_ops.Communicators.share_on = staticmethod(share_on)  # once
        subprocess.Popen(["sh", "-c", f"sleep {RESUME}; kill -CONT {os.getpid()}"])
        print(f"RANK {me}: stopping at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.5)  # the stop can land a moment after kill() returns
        return share_on(comm, payload, nbytes)

    mpi_ops.Communicators.share_on = staticmethod(stop_then_share)

hvd.init()
x = gpu_fakes.FakeDeviceArray.of(np.full(3, me + 1.0, np.float32))
out = hvd.allreduce(x, op=hvd.Sum, name="d")
assert out.get()[0] == sum(range(1, hvd.size() + 1)), out.get()
print(f"RANK {me}: done", flush=True)
