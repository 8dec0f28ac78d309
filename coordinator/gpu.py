"""CUDA arrays in the core: recognising them, viewing them with CuPy without
a copy, and the events that order the caller's stream with the
coordinator's.

The core takes CuPy arrays and any array that exposes
`__cuda_array_interface__` or DLPack on a CUDA device, and views them as
CuPy arrays over the same memory (`cupy.asarray`, `cupy.from_dlpack`).
CuPy 13 has no bfloat16 dtype: a bfloat16 tensor goes in as
`bfloat16(view)`, a 16-bit integer view of its memory, and results come
back as int16 arrays holding the bfloat16 bits. CuPy 14 has the dtype
(ml_dtypes'): an array of it goes in as it is, and its results are
bfloat16 arrays (result_dtype).

At submit, the core notes the caller's stream on the tensor's device (a
`ReadyPoint`): CuPy's current stream there, or the one a frontend names for
the call (`caller_stream`: torch's current stream, frontends/torch/
_tensors.py). The event that the backend's stream waits on is recorded on
that stream later, when the backend launches the collective, on the
background thread: a submission makes no CUDA call (see ReadyPoint for why
and what it costs). A backend hands back a `DeviceWait` for the work it
queued: the background thread polls it, and `synchronize` orders the
caller's stream after it.

Nothing here imports CuPy until a device array arrives (or a backend is
built on a machine that has CuPy), so CPU-only installs never need it.
"""

import collections
import importlib
import importlib.util
import math
import threading
import time
import types
import weakref

import numpy as np

from coordinator import dtypes

# DLPack device types whose memory is on a CUDA device.
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged

_modules = {"cupy": None}


def cupy_installed():
    return _modules["cupy"] is not None or importlib.util.find_spec("cupy") is not None


def cupy(what="a CUDA array"):
    """The CuPy module, imported on first use."""
    cp = _modules["cupy"]
    if cp is None:
        try:
            import cupy as cp
        except ImportError as exc:
            raise ValueError(f"{what}: CUDA arrays need CuPy, which is not installed here "
                             "(pip install cupy-cuda12x or cupy-cuda13x)") from exc
        _modules["cupy"] = cp
    return cp


def probe():
    """(True, description) when CUDA arrays can be handled here (CuPy and at
    least one device), else (False, why not). Imports CuPy only where it is
    installed."""
    if not cupy_installed():
        return False, "CuPy is not installed"
    try:
        cp = cupy()
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing, no device, ...
        return False, f"CuPy sees no CUDA device ({exc})"
    if count < 1:
        return False, "CuPy sees no CUDA device"
    return True, f"CuPy {cp.__version__}, {count} CUDA device(s)"


def nccl_module():
    """(cupy.cuda.nccl, "") when NCCL can be used through CuPy, else (None, why not)."""
    cp = cupy()
    try:
        nccl = getattr(cp.cuda, "nccl", None)
        if nccl is None and isinstance(cp, types.ModuleType):  # not imported yet
            nccl = importlib.import_module(cp.__name__ + ".cuda.nccl")
    except Exception as exc:  # CuPy raises ImportError when libnccl is missing
        return None, f"CuPy cannot load NCCL ({exc})"
    if nccl is None or not getattr(nccl, "available", False):
        return None, "CuPy was installed without NCCL (pip install nvidia-nccl-cu12 or -cu13)"
    return nccl, ""


def nccl_version():
    """NCCL's version code through CuPy (e.g. 22809 for 2.28.9), or 0."""
    if not cupy_installed():
        return 0
    try:
        nccl, _ = nccl_module()
        return int(nccl.get_version()) if nccl is not None else 0
    except Exception:
        return 0


