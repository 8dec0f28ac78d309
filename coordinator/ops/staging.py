"""CUDA tensors through the host backends, staged via pinned host memory.

Used where NCCL cannot run them: everywhere NCCL is unavailable, and for
Adasum, which has no NCCL version. An MPI library that is not CUDA-aware
(Debian's Open MPI 4.1.6, among others) crashes on a device pointer, so
device memory never reaches MPI here, whether or not the library says it is
CUDA-aware (mpi_ops.mpi_cuda_aware; it is logged): each operation copies
its tensors into pinned host memory on a stream of its own (after their
ready events), runs the host backends (MPI, Adasum) on those host arrays,
and copies the results back into device arrays (the `output=` arrays where
given), yielding while the copies run. Allreduce and broadcast work in
place in the pinned copy. Results of other operations come back from
pageable memory, whose copy makes the background thread wait for it.

The host backends it runs are instances of their own, on the device lanes'
communicators and fusion buffers: a set's device lane runs beside its host
lane, and neither may start collectives on the other's communicator in an
order that differs between ranks, nor share its buffers. They use the flat
MPI allreduce, not the host-aware algorithms.
"""

import numpy as np

from coordinator import gpu
from coordinator.wire import pb

_ALIGN = 64


class HostEntry:
    """What the host backends read of a staged entry."""

    __slots__ = ("name", "tensor", "output", "shape", "dtype_info")

    def __init__(self, name, tensor, output, shape, dtype_info):
        self.name = name
        self.tensor = tensor
        self.output = output
        self.shape = shape
        self.dtype_info = dtype_info


class StagedDeviceOps:
    name = "mpi-staged"

    def __init__(self, host_ops, staging, timeline=None):
        self.host_ops = host_ops  # an OperationManager over host backends of its own
        self.staging = staging  # HostStaging
        self.timeline = timeline

    def enabled(self, response):
        return response.device != -1

    def zeros(self, shape, dtype, device):
        return self.staging.zeros(shape, dtype, device)

    def add_process_set(self, process_set_id):
        self.host_ops.add_process_set(process_set_id)

    def remove_process_set(self, process_set_id):
        self.host_ops.remove_process_set(process_set_id)

    def revoke(self):
        self.host_ops.revoke()

    def allreduce(self, response, entries, names):
        return self._staged(response, entries, names, {}, in_place=True)

    def allgather(self, response, entries, names):
        return self._staged(response, entries, names, {})

    def broadcast(self, response, entries, names, root):
        return self._staged(response, entries, names, {"root": root}, in_place=True)

    def alltoall(self, response, entries, names):
        return self._staged(response, entries, names, {})

    def reducescatter(self, response, entries, names):
        return self._staged(response, entries, names, {})

    def p2p(self, response, entries, names, pair):
        return self._staged(response, entries, names, {"pair": pair})

    def _staged(self, response, entries, names, kwargs, in_place=False):
        host = pb.Response()
        host.CopyFrom(response)
        host.device = -1
        timeline = self.timeline if self.timeline is not None and self.timeline.enabled \
            else None
        if timeline:  # the copies wait for the tensors' ready events first
            timeline.activity_start(names, "MEMCPY_IN_HOST_BUFFER")
        arrays, copied = self.staging.to_host(response, entries)
        yield copied
        if timeline:
            timeline.activity_end(names)
        hosts = [HostEntry(e.name, a, a if in_place else None, e.shape, e.dtype_info)
                 for e, a in zip(entries, arrays)]
        results = yield from self.host_ops.run(host, hosts, names, **kwargs)
        if timeline:
            timeline.activity_start(names, "MEMCPY_OUT_HOST_BUFFER")
        outputs, copied = self.staging.to_device(response, entries, results)
        yield copied
        if timeline:
            timeline.activity_end(names)
        return outputs


class HostStaging:
    """Copies between device arrays and pinned host memory, on one
    non-blocking stream per device (it never waits for the framework's
    default stream), behind each tensor's ready event."""

    def __init__(self):
        self.cp = gpu.cupy()
        self._streams = {}  # device -> stream
        self._pinned = {}  # (process set id, device) -> pinned uint8 host array
        self._device = None  # this rank's GPU, once seen

    def _stream(self, device):
        stream = self._streams.get(device)
        if stream is None:
            with self.cp.cuda.Device(device):
                stream = self._streams[device] = self.cp.cuda.Stream(non_blocking=True)
        return stream

    def _pinned_buffer(self, key, nbytes):
        buf = self._pinned.get(key)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 4096)
            buf = self._pinned[key] = np.ndarray((size,), np.uint8,
                                                 buffer=self.cp.cuda.alloc_pinned_memory(size))
        return buf

    def zeros(self, shape, dtype, device):
        device = self._device if self._device is not None else device
        return gpu.zeros(shape, dtype, device, self._stream(device))

    def to_host(self, response, entries):
        """Host copies of the entries' tensors (None where an entry has none),
        and what to wait for. A lane runs one operation at a time, so its
        pinned buffer is free again when the next one starts."""
        device = self._device = gpu.home_device(response, entries, self._device)
        stream = self._stream(device)
        sizes = [e.tensor.nbytes if e is not None and e.tensor is not None else 0
                 for e in entries]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        cp = self.cp
        arrays = []
        with cp.cuda.Device(device):
            # (with the device current: cudaHostAlloc on the background
            # thread would otherwise open a context on GPU 0 for every rank)
            pinned = self._pinned_buffer((response.process_set_id, device), total)
            for event in gpu.ready_events(entries):
                stream.wait_event(event)
            for e, start, n in zip(entries, starts, sizes):
                if e is None or e.tensor is None:
                    arrays.append(None)
                    continue
                view = pinned[start:start + n]
                if n:
                    cp.cuda.runtime.memcpyAsync(view.ctypes.data, e.tensor.data.ptr, n,
                                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                arrays.append(view.view(e.dtype_info.dtype).reshape(e.shape))
            copied = gpu.DeviceWait(device, [gpu.record(stream)])
        return arrays, copied

    def to_device(self, response, entries, results):
        """Device arrays holding the host results (an alltoall's result is
        (output, received splits); a sender's is None), and what to wait for."""
        device = self._device
        stream = self._stream(device)
        cp = self.cp
        outputs, hosts, fence = [], [], gpu.Fence(stream, entries, late=True)
        with cp.cuda.Device(device), stream:
            for e, result in zip(entries, results):
                extra = None
                if isinstance(result, tuple):
                    result, extra = result
                if result is None:
                    outputs.append(None)
                    continue
                out = e.output if e is not None and e.output is not None else \
                    fence.empty(result.shape,
                                gpu.result_dtype(e, gpu.storage_dtype(result.dtype)))
                if result.nbytes:
                    host = np.ascontiguousarray(result)
                    hosts.append(host)  # read by the copy until it is done
                    cp.cuda.runtime.memcpyAsync(out.data.ptr, host.ctypes.data, host.nbytes,
                                                cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
                outputs.append(out if extra is None else (out, extra))
            done = gpu.DeviceWait(device, [gpu.record(stream)], keep=hosts)
        for e in entries:
            if e is not None:
                e.done_event = done
        return outputs, done
