"""The collective operations, in Horovod's vocabulary, over NumPy arrays.

Every operation has one asynchronous implementation that validates its input
on the calling rank, turns it into an `Entry` and queues it for the
background thread, returning an int handle at once. The blocking variant is
generated from it (`_blocking`): submit, then `synchronize`.

Tensors are NumPy arrays (anything `np.asarray` takes) or CUDA arrays
(CuPy, `__cuda_array_interface__`, DLPack), which stay where they are: the
core views them with CuPy and records their device (gpu.py). CuPy is
imported only when a CUDA array arrives.

Input this rank refuses (a bad root, bad splits, an unsupported dtype, ...)
raises ValueError here, and the refusal goes to the coordinator too, so the
other ranks' copies of the operation fail at once, naming this rank and its
reason, instead of waiting for it forever. Frontends that check their own
input before it reaches the core (a torch tensor that is not contiguous)
tell theirs with `refuse` (or `refusing`), to the same effect.
"""

import contextlib
import functools
import itertools
import numbers
import threading
import warnings

import numpy as np

from coordinator import dtypes, gpu, runtime, tensor_queue
from coordinator.errors import NotInitializedError
from coordinator.ops_names import (CPU_DEVICE, INTERNAL_PREFIX, JOIN_NAME, barrier_name, labelled,
                                    object_exchange_name)
from coordinator.process_sets import ProcessSet, global_process_set
from coordinator.tensor_queue import Entry
from coordinator.wire import pb

# Reduce operations; the values are Horovod's.
Average = pb.AVERAGE
Sum = pb.SUM
Adasum = pb.ADASUM
Min = pb.MIN
Max = pb.MAX
Product = pb.PRODUCT

_REDUCE_OPS = {Average, Sum, Adasum, Min, Max, Product}
_names = {"counter": itertools.count(1), "p2p": {}}


def reset_names():
    _names["counter"] = itertools.count(1)
    _names["p2p"] = {}


def _runtime_for(what):
    rt = runtime.current()
    if rt is None:
        state = ("has been shut down" if runtime.was_shut_down()
                 else "has not been initialized")
        raise NotInitializedError(f"{what}: the coordinator {state}; call init() first")
    runtime.check_process(rt, what)
    if rt.fatal_error is not None:
        raise type(rt.fatal_error)(f"{what}: {rt.fatal_error}")
    return rt


def label(op, name):
    """How every error names an operation: its kind and, when it has one,
    its tensor's full name (ops_names.labelled). The frontends use it too."""
    return labelled(op, name)


def _name(prefix, name):
    if type(name) is str and name in _checked_names:
        return name
    if name is None:
        return f"{prefix}.noname.{next(_names['counter'])}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"{prefix}: name must be a non-empty string, got {name!r}")
    if name.startswith(INTERNAL_PREFIX):
        raise ValueError(f"{prefix}: name {name!r}: names starting with {INTERNAL_PREFIX!r} are "
                         "reserved for the coordinator's own operations")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{prefix}: name {name!r} cannot be encoded as UTF-8 "
                         f"({exc.reason} at position {exc.start}); names travel to the other "
                         "ranks as UTF-8 text") from None
    if len(_checked_names) >= _CHECKED_NAMES:
        _checked_names.clear()
    _checked_names.add(name)
    return name


# Names that passed _name's checks: a training step submits the same names
# every step, and checking one again costs more than finding it here.
_checked_names = set()
_CHECKED_NAMES = 1 << 14  # (unnamed operations bring a new name each)


class _refusal:
    """Input errors raised inside go to the caller as they are, and to the
    coordinator as this rank's refusal of the operation (see module doc).
    A class, not a generator: it wraps every submission, and
    contextlib.contextmanager costs 0.9 us a use against 0.3 us."""

    __slots__ = ("rt", "name", "op", "ps", "group_size")

    def __init__(self, rt, name, op, ps, group_size=None):
        self.rt, self.name, self.op, self.ps, self.group_size = rt, name, op, ps, group_size

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, (ValueError, TypeError)):
            _tell_refusal(self.rt, self.name, self.op, self.ps.process_set_id, self.group_size,
                          exc)
        return False  # the error goes on to the caller


