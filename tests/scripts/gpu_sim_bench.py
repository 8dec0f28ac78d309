"""Bench (B) of issue 13 on a simulated GPU (tests/gpu_sim.py): ResNet-50's
161 gradients submitted async, then waited on, against one fused bare NCCL
call of the same bytes, alternating in one run.

    coordrun -np 2 python tests/scripts/gpu_sim_bench.py [--repeats 15]

The device is modelled in time only (NCCL over sockets: 4.5 ms + bytes /
1.8 GB/s; kernels 5 us + bytes / 2 TB/s); the host side is the real
coordinator, so what it measures is how the coordinator schedules device
work and what its own CPU time adds. On the GPU machine the same case
measured 1.08-1.17x (coordinator.bench --gpu, H100, 2026-11-26).
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_sim  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    from mpi4py import MPI

    from coordinator import gpu
    from coordinator.bench import resnet50_shapes

    world = MPI.COMM_WORLD
    cp, nccl = gpu_sim.sim_cupy(world.size, world.rank)
    gpu._modules["cupy"] = cp
    import coordinator as hvd

    hvd.init()
    grads = [gpu_sim.device_array(s) for s in resnet50_shapes()]
    outs = [gpu_sim.device_array(s) for s in resnet50_shapes()]
    total = sum(g.size for g in grads)
    stream = cp.cuda.Stream(non_blocking=True)

    def fused():
        """One pack kernel, one NCCL call, one unpack kernel, then wait."""
        with stream:
            gpu_sim.compute(gpu_sim.KERNEL_LAUNCH + 8 * total / gpu_sim.MEMORY_BANDWIDTH)
            nccl.called("allReduce", total, nccl.NCCL_FLOAT32)
            gpu_sim.compute(gpu_sim.KERNEL_LAUNCH + 8 * total / gpu_sim.MEMORY_BANDWIDTH)
        stream.synchronize()

    marks = {}

    def ours():
        handles = [hvd.allreduce_async(g, op=hvd.Sum, name=f"B.{i}", output=o)
                   for i, (g, o) in enumerate(zip(grads, outs))]
        marks["submitted"] = time.perf_counter()
        for h in handles:
            hvd.synchronize(h)
        marks["synchronized"] = time.perf_counter()
        gpu_sim.wait_device()

    def timed(fn):
        world.Barrier()
        gpu_sim.wait_device()
        start = marks["start"] = time.perf_counter()
        fn()
        return time.perf_counter() - start

    phases = []

    def phase_marks():
        """ms from the start: all submitted, first and last NCCL call queued,
        the device done, every handle synchronized."""
        queued = [t for t in nccl.call_times if t >= marks["start"]]
        start = marks["start"]
        return [(marks["submitted"] - start) * 1e3, (queued[0] - start) * 1e3,
                (queued[-1] - start) * 1e3, (gpu_sim.max_busy() - start) * 1e3,
                (marks["synchronized"] - start) * 1e3]

    calls = []
    for _ in range(2):  # warm-up: names cached, lane open
        timed(fused), timed(ours)
    t_bare, t_ours = [], []
    for _ in range(args.repeats):
        t_bare.append(timed(fused))
        before = len(nccl.calls)
        t_ours.append(timed(ours))
        calls.append(len(nccl.calls) - before)
        phases.append(phase_marks())
    both = np.array([t_bare, t_ours])
    world.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    if world.rank == 0:
        bare, mine = statistics.median(both[0]), statistics.median(both[1])
        print(f"(B) simulated, {world.size} ranks, 161 grads, {total * 4 / 2**20:.0f} MiB: "
              f"ours {mine * 1e3:.2f} ms, one fused bare call {bare * 1e3:.2f} ms, "
              f"ratio {mine / bare:.3f}; NCCL calls per run {sorted(calls)}")
        med = [statistics.median(p[i] for p in phases) for i in range(5)]
        print("rank 0, ms from the start (medians): all submitted {:.2f}, first NCCL call "
              "queued {:.2f}, last {:.2f}, device done {:.2f}, all synchronized "
              "{:.2f}".format(*med))
    hvd.shutdown()


if __name__ == "__main__":
    main()
