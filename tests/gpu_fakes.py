"""A stand-in for CuPy (and its NCCL module) whose "device" memory is host
memory, so the GPU path's host-side code runs on a machine without a GPU:
the core's recognition of CUDA arrays, the backend choice, the staging
backend, the NCCL backend's bookkeeping and the device-fusion kernels
(compiled for the host as C). Used by tests/test_gpu_fallback.py.

What it cannot show: anything about real CUDA or NCCL. Its streams keep
a queue, as a device's do: a copy, a kernel or an NCCL call runs at once
when nothing queued before it on its stream is still waiting, else once
that is done; FakeNccl runs each NCCL call as the matching non-blocking MPI
call on host memory, and the stream's later work waits for it. The queue
moves whenever an event of the stream is queried or the stream is
synchronized (the background thread polls its completion events), so an
NCCL call whose peers have not come leaves the caller free, as NCCL's
enqueue does: it used to wait in the call, and a rank stopped then (SIGSTOP)
held its peers' background threads there, unable to name it. A FakeNccl
given a latency and bandwidth makes its calls take time on their stream:
the stream's events fire only once the calls would have run (to study how
the background thread waits for a GPU: tests/gpu_sim.py and the scripts
that use it).
"""

import collections
import ctypes
import os
import struct
import subprocess
import tempfile
import threading
import time
import types

import numpy as np

from coordinator import dtypes
from coordinator.ops import device_fusion


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
    id = 0


class FakeDeviceArray:
    """A "CUDA" array: host memory behind `__cuda_array_interface__`, and no
    buffer protocol, so it cannot pass for a NumPy array anywhere."""

    device = _Device()

    def __init__(self, host):
        self._host = host
        self._ptr = None

    @property
    def data(self):
        # Cached: numpy's .ctypes costs microseconds, CuPy's .data.ptr does not.
        if self._ptr is None:
            self._ptr = self._host.ctypes.data
        return _Pointer(self._ptr)

    @classmethod
    def of(cls, values, dtype=None):
        return cls(np.ascontiguousarray(np.array(values, dtype=dtype)))

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    ndim = property(lambda self: self._host.ndim)
    flags = property(lambda self: self._host.flags)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.data.ptr, False), "strides": None}

    def view(self, dtype):
        return FakeDeviceArray(self._host.view(dtype))

    def reshape(self, *shape):
        return FakeDeviceArray(self._host.reshape(*shape))

    def __getitem__(self, key):
        return FakeDeviceArray(self._host[key])

    def __setitem__(self, key, value):
        self._host[key] = value._host if isinstance(value, FakeDeviceArray) else value

    def astype(self, dtype):
        return FakeDeviceArray(self._host.astype(dtype))

    def get(self):
        """A host copy (cupy.ndarray.get, after the work queued on the current
        stream, which may wait for other streams' events, has moved its data;
        the data moves without waiting for a timed stream's time)."""
        _Stream.current_stream().drain()
        return self._host.copy()

    # DLPack out, as CuPy's arrays export themselves. The "device" is host
    # memory, so the capsule says CPU: TensorFlow (CPU-only here) adopts it
    # as a CPU tensor, and needs it 64-byte aligned (real CuPy memory is
    # 256-byte aligned), so an unaligned array is exported from a copy.
    exported = 0  # capsules handed out, for the tests

    def __dlpack__(self, stream=None, **_):
        FakeDeviceArray.exported += 1
        host = self._host
        if host.size and host.ctypes.data % 64:
            host = aligned_copy(host)
        return host.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