def _tell_refusal(rt, name, op, process_set_id, group_size, error):
    """Tells the coordinator that this rank refuses operation `op` named
    `name` in the set `process_set_id` for `error`: a group's, by its base
    name, when `group_size` is not None (0 for an empty group)."""
    grouped = group_size is not None
    rt.queue.tell(Entry(name, op, process_set_id=process_set_id,
                        group=name if grouped else "", group_size=group_size or 0,
                        rejected=f"{type(error).__name__}: {error}"))


_REFUSABLE = {"allreduce": pb.ALLREDUCE, "allgather": pb.ALLGATHER,
              "broadcast": pb.BROADCAST, "alltoall": pb.ALLTOALL,
              "reducescatter": pb.REDUCESCATTER}


def refuse(kind, name, error, process_set=global_process_set, group_size=0):
    """For a frontend that checks an operation's input itself, before the
    core's call: tells the coordinator that this rank refuses the `kind`
    operation ('allreduce', 'allgather', 'broadcast', 'alltoall',
    'reducescatter') named `name` (the full name the core would get; a
    grouped one's base name, with its group_size) for `error`, the
    ValueError or TypeError the frontend raises. The set's other ranks then
    fail at once naming this rank, as they do when the core's own checks
    refuse, instead of waiting for it. Call it where the frontend catches
    its check's error, and raise that error on: the try costs nothing when
    nothing fails. Only the frontend's checks: the core's call tells its
    own refusals. Without a running job, or for a set this rank cannot use,
    nothing is told (the core's call would raise)."""
    rt = runtime.current()
    if rt is None or rt.fatal_error is not None or runtime.forked(rt):
        return
    try:
        ps = _process_set(process_set, rt, kind)
    except ValueError:
        return
    _tell_refusal(rt, name, _REFUSABLE[kind], ps.process_set_id, group_size or None, error)


@contextlib.contextmanager
def refusing(kind, name, process_set=global_process_set, group_size=0):
    """`refuse` for the ValueError or TypeError raised inside (a context
    manager costs about 1 us a use: on a hot path, catch and call refuse)."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        refuse(kind, name, exc, process_set, group_size)
        raise


def _process_set(process_set, rt, what):
    if process_set is global_process_set and process_set.process_set_id == 0:
        return process_set  # the common case, always registered and including us
    registered(process_set, rt, what)
    if not process_set.included():
        raise ValueError(f"{what}: rank {rt.rank} is not a member of the provided process "
                         f"set {process_set.ranks}")
    return process_set


class UnusableProcessSetError(ValueError):
    """This rank cannot use the process set it was given (not a ProcessSet,
    or one it does not hold), where the others may be waiting in theirs:
    `refuse_on` is the set to tell them in, the set's id where it has one,
    else the global set's."""

    def __init__(self, text, refuse_on=0):
        super().__init__(text)
        self.refuse_on = refuse_on


def _checked_set(process_set, rt, what, name, op, group_size=None):
    """_process_set, and where this rank cannot use the set, a refusal of
    the operation: the other ranks' copies fail at once naming this rank,
    and this rank's next copy of the name meets their next one, not the
    copy it never sent (which mixed steps: every later result of the name
    combined this rank's step k+1 with the others' step k)."""
    try:
        return _process_set(process_set, rt, what)
    except UnusableProcessSetError as exc:
        _tell_refusal(rt, name, op, exc.refuse_on, group_size, exc)
        raise


def registered(process_set, rt, what):
    """UnusableProcessSetError (a ValueError), saying why, unless the running
    coordinator `rt` holds `process_set` (its membership aside)."""
    if process_set is global_process_set and process_set.process_set_id == 0:
        return
    if not isinstance(process_set, ProcessSet):
        raise UnusableProcessSetError(f"{what}: process_set must be a ProcessSet, got "
                                      f"{process_set!r}")
    pid = process_set.process_set_id
    if pid is None and process_set._released:
        raise UnusableProcessSetError(
            f"{what}: the process set with ranks {process_set.ranks} was removed when the "
            "coordinator shut down (an elastic job shuts it down as it re-forms); register it "
            "again with add_process_set() (in an elastic job, in a reset callback: "
            "state.register_reset_callbacks) or init(process_sets=...)")
    if pid is None or not rt.process_sets.holds(process_set):
        raise UnusableProcessSetError(
            f"{what}: {process_set!r} is not registered on this rank; pass it to "
            "init(process_sets=...) or add_process_set() first", 0 if pid is None else pid)


