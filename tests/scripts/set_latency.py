"""Median latency of a small blocking allreduce in process set [0, 1] at
np=3, rank 2 idle (waiting on plain MPI): host arrays, "CUDA" arrays
through the fake NCCL (tests/gpu_fakes.py), host arrays again; then "CUDA"
arrays on the global set. Another set's GPU operations wait for a round of
every rank (negotiation.answered_in_rounds), its host ones do not.

Usage, from the checkout: mpirun -n 3 python tests/scripts/set_latency.py N"""
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import gpu_fakes  # noqa: E402
import coordinator as hvd  # noqa: E402
from coordinator import gpu  # noqa: E402

gpu._modules["cupy"] = gpu_fakes.fake_cupy(
    gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup()),
    gpu_fakes.HostKernels(tempfile.mkdtemp(prefix=f"hk-{MPI.COMM_WORLD.rank}-")))
N = int(sys.argv[1])
pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
me = hvd.rank()
out = {}
for label, ps, device in (("set-host", pair, False), ("set-gpu", pair, True), ("set-host2", pair, False),
                          ("global-gpu", hvd.global_process_set, True)):
    if me < 2 or ps is hvd.global_process_set:
        times = []
        for i in range(N):
            x = np.full(4, me, np.float32)
            x = gpu_fakes.FakeDeviceArray.of(x) if device else x
            t = time.perf_counter()
            hvd.allreduce(x, op=hvd.Sum, name=f"{label}.{i % 8}", process_set=ps)
            times.append(time.perf_counter() - t)
        out[label] = np.median(times[N // 5:]) * 1e6
    MPI.COMM_WORLD.Barrier()
if me == 0:
    print(" ".join(f"{k}={v:.0f}us" for k, v in out.items()), flush=True)
