"""`python -m coordinator.bench --gpu` on the simulated GPU (tests/gpu_sim.py),
so that the GPU cases' own code (the bare NCCL references, the timing and
the breakdown of (B)) runs before it meets the GPU machine, whose time is
scarce. Figures from it are the model's, not a GPU's.

    coordrun -np 2 python tests/scripts/gpu_bench_on_sim.py [bench arguments]
"""

import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_fakes  # noqa: E402
import gpu_sim  # noqa: E402


def bench_cupy(size, rank):
    """The simulated CuPy, with what coordinator.bench's GPU cases call
    beyond what the core does."""
    cp, nccl = gpu_sim.sim_cupy(size, rank)

    class Device(gpu_fakes._DeviceContext):
        def use(self):
            pass

        def synchronize(self):
            gpu_sim.wait_device()

    def empty_like(a):
        return gpu_sim.device_array(a.shape, a.dtype)

    def concatenate(arrays, out=None):
        total = sum(a.size for a in arrays)
        gpu_sim.compute(gpu_sim.KERNEL_LAUNCH + 8 * total / gpu_sim.MEMORY_BANDWIDTH)
        return out if out is not None else gpu_sim.device_array((total,))

    def copyto(dst, src):
        gpu_sim.compute(gpu_sim.KERNEL_LAUNCH + 8 * dst.size / gpu_sim.MEMORY_BANDWIDTH)

    cp.cuda.Device = Device
    cp.cuda.runtime.getDeviceProperties = lambda device: {"name": b"simulated GPU"}
    cp.float32 = np.float32
    cp.ones = lambda shape, dtype=np.float32: gpu_sim.device_array(shape, dtype)
    cp.empty = lambda shape, dtype=np.float32: gpu_sim.device_array(shape, dtype)
    cp.empty_like, cp.concatenate, cp.copyto = empty_like, concatenate, copyto
    return cp, nccl


class _Equal:
    """(A) checks that both results agree; the simulation moves no data."""

    def all(self):
        return True


def main():
    from mpi4py import MPI

    from coordinator import bench, gpu

    world = MPI.COMM_WORLD
    cp, nccl = bench_cupy(world.size, world.rank)
    gpu_fakes.FakeDeviceArray.__eq__ = lambda self, other: _Equal()
    cuda = types.ModuleType("cupy.cuda")
    cuda.__dict__.update(vars(cp.cuda))
    module = types.ModuleType("cupy")
    module.__dict__.update(vars(cp))
    module.cuda = cuda
    sys.modules.update({"cupy": module, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})
    gpu._modules["cupy"] = module
    return bench.main(["--gpu"] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