def _array(tensor, what, reducible):
    """(array, dtype info, device): a NumPy array (device -1), or a CuPy view of
    a CUDA array and its device ordinal."""
    if isinstance(tensor, np.ndarray):
        arr, device = tensor, CPU_DEVICE
        info = dtypes.info_for(arr.dtype)
    elif gpu.is_device_array(tensor):
        arr, info, device = gpu.as_device_array(tensor, what)
    else:
        arr, device = np.asarray(tensor), CPU_DEVICE
        info = dtypes.info_for(arr.dtype)
    if info is None:
        raise ValueError(f"{what}: dtype {arr.dtype} is not supported (supported: "
                         f"{dtypes.SUPPORTED_NAMES})")
    if reducible and not info.reducible:
        raise ValueError(f"{what}: dtype {arr.dtype} cannot be reduced; allgather, broadcast "
                         "and alltoall accept it")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr) if device == CPU_DEVICE else gpu.contiguous(arr, device)
    return arr, info, device


def _output(output, arr, device, what):
    if output is None:
        return None
    if device != CPU_DEVICE:
        return gpu.output_array(output, arr, device, what)
    if not isinstance(output, np.ndarray):
        raise ValueError(f"{what}: output must be a NumPy array")
    if output.shape != arr.shape or output.dtype != arr.dtype:
        raise ValueError(f"{what}: output has shape {output.shape} and dtype {output.dtype}; "
                         f"the tensor has shape {arr.shape} and dtype {arr.dtype}")
    if not output.flags.c_contiguous or not output.flags.writeable:
        raise ValueError(f"{what}: output must be a writeable C-contiguous array (it is "
                         "written in place); pass a contiguous array or no output")
    return output


def handle_average_backwards_compatibility(op, average, stacklevel=3):
    """Horovod frontends' rule for `op` and the deprecated `average`: both
    given is an error; `average` alone warns (`stacklevel` as for
    warnings.warn; 3 names the caller of a public op that calls this) and
    picks Average or Sum; neither means Average. The core's own API checks
    its arguments in `_reduce_op` instead, naming the tensor."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one "
                             "of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                      "in v1.0", DeprecationWarning, stacklevel=stacklevel)
        return Average if average else Sum
    return Average


def _reduce_op(op, average, what):
    if op is not None and average is not None:
        raise ValueError(f"{what}: pass either op or the deprecated average, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in _REDUCE_OPS:
        raise ValueError(f"{what}: unknown reduce op {op!r}")
    return op


def _scale(value, label, what):
    if type(value) is float:
        return value
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{what}: {label} must be a real number, got {value!r}")
    return float(value)


class in_stream_order:
    """Device tensors submitted by this thread inside it take their results
    in stream order: their handles complete once their operation's work is
    queued on the device, and synchronize makes the caller's current stream
    wait for it, without waiting for the GPU (as all handles do with
    HOROVOD_ENABLE_ASYNC_COMPLETION). For results only read on that stream,
    as an optimizer step reads its gradients (frontends.torch's
    DistributedOptimizer submits them so, as DDP's reducer hands its
    buckets over). An operation that fails after that stops the job."""

    __slots__ = ("_before",)

    def __enter__(self):
        self._before = getattr(_stream_order, "on", False)
        _stream_order.on = True
        return self

    def __exit__(self, *exc_info):
        _stream_order.on = self._before


_stream_order = threading.local()


def _submit(rt, entries, group=False):
    """Queue entries (together) and return one handle: for the entry, or for
    the list of a grouped operation's entries."""
    if entries:
        for e in entries:
            if e.device != CPU_DEVICE:  # the backend's stream waits for these events
                gpu.record_ready(entries, idle=rt.background.lane_idle)
                if getattr(_stream_order, "on", False):
                    for d in entries:
                        d.in_stream_order = d.device != CPU_DEVICE
                break
        rt.queue.push_all(entries)
    return rt.handles.add(list(entries) if group else entries[0])


class submitting_to_drive:
    """Around the submission of an operation this thread waits for at once:
    its push does not wake the background thread, because `drive` runs the
    loop on this thread next (nothing changes where driving is off)."""

    __slots__ = ("quiet",)

    def __enter__(self):
        self.quiet = tensor_queue.quiet_pushes() if _drives(runtime.current()) else None
        if self.quiet is not None:
            self.quiet.__enter__()

    def __exit__(self, *exc_info):
        if self.quiet is not None:
            self.quiet.__exit__(*exc_info)