def aligned_copy(array):
    raw = np.empty(array.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


class _Event:
    """cupy.cuda.Event's keywords only; a timing-disabled one cannot be
    timed (see _elapsed_ms)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.disable_timing = disable_timing
        self.stream = None
        self.time = None
        self.done_at = 0.0
        self._queue, self._position = None, 0  # its stream, and its place in the queue

    def record(self, stream=None):
        self.stream = stream
        self.time = time.perf_counter()
        # Fired once the work queued on the stream so far has run, and, where
        # the stream was made to spend time (a timed FakeNccl), once that time
        # has passed.
        stream = stream if stream is not None else _Stream.current_stream()
        self._queue, self._position = stream, stream.queued
        self.done_at = max(self.time, stream.busy_until)

    @property
    def moved(self):
        """Whether the work queued on its stream before it has run (its data
        has moved), whatever time a timed stream still has to spend."""
        return self._queue is None or self._queue.reached(self._position)

    @property
    def done(self):
        return self.moved and time.perf_counter() >= self.done_at


class _EventWait:
    """Queued work that waits for another stream's event (wait_event): for
    its data; the time it takes is the streams' clocks' affair (busy_until)."""

    def __init__(self, event):
        self.event = event

    def Test(self):
        return self.event.moved


class _Stream:
    # Each thread's stack of entered streams, as CuPy keeps one per thread:
    # the background thread inside a lane's stream never changes what a
    # training thread's get_current_stream() says.
    _local = threading.local()
    made = []  # every stream, for the simulation's wait for the whole device

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.ptr = id(self)
        self.non_blocking = non_blocking
        self.waited = []
        self.waited_on = []
        self.busy_until = 0.0  # when the work queued on it would be done
        self._work = collections.deque()  # work not started yet, in order
        self._waiting = None  # (what the started work waits for, then what)
        self.queued = 0  # work items queued so far, and run so far
        self.ran = 0
        self._advancing = False
        # As CuPy's: the device current when it was made; -1 for the null
        # stream, which any device may enter.
        self.device_id = -1 if null else _DeviceContext.current_id()
        _Stream.made.append(self)

    @staticmethod
    def entered():
        stack = getattr(_Stream._local, "stack", None)
        if stack is None:
            stack = _Stream._local.stack = []
        return stack

    @staticmethod
    def current_stream():
        return (_Stream.entered() or [_NULL])[-1]

    @staticmethod
    def of(ptr):
        """The stream whose pointer is `ptr`; None or 0: the current one."""
        if not ptr:
            return _Stream.current_stream()
        for stream in _Stream.made:
            if stream.ptr == ptr:
                return stream
        raise ValueError(f"no fake stream has pointer {ptr:#x}")

    # One lock for every stream: the training threads query events and the
    # background thread queues work, and one stream's work may wait for
    # another's event.
    _lock = threading.RLock()

    def submit(self, work):
        """Queues `work` (a function) behind what is queued on this stream:
        it runs now if nothing before it is still waiting. What it returns,
        if not None, is (something with Test(), a function or None): the
        stream's later work waits until Test() is true, then the function
        runs."""
        with _Stream._lock:
            self.queued += 1
            self._work.append(work)
            self.advance()

    def reached(self, position):
        """Whether the first `position` work items queued have run."""
        with _Stream._lock:
            self.advance()
            return self.ran >= position

    def advance(self):
        """Runs queued work until some waits (for an MPI request, or for
        another stream's event)."""
        with _Stream._lock:
            if self._advancing:
                return  # (a work item's own calls)
            self._advancing = True
            try:
                while True:
                    if self._waiting is not None:
                        pending, then = self._waiting
                        if not pending.Test():
                            return
                        self._waiting = None
                        if then is not None:
                            then()
                        self.ran += 1
                    if not self._work:
                        return
                    waits = self._work.popleft()()
                    if waits is None:
                        self.ran += 1
                    else:
                        self._waiting = waits
            finally:
                self._advancing = False

    def spend(self, seconds):
        """Queues `seconds` of work: it starts once the stream is free."""
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds

    def __enter__(self):
        # CuPy refuses a stream made on another device than the current one.
        current = _DeviceContext.current_id()
        if self.device_id >= 0 and self.device_id != current:
            raise RuntimeError(f"The device where the stream was created ({self.device_id}) "
                               f"is different from the current device ({current}).")
        _Stream.entered().append(self)
        return self

    def __exit__(self, *exc):
        _Stream.entered().pop()

    def wait_event(self, event):
        self.waited.append(event)
        self.waited_on.append(_DeviceContext.current_id())  # the current device then
        self.busy_until = max(self.busy_until, event.done_at)
        if getattr(event, "_queue", None) not in (None, self):
            self.submit(lambda: None if event.moved else (_EventWait(event), None))

    def drain(self):
        """Waits until the work queued so far has run."""
        while not self.reached(self.queued):
            time.sleep(0.0002)

    def synchronize(self):
        self.drain()
        time.sleep(max(0.0, self.busy_until - time.perf_counter()))


_NULL = _Stream(null=True)


class _DeviceContext:
    """cupy.cuda.Device: entered, it is the thread's current device (the one
    a stream handle of 0 means), as `current_id()` says."""

    active = threading.local()

    def __init__(self, device=None):
        self.id = 0 if device is None else device

    def __enter__(self):
        stack = _DeviceContext.active.__dict__.setdefault("stack", [])
        stack.append(self.id)
        return self

    def __exit__(self, *exc):
        _DeviceContext.active.stack.pop()

    @staticmethod
    def current_id():
        stack = _DeviceContext.active.__dict__.get("stack")
        return stack[-1] if stack else 0


def _elapsed_ms(start, end):
    """cupy.cuda.get_elapsed_time: raises, as cudaEventElapsedTime fails, for
    an event made with timing disabled, one never recorded, or one whose
    work is not done yet."""
    for event in (start, end):  # (a test's own stand-in may lack what it does not use)
        if getattr(event, "disable_timing", False):
            raise RuntimeError("cudaErrorInvalidResourceHandle: an event with timing "
                               "disabled cannot be timed")
        if getattr(event, "time", 0.0) is None or not event.done:
            raise RuntimeError("cudaErrorNotReady: the event has not completed")
    return (end.done_at - start.done_at) * 1e3


def _memcpy(dst, src, nbytes, kind, stream):
    def copy():
        ctypes.memmove(dst, src, nbytes)
    _Stream.of(stream).submit(copy)


def install_for_a_job(comm, latency=None):
    """Makes the coordinator see the fake CuPy, with a FakeNccl over a
    duplicate of `comm` (an mpi4py communicator of the job), for the probe
    scripts run under mpirun. `latency`: seconds each NCCL call keeps its
    stream busy (plus 1 GB/s), so operations stay in flight on the "device"
    after their calls and lanes overlap; None: calls finish as made."""
    import tempfile

    from coordinator import gpu

    gpu._modules["cupy"] = fake_cupy(
        FakeNccl(comm.Dup(), latency=latency, bandwidth=1e9 if latency else None),
        HostKernels(tempfile.mkdtemp(prefix=f"host-kernels-{comm.rank}-")))


def fake_cupy(nccl=None, kernels=None):
    """A module-like object standing for CuPy; `nccl` for cupy.cuda.nccl
    (None: CuPy without NCCL); `kernels` a HostKernels for RawKernel."""
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, memcpyAsync=_memcpy, memcpyHostToDevice=1,
        memcpyDeviceToHost=2, memcpyDeviceToDevice=3, memcpyDefault=4)
    cuda = types.SimpleNamespace(
        Device=_DeviceContext, Stream=_Stream, Event=_Event, runtime=runtime,
        get_current_stream=lambda device_id=-1: _Stream.current_stream(),
        get_elapsed_time=_elapsed_ms,
        alloc_pinned_memory=bytearray)
    if nccl is not None:
        cuda.nccl = nccl

    def empty(shape, dtype=np.float64):
        return FakeDeviceArray(np.empty(shape, dtype))

    def zeros(shape, dtype=np.float64):
        return FakeDeviceArray(np.zeros(shape, dtype))

    def asarray(obj):
        if isinstance(obj, FakeDeviceArray):
            return obj
        raise TypeError("the fake CuPy views only its own arrays")

    def from_dlpack(obj):
        """A "device" array over a DLPack producer's memory (no copy). The
        fake's device is the host, so it takes producers of CPU memory: a
        test that makes a frontend treat CPU tensors as GPU tensors sees
        them arrive here, as CUDA tensors would arrive at CuPy."""
        if not hasattr(obj, "__dlpack__"):
            raise TypeError("the fake CuPy takes DLPack producers only")
        imported.append(obj)
        return FakeDeviceArray(np.from_dlpack(obj))

    imported = []  # every producer from_dlpack took, for the tests

    def ascontiguousarray(arr):
        return FakeDeviceArray(np.ascontiguousarray(arr._host))

    def concatenate(arrays):
        return FakeDeviceArray(np.concatenate([a._host for a in arrays]))

    def raw_kernel(code, name):
        if kernels is None:
            raise RuntimeError("no host kernels given to the fake CuPy")
        return kernels.function(name)

    major = getattr(nccl, "cupy_major", 14)
    return types.SimpleNamespace(
        __version__=f"{major}.0.0+fake", ndarray=FakeDeviceArray, cuda=cuda, empty=empty,
        zeros=zeros, asarray=asarray, from_dlpack=from_dlpack, imported=imported,
        ascontiguousarray=ascontiguousarray, concatenate=concatenate, RawKernel=raw_kernel)


# ------------------------------------------------------- kernels on the host
_HOST_FLOAT16 = r"""
#include <string.h>
#define __device__
#define __forceinline__ static inline
#define __global__
typedef struct { unsigned int x; } dim3_t;
static const dim3_t blockIdx = {0}, blockDim = {1}, gridDim = {1}, threadIdx = {0};
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
typedef unsigned short bits16;
static inline float load_float16(bits16 h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline bits16 store_float16(float f) {
    _Float16 v = (_Float16)f; bits16 h; memcpy(&h, &v, 2); return h;
}
"""

KERNEL_PAIRS = [(k, k) for k in device_fusion._KINDS] + [("int16", "int32"),
                                                          ("uint16", "int32")]


class HostKernels:
    """Every pack/unpack kernel, compiled as C for the host (gcc, with
    _Float16 standing for the device's float16 conversions), run as one
    thread covering the whole grid-stride loop."""

    def __init__(self, directory):
        parts = [_HOST_FLOAT16, device_fusion._PRELUDE]
        for direction in ("pack", "unpack"):
            for tensor_kind, buffer_kind in KERNEL_PAIRS:
                _, source = device_fusion.kernel_source(direction, tensor_kind, buffer_kind)
                kernel = source[len(device_fusion._FLOAT16) + len(device_fusion._PRELUDE):]
                parts.append(kernel.replace('extern "C" ', ""))
        path = os.path.join(directory, "host_kernels.c")
        with open(path, "w") as f:
            f.write("\n".join(parts))
        lib = os.path.join(directory, "host_kernels.so")
        subprocess.run(["gcc", "-O1", "-std=gnu11", "-shared", "-fPIC", path, "-o", lib],
                       check=True, capture_output=True, text=True)
        self.lib = ctypes.CDLL(lib)

    def function(self, name):
        fn = getattr(self.lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                       ctypes.c_double, ctypes.c_double, ctypes.c_int]

        def launch(grid, block, args):
            table, n, buf, total, scale, divisor, scaled = args
            call = (table.data.ptr, int(n), buf.data.ptr, int(total), float(scale),
                    float(divisor), int(scaled))
            _Stream.current_stream().submit(lambda: fn(*call))
        return launch


# ------------------------------------------------------------------ NCCL
# bfloat16 (9) only moves here, as 16-bit words: MPI cannot reduce it.
_NCCL_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
                6: np.float16, 7: np.float32, 8: np.float64, 9: np.uint16}


