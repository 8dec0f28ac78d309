"""A GPU simulated in time only, to study scheduling without a GPU.

Built on tests/gpu_fakes.py: streams keep a clock (`_Stream.busy_until`),
and work queued on a stream starts once the stream is free. Unlike the
plain fakes, nothing moves here: NCCL calls and the device-fusion kernels
only spend their stream's time (NCCL: latency + bytes / bandwidth, 4.5 ms
and 1.8 GB/s by default, as over sockets on the GPU machine; a kernel 5 us
+ bytes read and written / 2 TB/s), so the host does what it does with a
real GPU (queue work and return) while the device's timing is modelled.
Results are garbage; timings are the point.

A rank's NCCL call here completes on its own clock, not when the last rank
joins: the ranks negotiate each operation together, so they queue it
within microseconds of each other.

What it leaves out: what CUDA's and CuPy's calls cost the host and how they
hand the interpreter lock between threads (the fake's calls are Python that
keeps it), and the GPU shared by the ranks' processes. On 2026-11-27 the
H100 contradicted it: the background thread sleeping between looks at GPU
work made its simulated ResNet-50 step 0.98x a DDP-style one and the real
step 1.5x DDP's. Decide nothing about the host's threads from it alone.
"""

import time
import types

import numpy as np

import gpu_fakes

NCCL_LATENCY = 4.5e-3
NCCL_BANDWIDTH = 1.8e9
KERNEL_LAUNCH = 5e-6
MEMORY_BANDWIDTH = 2e12


def current_stream():
    return gpu_fakes._Stream.current_stream()


class SimNccl(gpu_fakes.FakeNccl):
    """NCCL calls that only spend their stream's time."""

    def __init__(self, size, rank, latency=NCCL_LATENCY, bandwidth=NCCL_BANDWIDTH):
        super().__init__(types.SimpleNamespace(size=size, rank=rank), latency, bandwidth)

    def NcclCommunicator(self, size, uid, rank):
        return _SimComm(self)

    def groupEnd(self):
        self.group = None


class _SimComm:
    def __init__(self, nccl):
        self.nccl = nccl

    def allReduce(self, send, recv, count, dtype, op, stream):
        self.nccl.called("allReduce", count, dtype, stream)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.nccl.called("broadcast", count, dtype, stream)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        self.nccl.called("reduceScatter", count, dtype, stream)

    def allGather(self, send, recv, count, dtype, stream):
        self.nccl.called("allGather", count, dtype, stream)

    def send(self, ptr, count, dtype, peer, stream):
        self.nccl.called("send", count, dtype, stream)

    def recv(self, ptr, count, dtype, peer, stream):
        self.nccl.called("recv", count, dtype, stream)

    def check_async_error(self):
        pass

    def destroy(self):
        pass

    def abort(self):
        pass


class SimKernels:
    """The pack and unpack kernels: each launch spends its stream's time."""

    launches = 0

    def function(self, name):
        def launch(grid, block, args):
            _table, _n, buf, total, *_ = args
            SimKernels.launches += 1
            nbytes = 2 * int(total) * buf.dtype.itemsize
            current_stream().spend(KERNEL_LAUNCH + nbytes / MEMORY_BANDWIDTH)
        return launch


def sim_cupy(size, rank, **nccl_timing):
    """(fake CuPy module, its SimNccl) for one rank of `size`."""
    nccl = SimNccl(size, rank, **nccl_timing)
    return gpu_fakes.fake_cupy(nccl, SimKernels()), nccl


def compute(seconds):
    """Queues `seconds` of work on the current stream (a layer's kernels)."""
    current_stream().spend(seconds)


def wait_device():
    """Blocks until every stream's queued work would be done (like
    torch.cuda.synchronize)."""
    time.sleep(max(0.0, max_busy() - time.perf_counter()))


def max_busy():
    return max(s.busy_until for s in gpu_fakes._Stream.made)


def complete_early(on):
    """Switches HOROVOD_ENABLE_ASYNC_COMPLETION on the running coordinator:
    GPU handles complete once their work is queued (on) or once it has run."""
    import dataclasses

    from coordinator import runtime

    rt = runtime.current()
    if rt is not None:
        background = rt.background
        background.config = dataclasses.replace(background.config, async_completion=on)


def device_array(shape, dtype=np.float32):
    """A "device" array: host memory the simulation never touches, so the
    kernel gives it no page, and large tensors cost nothing to make."""
    return gpu_fakes.FakeDeviceArray(np.empty(shape, dtype))