def drive(handle):
    """Runs the coordinator's loop on this thread until `handle` is done or
    for at most COORDINATOR_DRIVE_SECONDS, while the background thread
    sleeps (Background.drive); the background thread takes over after. Use
    after a submission made inside `submitting_to_drive`, before
    `synchronize`."""
    rt = runtime.current()
    if _drives(rt):
        rt.background.drive(rt.handles.entries(handle))


def _drives(rt):
    return rt is not None and rt.config.drive_seconds > 0 and not runtime.forked(rt)


def _blocking(async_fn):
    """The blocking variant of an _async function: submit, run the loop on
    this thread (drive), then synchronize."""

    @functools.wraps(async_fn)
    def run(*args, **kwargs):
        with submitting_to_drive():
            handle = async_fn(*args, **kwargs)
        drive(handle)
        return synchronize(handle)

    run.__name__ = run.__qualname__ = async_fn.__name__[:-len("_async")]
    run.__doc__ = (async_fn.__doc__ or "").replace("Starts", "Runs").replace(
        "returns a handle", "waits for and returns the result")
    return run


# ----------------------------------------------------------------- allreduce
def _allreduce_entry(rt, tensor, name, op, prescale, postscale, ps, output, group="",
                     group_size=0, what=None):
    what = what or label("allreduce", name)
    arr, info, device = _array(tensor, what, reducible=True)
    if op == Adasum and info.dtype.kind != "f" and not dtypes.is_bfloat16(info.dtype):
        raise ValueError(f"{what}: Adasum needs a floating-point tensor, not {info.name}")
    # Positional, in Entry's order: thirteen keywords cost 1 us a tensor.
    return Entry(name, pb.ALLREDUCE, arr, _output(output, arr, device, what), info, arr.shape,
                 op, 0, _scale(prescale, "prescale_factor", what),
                 _scale(postscale, "postscale_factor", what), ps.process_set_id, device, (),
                 group, group_size)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, output=None):
    """Starts reducing `tensor` over the ranks of `process_set` and returns a
    handle. op: Average (default), Sum, Min, Max or Product. The result is
    postscale * op(prescale * tensor); Average divides by the set's size.
    With `output`, the result is written there (pass the tensor for in place)."""
    name = _name("allreduce", name)
    what = label("allreduce", name)
    rt = _runtime_for(what)
    ps = _checked_set(process_set, rt, what, name, pb.ALLREDUCE)
    try:  # _refusal's work without its with statement (0.9 us a gradient)
        op = _reduce_op(op, average, what)
        entry = _allreduce_entry(rt, tensor, name, op, prescale_factor, postscale_factor, ps,
                                 output, what=what)
    except (ValueError, TypeError) as exc:
        _tell_refusal(rt, name, pb.ALLREDUCE, ps.process_set_id, None, exc)
        raise
    return _submit(rt, [entry])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set,
                            outputs=None):
    """Starts reducing a list of tensors as one unit (they are negotiated and
    fused together) and returns one handle whose result is a list."""
    tensors = list(tensors)
    base = _name("grouped_allreduce", name)
    rt = _runtime_for(label("grouped_allreduce", base))
    n = len(tensors)
    ps = _checked_set(process_set, rt, label("grouped_allreduce", base), base, pb.ALLREDUCE, n)
    with _refusal(rt, base, pb.ALLREDUCE, ps, n):
        _not_empty(n, "grouped_allreduce", base)
        op = _reduce_op(op, average, label("grouped_allreduce", base))
        outputs = list(outputs) if outputs is not None else [None] * n
        if len(outputs) != n:
            raise ValueError(f"grouped_allreduce '{base}': {len(outputs)} outputs for {n} "
                             "tensors")
        entries = [_allreduce_entry(rt, t, _member(base, i, n), op, prescale_factor,
                                    postscale_factor, ps, o, group=base, group_size=n)
                   for i, (t, o) in enumerate(zip(tensors, outputs))]
    return _submit(rt, entries, group=True)