def _host(ptr, count, dtype):
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype)


class FakeNccl:
    """cupy.cuda.nccl over MPI on host memory: each call runs as the matching
    non-blocking MPI call on `comm` (a communicator of its own, over every
    rank), queued on its stream (see the module doc); inside
    groupStart/groupEnd, all together at groupEnd, on the stream of the
    group's calls."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64 = 0, 1, 2, 3, 4
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
    available = True

    def __init__(self, comm, latency=None, bandwidth=None, cupy_major=14, unsigned_char=False):
        self.comm = comm
        # CuPy 14 hands the unique id over as bytes; CuPy 13 as a tuple of C
        # chars, signed on x86, unsigned on ARM (`unsigned_char`), and its
        # NcclCommunicator rejects bytes (TypeError) and values out of the
        # char's range (OverflowError), as Cython's conversions do.
        self.cupy_major = cupy_major
        self.unsigned_char = unsigned_char
        self.group = None
        self.calls = []  # (call, element count), for the tests
        self.call_times = []  # when each was queued (time.perf_counter())
        self._ids = 0
        # With a latency (s) and bandwidth (bytes/s), each call keeps its
        # stream busy for latency + bytes / bandwidth (see _Stream.spend), as
        # NCCL over sockets does; the data still moves at once.
        self.latency = latency
        self.bandwidth = bandwidth
        # Where the members of a communicator over some ranks meet (_meet):
        # a directory of this fake's own, made by rank 0 as every rank makes
        # the fake (after the comm.Dup() it is given). Named by the job's
        # PMIx namespace, which holds the launcher's pid, a later job whose
        # launcher got a pid of an earlier one (pid_max is 32768 here) read
        # that job's members and made a wrong communicator, and waited for
        # good (1 random_collectives job in about 100, no output at all).
        self._meeting = None
        if comm.size > 1 and hasattr(comm, "bcast"):  # (not a simulated one: gpu_sim)
            self._meeting = comm.bcast(
                tempfile.mkdtemp(prefix="fake-nccl-") if comm.rank == 0 else None)

    def called(self, name, count, dtype, stream=None):
        """Records a call; timed, it spends the time of the stream whose
        pointer is `stream` (by default the current stream)."""
        self.calls.append((name, count))
        self.call_times.append(time.perf_counter())
        if self.latency is not None:
            nbytes = count * np.dtype(_NCCL_DTYPES[dtype]).itemsize
            _Stream.of(stream).spend(self.latency + nbytes / self.bandwidth)

    def get_unique_id(self):
        """Unique per call and caller: the world rank and a count (with a
        byte above 127, as real ids have)."""
        self._ids += 1
        uid = struct.pack("<ii", self.comm.rank, self._ids) + bytes(119) + b"\xfe"
        if self.cupy_major >= 14:
            return uid
        return struct.unpack("128" + ("B" if self.unsigned_char else "b"), uid)

    def _id_in(self, uid):
        """The id a NcclCommunicator was given, as bytes, checked as CuPy
        checks it."""
        if self.cupy_major >= 14:
            if not isinstance(uid, bytes):
                raise TypeError(f"CuPy 14 takes the unique id as bytes, not {type(uid)}")
            return uid
        if not isinstance(uid, tuple):
            raise TypeError(f"CuPy 13 takes the unique id as a tuple, not {type(uid)}")
        low, high = (0, 255) if self.unsigned_char else (-128, 127)
        if not all(low <= c <= high for c in uid):
            raise OverflowError("value too large to convert to char")
        return bytes(c & 0xFF for c in uid)

    def get_version(self):
        return 22809

    def groupStart(self):
        self.group = []

    def groupEnd(self):
        calls, self.group = self.group, None
        if not calls:
            return
        streams = {stream for stream, _, _ in calls}
        assert len(streams) == 1, "the fake runs a group's calls on one stream"

        def run():
            started = [_begin(start, then) for _, start, then in calls]
            return _AllOf([request for request, _ in started]), \
                lambda: [finish() for _, finish in started]
        streams.pop().submit(run)

    def NcclCommunicator(self, size, uid, rank):
        """Over every rank, or over a group whose members share `uid` (only
        they take part: a process set's, or the host-aware allreduce's host
        and cross-host groups). Like NCCL's, it returns only once every
        member has made it (a barrier)."""
        assert len(uid) == 128
        uid = self._id_in(uid)
        if size == self.comm.size:
            assert rank == self.comm.rank
            self.comm.Barrier()
            return _FakeNcclComm(self, self.comm)
        founder, count = struct.unpack("<ii", bytes(uid[:8]))
        members = self._meet(f"{founder}.{count}", size, rank)
        group = self.comm.Get_group().Incl(members)
        comm = self.comm.Create_group(group, tag=(founder * 4096 + count) % 30000)
        group.Free()
        assert comm.size == size and comm.rank == rank, (comm.size, size, comm.rank, rank)
        return _FakeNcclComm(self, comm)

    def _meet(self, key, size, rank):
        """The world ranks of a communicator's members, by their rank in it:
        each leaves its world rank in a file of the job's (NCCL's members
        meet through the unique id alone, so no collective over the world
        may be used here), then waits for the others'."""
        directory = self._meeting
        mine = os.path.join(directory, f"{key}.{rank}")
        with open(mine + ".tmp", "w") as f:
            f.write(str(self.comm.rank))
        os.replace(mine + ".tmp", mine)
        deadline = time.monotonic() + 120
        while True:
            try:
                ranks = []
                for r in range(size):
                    with open(os.path.join(directory, f"{key}.{r}")) as f:
                        ranks.append(int(f.read()))
                return ranks
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake NCCL: members of communicator {key} never met")
                time.sleep(0.005)

    def run(self, stream, start, then=None):
        """Queues `start` (which starts an MPI request and returns it, or
        returns (request, what the request reads or writes)) on the stream
        whose pointer is `stream`; the stream's later work waits for the
        request, then `then` runs. What `start` returned is held until then:
        mpi4py 4.1.2 holds no reference to the buffers of Iallreduce,
        Ireduce_scatter(_block) or Iallgatherv. Inside a group: at groupEnd."""
        queue = _Stream.of(stream)
        if self.group is None:
            queue.submit(lambda: _begin(start, then))
        else:
            self.group.append((queue, start, then))