# --------------------------------------------------------- device arrays
class BFloat16:
    """A CUDA array of bfloat16 values, given as a 16-bit integer view of its
    memory (CuPy has no bfloat16 dtype)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


bfloat16 = BFloat16


def _cuda_interface(obj):
    try:  # torch raises (not only AttributeError) for tensors it cannot describe
        return getattr(obj, "__cuda_array_interface__", None)
    except Exception:
        return None


def is_device_array(obj):
    """True for an array whose memory is on a CUDA device."""
    cp = _modules["cupy"]
    if cp is not None and isinstance(obj, cp.ndarray):  # the common case, cheaply
        return True
    if isinstance(obj, BFloat16) or _cuda_interface(obj) is not None:
        return True
    if getattr(type(obj), "__dlpack_device__", None) is None:
        return False
    try:
        return obj.__dlpack_device__()[0] in _DLPACK_CUDA
    except Exception:
        return False


def as_device_array(obj, what):
    """(CuPy array over obj's memory, DTypeInfo or None, device ordinal): no copy."""
    cp = cupy(what)
    bf16 = isinstance(obj, BFloat16)
    if bf16:
        obj = obj.array
    try:
        if isinstance(obj, cp.ndarray):
            arr = obj
        elif _cuda_interface(obj) is not None:
            arr = cp.asarray(obj)
        else:
            arr = cp.from_dlpack(obj)
    except Exception as exc:
        raise ValueError(f"{what}: CuPy cannot view this CUDA array ({exc}); a bfloat16 "
                         "tensor goes in as coordinator.gpu.bfloat16(<its int16 view>)") from exc
    if not bf16:
        return arr, dtypes.info_for(arr.dtype), arr.device.id
    if arr.dtype.itemsize != 2 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: bfloat16() takes a 16-bit integer view, not {arr.dtype}")
    bf16_dtype = dtypes.bfloat16()
    if bf16_dtype is None:
        raise ValueError(f"{what}: bfloat16 needs the ml_dtypes package")
    return arr.view(np.int16), dtypes.BY_DTYPE[bf16_dtype], arr.device.id


def contiguous(arr, device):
    """A C-contiguous copy, queued on the caller's stream."""
    cp = cupy()
    with cp.cuda.Device(device), current_stream(device):
        return cp.ascontiguousarray(arr)


def view(ptr, shape, dtype, device):
    """A CuPy array over `ptr`, device memory that someone else owns and
    keeps alive while the array is in use (a frontend's tensor): no copy,
    and, unlike cupy.from_dlpack, no call into the framework or CUDA."""
    cp = cupy()
    dtype = np.dtype(dtype)
    memory = cp.cuda.UnownedMemory(ptr, math.prod(shape) * dtype.itemsize, None, device)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))


def output_array(output, arr, device, what):
    """The CuPy view of `output`, checked against the tensor `arr`."""
    if not is_device_array(output):
        raise ValueError(f"{what}: output must be a CUDA array on device {device}, as the "
                         "tensor is")
    out, _, out_device = as_device_array(output, what)
    if out_device != device:
        raise ValueError(f"{what}: output is on device {out_device}; the tensor is on device "
                         f"{device}")
    if out.shape != arr.shape or out.dtype != arr.dtype:
        raise ValueError(f"{what}: output has shape {out.shape} and dtype {out.dtype}; the "
                         f"tensor has shape {arr.shape} and dtype {arr.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{what}: output must be C-contiguous (it is written in place)")
    return out