def _not_empty(n, what, base):
    """A group of no tensors is refused on every rank, as Horovod's
    frontends fail on one: returned empty, one rank's call was no call for
    the others, which went on waiting, and its next call of the name met
    their copy of this one."""
    if n == 0:
        raise ValueError(f"{what} '{base}': no tensors given")


def _member(base, i, n):
    """The name of a grouped operation's i-th of n tensors (Horovod's). Ranks
    that disagree on n still meet: the coordinator tracks the group by its
    base name and reports the mismatch."""
    return f"{base}_{i + 1}of{n}"


# ----------------------------------------------------------------- allgather
def _allgather_entry(tensor, name, ps, group="", group_size=0):
    what = label("allgather", name)
    arr, info, device = _array(tensor, what, reducible=False)
    if arr.ndim == 0:
        raise ValueError(f"{what}: a scalar cannot be gathered; give it a first dimension")
    return Entry(name, pb.ALLGATHER, tensor=arr, dtype_info=info, shape=arr.shape,
                 process_set_id=ps.process_set_id, device=device, group=group,
                 group_size=group_size)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's `tensor` along the first dimension
    (which may differ per rank) and returns a handle."""
    return _allgather_async(tensor, _name("allgather", name), process_set)


def object_exchange_async(kind, payload, name, process_set=global_process_set):
    """The allgather of bytes that moves Python objects (objects.py) for
    `kind` ('broadcast_object', 'allgather_object') called with `name`:
    named in the coordinator's namespace, where no tensor's name meets it,
    and named after `kind` in errors."""
    return _allgather_async(payload, object_exchange_name(kind, _name(kind, name)), process_set)


def _allgather_async(tensor, name, process_set):
    rt = _runtime_for(label("allgather", name))
    ps = _checked_set(process_set, rt, label("allgather", name), name, pb.ALLGATHER)
    with _refusal(rt, name, pb.ALLGATHER, ps):
        entry = _allgather_entry(tensor, name, ps)
    return _submit(rt, [entry])


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts gathering a list of tensors as one unit; the result is a list."""
    tensors = list(tensors)
    base = _name("grouped_allgather", name)
    rt = _runtime_for(label("grouped_allgather", base))
    n = len(tensors)
    ps = _checked_set(process_set, rt, label("grouped_allgather", base), base, pb.ALLGATHER, n)
    with _refusal(rt, base, pb.ALLGATHER, ps, n):
        _not_empty(n, "grouped_allgather", base)
        entries = [_allgather_entry(t, _member(base, i, n), ps, base, n)
                   for i, t in enumerate(tensors)]
    return _submit(rt, entries, group=True)


# ----------------------------------------------------------------- broadcast
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set,
                    output=None):
    """Starts sending `tensor` from `root_rank` (a global rank) to every rank
    of `process_set` and returns a handle."""
    name = _name("broadcast", name)
    what = label("broadcast", name)
    rt = _runtime_for(what)
    ps = _checked_set(process_set, rt, what, name, pb.BROADCAST)
    with _refusal(rt, name, pb.BROADCAST, ps):
        if not isinstance(root_rank, numbers.Integral) or root_rank not in ps.ranks:
            raise ValueError(f"{what}: invalid root rank {root_rank!r} for process set "
                             f"{ps.ranks}")
        arr, info, device = _array(tensor, what, reducible=False)
        entry = Entry(name, pb.BROADCAST, tensor=arr, output=_output(output, arr, device, what),
                      dtype_info=info, shape=arr.shape, root_rank=int(root_rank),
                      process_set_id=ps.process_set_id, device=device)
    return _submit(rt, [entry])