def _begin(start, then):
    """Starts an MPI request with `start`; returns (the request, what runs
    once it is done), which holds what `start` gave with the request."""
    started = start()
    request = _NcclCall(started[0] if isinstance(started, tuple) else started)

    def finish():
        nonlocal started
        started = None  # (held by this closure until the request is done)
        if then is not None:
            then()
    return request, finish


class _NcclCall:
    """A fake NCCL call's MPI request, tested as NCCL's call would be. A
    survivor that gives up on a stopped rank revokes the program's
    communicators (control_channel.Transport.release), the fake's among
    them; a real NCCL communicator is not MPI's, and stays as it was. So a
    call revoked under it waits on, as NCCL's would for the stopped peer:
    it failed at once with MPI_ERR_REVOKED, and a survivor whose own stall
    check had not fired yet raised that instead of the StallError (1 job in
    about 5 of test_faults' stopped-rank test at np=3 on the fake GPU)."""

    __slots__ = ("request", "revoked")

    def __init__(self, request):
        self.request = request
        self.revoked = False

    def Test(self):
        from mpi4py import MPI

        if self.revoked:
            return False
        try:
            return self.request.Test()
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_REVOKED:
                raise
            self.revoked = True
            return False


class _AllOf:
    def __init__(self, requests):
        self.requests = requests

    def Test(self):
        return all(request.Test() for request in self.requests)