def storage_dtype(dtype):
    """The dtype a device array of `dtype` is held in (bfloat16: int16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.int16) if dtypes.is_bfloat16(dtype) else dtype


def result_dtype(entry, storage):
    """The dtype of a new device array for `entry`'s result: that of the
    array it was submitted as (its int16 view where a frontend gave
    bfloat16(view); bfloat16 itself where CuPy has the dtype, from v14 on,
    and the caller gave such an array), else `storage` (a joined rank's
    stand-in, a receiver)."""
    tensor = getattr(entry, "tensor", None)
    if tensor is not None and tensor.dtype.itemsize == storage.itemsize:
        return tensor.dtype
    return storage


def zeros(shape, dtype, device, stream):
    """Zeros on `device`, written on `stream`, which is waited for (a joined
    rank's stand-in: rare, and microseconds)."""
    cp = cupy()
    with cp.cuda.Device(device), stream:
        arr = cp.zeros(shape, storage_dtype(dtype))
    stream.synchronize()
    return arr


def home_device(response, entries, last):
    """The GPU this rank runs `response` on: where its own tensors live
    (entries it submitted carry a ready point; a joined rank's stand-ins do
    not), else `last` (the one it used before), else the response's ordinal
    (rank 0's) when this machine has it, else 0."""
    for e in entries:
        if e is not None and e.ready_point is not None:
            return e.device
    if last is not None:
        return last
    count = cupy().cuda.runtime.getDeviceCount()
    return response.device if 0 <= response.device < count else 0


# ------------------------------------------------------- streams and events
_caller = threading.local()

# CUDA's handle for the per-thread default stream (cudaStreamPerThread): it
# names a different stream on every thread, so only the caller can record
# on it.
_PER_THREAD_STREAM = 2


class caller_stream:
    """Within it, this thread's submissions and synchronizations on `device`
    take `stream` (a CuPy stream) as the caller's stream instead of CuPy's
    current one there. A frontend wraps its calls in it: it makes no CUDA
    call, where entering a CuPy stream and device would."""

    __slots__ = ("device", "stream", "saved")

    def __init__(self, device, stream):
        self.device = device
        self.stream = stream

    def __enter__(self):
        self.saved = getattr(_caller, "now", None)
        _caller.now = self
        return self.stream

    def __exit__(self, *exc_info):
        _caller.now = self.saved


def current_stream(device):
    """The caller's stream on `device`: the one `caller_stream` names, else
    CuPy's current stream there."""
    now = getattr(_caller, "now", None)
    if now is not None and now.device == device:
        return now.stream
    cp = cupy()
    with cp.cuda.Device(device):
        return cp.cuda.get_current_stream()


class ReadyPoint:
    """Where a submission's tensors on one device are ready: the point the
    caller's stream had reached when they were submitted.

    Its event is recorded on that stream when a backend first asks for it
    (`event()`), which is when it launches the collective, on the background
    thread. A stream runs its work in the order it was queued, and the
    tensors' producers were queued before the submission, so the event
    covers them; it also covers whatever the caller queued in between, so
    the collective may start later than its tensors were ready, never
    sooner. What that buys: the submitting thread makes no CUDA call. Each
    CUDA call through CuPy lets go of the interpreter lock, and taking it
    back from the busy background thread cost a gradient hook 150-250 us on
    the H100 (ResNet-50: 1.27x DDP's step with the event recorded in the
    hook, 1.01-1.03x recorded at launch, README "GPUs"). Except where the
    submission finds its lane idle (record_ready): its collective would
    launch after one negotiation cycle, behind whatever the caller queued
    meanwhile, so the event is recorded at once (in a training step, one
    CUDA call a step, for its first gradient).

    The per-thread default stream is the exception: it names another stream
    on the background thread, so there the event is recorded at once.

    Before a caller's stream is made to wait for an operation
    (`DeviceWait.order_current_stream`, with asynchronous completion), every
    ready point not recorded yet is recorded (`record_pending`): else one
    could cover that wait, and two ranks that synchronized two lanes'
    operations in opposite orders would each have one collective wait for
    the other's.

    `early`: the event was recorded before the collective launched (any of
    the above but a launch); then a backend that writes its results into
    memory it takes from CuPy's pool at launch waits for `fence_events`
    first. `waits`: how many waits for operations its stream had been given
    then (_stream_waits)."""

    __slots__ = ("device", "stream", "_event", "early", "waits", "__weakref__")

    def __init__(self, device, stream):
        self.device = device
        self.stream = stream
        self._event = None
        self.early = False
        self.waits = 0
        if stream.ptr == _PER_THREAD_STREAM:
            self.event()
        else:
            with _pending_lock:
                _pending.add(self)

    def event(self, launch=False):
        """The event, recorded on the caller's stream on first use (`launch`:
        by the collective launching)."""
        with _pending_lock:
            if self._event is None:
                cp = cupy()
                with cp.cuda.Device(self.device):
                    event = cp.cuda.Event(disable_timing=True)
                    event.record(self.stream)
                self._event = event
                self.early = not launch
                self.waits = _stream_waits.get((self.device, self.stream.ptr), 0)
                _pending.discard(self)
        return self._event


# Ready points whose events are not recorded yet (weakly: one whose entries
# never launch goes with them), and the lock that makes recording one happen
# once, whichever thread asks first. Under it too: how many waits for
# operations each caller's stream (by device and pointer: the legacy default
# stream is 0 on every device) was given by
# DeviceWait.order_current_stream (see fence_events).
_pending = weakref.WeakSet()
_pending_lock = threading.Lock()
_stream_waits = collections.Counter()


def record_pending():
    """Records the event of every ready point not recorded yet."""
    with _pending_lock:
        points = list(_pending)
    for point in points:
        point.event()


def record_ready(entries, idle=None):
    """Gives each entry on a device the ready point of the caller's stream
    there (one per device: a grouped submission shares it). No CUDA call
    (ReadyPoint), unless `idle(process_set_id, device)` says this
    submission would start the entry's lane's next operation
    (Background.lane_idle): then it launches after one negotiation cycle,
    and an event recorded at launch would also cover every kernel the
    caller queues meanwhile (a step's first gradient: the backward pass
    goes on), so it is recorded now."""
    points = {}
    for e in entries:
        if e.device < 0:
            continue
        point = points.get(e.device)
        if point is None:
            point = points[e.device] = ReadyPoint(e.device, current_stream(e.device))
            if idle is not None and idle(e.process_set_id, e.device):
                point.event()
        e.ready_point = point


def record(stream, timed=False):
    """A new event recorded on `stream` (the current device must be its device);
    `timed`: one that `cupy.cuda.get_elapsed_time` can measure from."""
    event = cupy().cuda.Event(disable_timing=not timed)
    event.record(stream)
    return event


class CallTimes:
    """How long a lane's operations run on its device, learned from those
    that ran: seconds = alpha + bytes / beta, fitted by least squares to the
    last WINDOW (alpha and beta kept non-negative; with one size only, its
    mean). The background thread uses it to tell when a lane will be free
    (Executor.busy_for)."""

    WINDOW = 64

    __slots__ = ("_seen", "_fit")

    def __init__(self):
        self._seen = collections.deque(maxlen=self.WINDOW)
        self._fit = None

    def observe(self, nbytes, seconds):
        self._seen.append((float(nbytes), float(seconds)))
        self._fit = None

    def predict(self, nbytes):
        """Seconds an operation of `nbytes` is expected to take, or None
        before any has been seen."""
        if not self._seen:
            return None
        if self._fit is None:
            self._fit = _fit_line(self._seen)
        alpha, per_byte = self._fit
        return alpha + per_byte * nbytes


def _fit_line(points):
    """(a, b) >= 0 of y = a + b x fitted to (x, y) `points` by least squares."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= (1e-6 * mx) ** 2 * n:  # (one size: nothing to tell a from b)
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    if b < 0:
        return my, 0.0
    a = my - b * mx
    if a < 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b


def ready_events(entries):
    """The events of the entries' ready points, each once (a grouped
    submission shares one), recorded now where they were not yet."""
    seen = {}
    for e in entries:
        point = e.ready_point if e is not None else None
        if point is not None and id(point) not in seen:
            seen[id(point)] = point.event(launch=True)
    return list(seen.values())


def fence_events(entries, late=False):
    """What a backend's stream waits for before it writes results into memory
    it takes from CuPy's pool now: an event recorded now on each caller's
    stream where an entry's ready point was recorded early (ReadyPoint), or
    on every caller's stream where the memory is taken `late`: after the
    operation launched and yielded (the staging backend's host round trip),
    when the caller may have queued such kernels since its launch.
    The pool hands out memory some earlier result held until its last
    reference went; the caller's kernels that read that result were queued
    on its stream before that, but maybe after the early event, so without
    this the new result could be written over the old one while it is still
    read. Where the ready points were recorded at launch (the usual case),
    they cover those kernels already: no events. None can be recorded on
    the per-thread default stream (only its own thread can); a caller's
    reads on a stream other than the one it submitted on are its own
    business, as with torch's allocator (Tensor.record_stream).

    Nor where the stream was made to wait for an operation since the ready
    point (a synchronize, with asynchronous completion): the event would
    cover that wait, and one collective waiting for another, on two lanes
    in opposite orders on two ranks, would wait forever (as ReadyPoint
    says). There the hazard stays: asynchronous completion only."""
    streams, events = {}, []
    with _pending_lock:  # (no wait lands between the check and the record)
        for e in entries:
            point = e.ready_point if e is not None else None
            if (point is not None and (point.early or late)
                    and point.stream.ptr != _PER_THREAD_STREAM
                    and _stream_waits[(point.device, point.stream.ptr)] == point.waits):
                streams.setdefault((point.device, point.stream.ptr), point)
        for point in streams.values():
            with cupy().cuda.Device(point.device):
                events.append(record(point.stream))
    return events


class Fence:
    """For one operation: `empty()` gives a new device array for a result,
    from CuPy's pool, with `stream` made to wait for fence_events(entries)
    first (once, at the first result; none if the operation makes none).
    `late`: as fence_events says."""

    def __init__(self, stream, entries, late=False):
        self.stream = stream
        self.entries = entries
        self.late = late

    def empty(self, shape, dtype):
        if self.entries is not None:
            for event in fence_events(self.entries, self.late):
                self.stream.wait_event(event)
            self.entries = None
        return cupy().empty(shape, dtype)


# NCCL's status codes (nccl.h), for the ones CuPy 13 cannot name.
_NCCL_STATUS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError",
                7: "ncclInProgress"}


def nccl_status_error(exc, what="NCCL error"):
    """The RuntimeError to raise for a KeyError out of a CuPy NCCL call: CuPy
    13's NcclError looks its message up in a table of codes 0-5, so a remote
    error (6: a peer's connection failed) or 7 came out as KeyError: 6.
    None for any other KeyError."""
    code = exc.args[0] if exc.args else None
    if type(code) is not int or code not in _NCCL_STATUS:
        return None
    return RuntimeError(f"{what} {code} ({_NCCL_STATUS[code]}"
                        f"{': a peer failed or its connection broke' if code == 6 else ''})")


def _checked(check):
    """Runs an NCCL communicator's check_async_error, saying what CuPy 13
    cannot name (nccl_status_error)."""
    try:
        check()
    except KeyError as exc:
        error = nccl_status_error(exc, "NCCL asynchronous error")
        if error is None:
            raise
        raise error from None


class DeviceWait:
    """Work queued on a device: the background thread polls `ready()` (an
    event query, never blocking); `order_current_stream()` makes the
    caller's current stream wait for it, as Horovod's synchronize does.

    keep: host objects the queued work still reads (released once it is
    done); check: called while waiting, raises if the work can never finish
    (an NCCL communicator's asynchronous error); results: the operation's
    results, given where this waits for its last work; lets_next_start: the
    lane's next operation may queue its work behind this (executor.py);
    timing: (start, nbytes, times) where the work of `nbytes` began on the
    device at timed event `start`: once done, it teaches the CallTimes
    `times` how long it took, and meanwhile `expected_end()` says when it
    should be done."""

    __slots__ = ("device", "events", "keep", "check", "fired", "results", "lets_next_start",
                 "timing", "started_at")

    def __init__(self, device, events, keep=None, check=None, results=None,
                 lets_next_start=False, timing=None):
        self.device = device
        self.events = events
        self.keep = keep
        self.check = check
        self.fired = False
        # An operation's results, when this waits for the last of its work:
        # valid in stream order from now on (HOROVOD_ENABLE_ASYNC_COMPLETION).
        self.results = results
        self.lets_next_start = lets_next_start
        self.timing = timing
        self.started_at = None  # (time.monotonic()) when the host saw `start` fire

    def ready(self):
        if self.fired:
            return True
        for event in self.events:
            if not event.done:
                if self.check is not None:
                    _checked(self.check)
                if self.timing is not None and self.started_at is None:
                    self._note_start(time.monotonic())
                return False
        self.fired = True
        self.keep = None
        if self.timing is not None:
            start, nbytes, times = self.timing
            times.observe(nbytes, cupy().cuda.get_elapsed_time(start, self.events[-1]) * 1e-3)
        return True

    def _note_start(self, now):
        if self.timing[0].done:
            self.started_at = now

    def expected_end(self, now, after=None):
        """When (time.monotonic()) this work should be done: `now` once it is;
        else from when it began on the device, or where it has not yet, from
        `after` (when the work queued before it on its stream should end);
        None where that cannot be told (no timing, nothing learned yet, or
        not begun with nothing before it)."""
        if self.fired:
            return now
        if self.timing is None:
            return None
        duration = self.timing[2].predict(self.timing[1])
        if duration is None:
            return None
        if self.started_at is None:
            self._note_start(now)
        start = self.started_at if self.started_at is not None else after
        return None if start is None else start + duration

    def order_current_stream(self):
        """Nothing to do once the work has finished: an operation completes its
        handles only after the background thread saw its event fire."""
        if self.fired:
            return
        record_pending()  # (ReadyPoint: none may come to cover this wait)
        stream = current_stream(self.device)
        # On the results' device: a stream handle of 0 (torch's and CuPy's
        # default stream) means the legacy stream of the *current* device, so
        # from a thread whose current device is another (a model moved with
        # .to("cuda:1") and no set_device) the wait landed on that device's
        # stream and the step read the results before they were written.
        with _pending_lock, cupy().cuda.Device(self.device):  # (nor a fence: fence_events)
            _stream_waits[(self.device, stream.ptr)] += 1
            for event in self.events:
                stream.wait_event(event)