# ------------------------------------------------------------------ alltoall
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending splits[i] rows of `tensor` to rank i of the set (an even
    split when None) and returns a handle whose result is (output,
    received_splits)."""
    name = _name("alltoall", name)
    what = label("alltoall", name)
    rt = _runtime_for(what)
    ps = _checked_set(process_set, rt, what, name, pb.ALLTOALL)
    with _refusal(rt, name, pb.ALLTOALL, ps):
        entry = _alltoall_entry(tensor, splits, name, ps, what)
    return _submit(rt, [entry])


def _alltoall_entry(tensor, splits, name, ps, what):
    arr, info, device = _array(tensor, what, reducible=False)
    if arr.ndim == 0:
        raise ValueError(f"{what}: a scalar cannot be scattered; give it a first dimension")
    n = ps.size()
    if splits is None:
        if arr.shape[0] % n:
            raise ValueError(f"{what}: splits not given and the first dimension "
                             f"{arr.shape[0]} is not a multiple of the {n} ranks")
        splits = [arr.shape[0] // n] * n
    else:
        splits = np.asarray(splits)
        if splits.ndim != 1 or splits.dtype.kind not in "iu":
            raise ValueError(f"{what}: splits must be a 1-D list of integers")
        splits = [int(s) for s in splits]
        if len(splits) != n:
            raise ValueError(f"{what}: {len(splits)} splits given for a process set of {n} "
                             "ranks")
        if any(s < 0 for s in splits) or sum(splits) > arr.shape[0]:
            raise ValueError(f"{what}: splits {splits} must be non-negative and sum to at "
                             f"most the first dimension {arr.shape[0]}")
    return Entry(name, pb.ALLTOALL, tensor=arr, dtype_info=info, shape=arr.shape,
                 splits=tuple(splits), process_set_id=ps.process_set_id, device=device)


# ------------------------------------------------------------- reducescatter
def _reducescatter_entry(tensor, name, op, prescale, postscale, ps, group="", group_size=0):
    what = label("reducescatter", name)
    arr, info, device = _array(tensor, what, reducible=True)
    if arr.ndim == 0:
        raise ValueError(f"{what}: a scalar cannot be scattered; give it a first dimension")
    return Entry(name, pb.REDUCESCATTER, tensor=arr, dtype_info=info, shape=arr.shape,
                 reduce_op=op, prescale=_scale(prescale, "prescale_factor", what),
                 postscale=_scale(postscale, "postscale_factor", what),
                 process_set_id=ps.process_set_id, device=device, group=group,
                 group_size=group_size)


def _reducescatter_op(op, what):
    if op not in (Sum, Average):
        names = {Min: "Min", Max: "Max", Product: "Product", Adasum: "Adasum"}
        raise ValueError(f"{what}: reducescatter supports only Sum and Average, not "
                         f"{names.get(op, op)}")
    return op


def reducescatter_async(tensor, op=Average, name=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts reducing `tensor` over the set and leaving each rank its share
    of the first dimension (the first n % size ranks get one extra row);
    returns a handle."""
    name = _name("reducescatter", name)
    what = label("reducescatter", name)
    rt = _runtime_for(what)
    ps = _checked_set(process_set, rt, what, name, pb.REDUCESCATTER)
    with _refusal(rt, name, pb.REDUCESCATTER, ps):
        op = _reducescatter_op(op, what)
        entry = _reducescatter_entry(tensor, name, op, prescale_factor, postscale_factor, ps)
    return _submit(rt, [entry])