class _FakeNcclComm:
    def __init__(self, nccl, comm):
        self.nccl = nccl
        self.comm = comm

    def _op(self, op):
        from mpi4py import MPI

        return {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}[op]

    def allReduce(self, send, recv, count, dtype, op, stream):
        from mpi4py import MPI

        self.nccl.called("allReduce", count, dtype, stream)
        if dtype == FakeNccl.NCCL_BFLOAT16:
            self._bfloat16_allreduce(send, recv, count, op, stream)
            return
        out = _host(recv, count, _NCCL_DTYPES[dtype])
        src = MPI.IN_PLACE if send == recv else _host(send, count, _NCCL_DTYPES[dtype])
        self.nccl.run(stream, lambda: self.comm.Iallreduce(src, out, self._op(op)))

    def _bfloat16_allreduce(self, send, recv, count, op, stream):
        """NCCL reduces bfloat16 itself; MPI cannot: reduce the values in
        float32 and round once (what NCCL gives for two ranks)."""
        bits = _host(recv, count, np.uint16)
        source = bits if send == recv else _host(send, count, np.uint16)
        total = np.empty(count, np.float32)

        def start():  # (reads the input when the stream reaches the call)
            wide = source.view(dtypes.BFLOAT16).astype(np.float32)
            return self.comm.Iallreduce(wide, total, self._op(op)), wide

        def narrow():
            bits[:] = total.astype(dtypes.BFLOAT16).view(np.uint16)
        self.nccl.run(stream, start, narrow)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.nccl.called("broadcast", count, dtype, stream)
        out = _host(recv, count, _NCCL_DTYPES[dtype])

        def start():
            if self.comm.rank == root and send != recv:
                out[:] = _host(send, count, _NCCL_DTYPES[dtype])
            return self.comm.Ibcast(out, root=root)
        self.nccl.run(stream, start)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        self.nccl.called("reduceScatter", count, dtype, stream)
        size = self.comm.size
        src = _host(send, count * size, _NCCL_DTYPES[dtype])
        out = _host(recv, count, _NCCL_DTYPES[dtype])
        in_place = recv == send + self.comm.rank * count * np.dtype(_NCCL_DTYPES[dtype]).itemsize
        if not in_place:
            assert recv >= send + src.nbytes or recv + out.nbytes <= send, "overlap"

        def start():  # NCCL's in place: MPI's buffers must not alias
            source = src.copy() if in_place else src
            return self.comm.Ireduce_scatter_block(source, out, self._op(op)), source
        self.nccl.run(stream, start)

    def allGather(self, send, recv, count, dtype, stream):
        from mpi4py import MPI

        self.nccl.called("allGather", count, dtype, stream)
        out = _host(recv, count * self.comm.size, _NCCL_DTYPES[dtype])
        in_place = send == recv + self.comm.rank * count * np.dtype(_NCCL_DTYPES[dtype]).itemsize
        src = MPI.IN_PLACE if in_place else _host(send, count, _NCCL_DTYPES[dtype])
        self.nccl.run(stream, lambda: self.comm.Iallgather(src, out))

    def send(self, ptr, count, dtype, peer, stream):
        self.nccl.called("send", count, dtype, stream)
        data = _host(ptr, count, _NCCL_DTYPES[dtype])
        self.nccl.run(stream, lambda: self.comm.Isend(data, peer, 5))

    def recv(self, ptr, count, dtype, peer, stream):
        self.nccl.called("recv", count, dtype, stream)
        data = _host(ptr, count, _NCCL_DTYPES[dtype])
        self.nccl.run(stream, lambda: self.comm.Irecv(data, peer, 5))

    def check_async_error(self):
        pass

    def destroy(self):
        pass

    def abort(self):
        self.nccl.calls.append(("abort", 0))