def grouped_reducescatter_async(tensors, op=Average, name=None,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Starts a reducescatter of a list of tensors as one unit."""
    tensors = list(tensors)
    base = _name("grouped_reducescatter", name)
    what = label("grouped_reducescatter", base)
    rt = _runtime_for(what)
    n = len(tensors)
    ps = _checked_set(process_set, rt, what, base, pb.REDUCESCATTER, n)
    with _refusal(rt, base, pb.REDUCESCATTER, ps, n):
        _not_empty(n, "grouped_reducescatter", base)
        op = _reducescatter_op(op, what)
        entries = [_reducescatter_entry(t, _member(base, i, n), op, prescale_factor,
                                        postscale_factor, ps, base, n)
                   for i, t in enumerate(tensors)]
    return _submit(rt, entries, group=True)


# ------------------------------------------------------------ send and recv
def _p2p_name(name, sender, receiver, ps):
    """Both sides' name for a send/recv: the given name, or the k-th unnamed
    one between this sender and receiver (so unnamed ones pair in program
    order), with the pair appended (the same name between other ranks is
    another tensor)."""
    if name is None:
        counters = _names["p2p"]
        key = (ps.process_set_id, sender, receiver)
        counters[key] = counters.get(key, 0) + 1
        name = f"p2p.noname.{counters[key]}"
    else:
        name = _name("send/recv", name)
    return f"{name} [{sender}->{receiver}]"


def _peer(rank, ps, me, what):
    if not isinstance(rank, numbers.Integral) or rank not in ps.ranks:
        raise ValueError(f"{what}: invalid peer rank {rank!r} for process set {ps.ranks}")
    if rank == me:
        raise ValueError(f"{what}: rank {me} cannot send to itself")
    return int(rank)


def send_async(tensor, dest_rank, name=None, process_set=global_process_set):
    """Starts sending `tensor` to `dest_rank` (a global rank), which receives
    it with `recv` under the same name; returns a handle (result None).
    Negotiated like every operation: the stall inspector, the watchdog and
    the timeline see it."""
    rt = _runtime_for("send")
    ps = _process_set(process_set, rt, "send")
    me = rt.rank
    dest = _peer(dest_rank, ps, me, "send")
    name = _p2p_name(name, me, dest, ps)
    what = label("send", name)
    with _refusal(rt, name, pb.P2P, ps):
        arr, info, device = _array(tensor, what, reducible=False)
        entry = Entry(name, pb.P2P, tensor=arr, dtype_info=info, shape=arr.shape,
                      ranks=(me, dest), process_set_id=ps.process_set_id, device=device)
    return _submit(rt, [entry])


def recv_async(source_rank, name=None, process_set=global_process_set):
    """Starts receiving what `source_rank` sends under the same name; returns
    a handle whose result is a new array of the sender's dtype and shape
    (a CuPy array on this rank's GPU when the sender's tensor was on a GPU)."""
    rt = _runtime_for("recv")
    ps = _process_set(process_set, rt, "recv")
    me = rt.rank
    source = _peer(source_rank, ps, me, "recv")
    name = _p2p_name(name, source, me, ps)
    entry = Entry(name, pb.P2P, ranks=(source, me), process_set_id=ps.process_set_id,
                  device=CPU_DEVICE)
    return _submit(rt, [entry])


# ---------------------------------------------------------- control and sync
def barrier_async(process_set=global_process_set):
    rt = _runtime_for("barrier")
    ps = _process_set(process_set, rt, "barrier")
    return _submit(rt, [Entry(barrier_name(ps.process_set_id), pb.BARRIER,
                              process_set_id=ps.process_set_id)])


def join_async(device=-1):
    rt = _runtime_for("join")
    return _submit(rt, [Entry(JOIN_NAME, pb.JOIN)])


def join(device=-1):
    """Blocks until every rank has joined; meanwhile this rank takes part in
    the other ranks' allreduces with zeros. Returns the last rank to join."""
    return synchronize(join_async(device))


def barrier(process_set=global_process_set):
    """Blocks until every rank of the set has reached the barrier."""
    synchronize(barrier_async(process_set))


def flush():
    """Says that no more tensors are coming soon, so the ones submitted so
    far should not wait for others to fuse with: a frontend calls it after
    the last gradient of a step (DistributedOptimizer). Without it the
    background thread holds GPU tensors back while their lane is busy, to
    send them in one larger call once it is free; with it they go at once,
    queued on the device behind the call in flight. A thread that starts
    waiting for a result (synchronize, a blocking collective) flushes too:
    it submits nothing more until then. Does nothing before init."""
    rt = runtime.current()
    if rt is not None and not runtime.forked(rt):
        rt.queue.flush()


def poll(handle):
    """True once the operation behind `handle` has completed."""
    rt = _runtime_for("poll")
    return rt.handles.poll(handle)


def synchronize(handle):
    """Waits for `handle`, releases it and returns its result (a list for a
    grouped operation); raises the operation's error if it failed."""
    rt = runtime.current()
    if rt is None:
        raise NotInitializedError("synchronize: the coordinator is not initialized")
    runtime.check_process(rt, "synchronize")
    return rt.handles.wait(handle, rt.check_health)


allreduce = _blocking(allreduce_async)
grouped_allreduce = _blocking(grouped_allreduce_async)
allgather = _blocking(allgather_async)
grouped_allgather = _blocking(grouped_allgather_async)
broadcast = _blocking(broadcast_async)
reducescatter = _blocking(reducescatter_async)
grouped_reducescatter = _blocking(grouped_reducescatter_async)
_alltoall_pair = _blocking(alltoall_async)
send = _blocking(send_async)
recv = _blocking(recv_async)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Runs alltoall; returns the output, or (output, received_splits) when
    `splits` is given."""
    output, received = _alltoall_pair(tensor, splits, name, process_set)
    return output if splits is None else (output, received)