# ------------------------------------------------------------------- MPI
def host_buffer(spec):
    """The array of an mpi4py buffer argument ([array, type], [array, (counts,
    displacements), type], an array, or MPI.IN_PLACE); raises AssertionError
    if it is not host memory."""
    from mpi4py import MPI

    if spec is None or spec is MPI.IN_PLACE:
        return None
    array = spec[0] if isinstance(spec, (list, tuple)) else spec
    assert isinstance(array, (np.ndarray, bytearray)), \
        f"MPI was handed a {type(array).__name__}, not host memory"
    assert not hasattr(array, "__cuda_array_interface__"), "MPI was handed device memory"
    return array


class _Done:
    def Test(self):
        return True

    def Wait(self):
        pass


class SoloComm:
    """A one-rank stand-in for an mpi4py communicator that checks that every
    buffer it is handed is host memory (`calls` counts them)."""

    rank, size = 0, 1

    def __init__(self):
        self.calls = 0

    def _copy(self, send, recv):
        self.calls += 1
        dst = host_buffer(recv)
        src = host_buffer(send)
        if src is not None and dst is not None:
            n = min(np.asarray(src).nbytes, np.asarray(dst).nbytes)
            np.asarray(dst).reshape(-1).view(np.uint8)[:n] = \
                np.asarray(src).reshape(-1).view(np.uint8)[:n]
        return _Done()

    def Iallreduce(self, send, recv, op=None):
        return self._copy(send, recv)

    def Iallgatherv(self, send, recv):
        return self._copy(send, recv)

    def Ialltoallv(self, send, recv):
        return self._copy(send, recv)

    def Ireduce_scatter(self, send, recv, counts=None, op=None):
        return self._copy(send, recv)

    def Ireduce_scatter_block(self, send, recv, op=None):
        return self._copy(send, recv)

    def Ibcast(self, buf, root=0):
        return self._copy(None, buf)

    def Barrier(self):
        pass


class CheckedComm:
    """A real communicator whose non-blocking calls check that they are
    handed host memory only (`calls` counts them)."""

    def __init__(self, comm):
        self._comm = comm
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not (name.startswith("I") and callable(attr)):
            return attr

        def checked(*args, **kwargs):
            for arg in list(args) + list(kwargs.values()):
                first = arg[0] if isinstance(arg, (list, tuple)) and arg else arg
                assert not hasattr(first, "__cuda_array_interface__"), \
                    f"MPI {name} was handed device memory"
            self.calls += 1
            return attr(*args, **kwargs)
        return checked
