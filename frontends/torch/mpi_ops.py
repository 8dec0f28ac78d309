"""horovod.torch.mpi_ops over the coordinator: lifecycle, build queries,
handles, and the non-differentiable collectives on torch tensors.

Each collective has ONE implementation (`_allreduce`, `_allgather`,
`_broadcast`, `_alltoall`, `_reducescatter`) taking a list of tensors and two
switches, `grouped` and `inplace`. The public `_async`, `_async_`, grouped and
blocking in-place variants are generated from it (`_variant`, `_blocking`).
The differentiable blocking ops (`allreduce`, `allgather`, ...) live in
autograd.py and are re-exported here, as Horovod users import them from
`horovod.torch.mpi_ops`.

Handles are ints from one counter shared by every op type, starting at 1 and
reset by shutdown, as in Horovod. Names follow Horovod's torch frontend:
`<op>.<name>`, or `<op>.noname.<k>` without a name; members of a grouped op
are `<base>_<i>of<N>`. The core receives these full names, so every rank must
produce the same ones. Horovod takes k from the handle counter, so one named
op that only some ranks run (a join, an op on a process set) shifts every
later unnamed name on those ranks and the job stalls. Here k counts the
unnamed ops of each process set instead (sets other than the global one are
tagged `<op>.noname.set<id>.<k>`), so only the unnamed ops of a set have to
come in the same order on its ranks.
"""

import functools
import inspect
import itertools
import os

import numpy as np
import torch

import coordinator as core
from coordinator import basics as _core_basics
from coordinator import collectives as _core_collectives
# Build queries and the timeline are the core's: every frontend answers the same.
from coordinator.basics import (ccl_built, cuda_built, ddl_built, gloo_built,  # noqa: F401
                                gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built,
                                start_timeline, stop_timeline)
from coordinator.collectives import handle_average_backwards_compatibility
from coordinator.collectives import label as _label
from coordinator import handles as _core_handles
from coordinator.errors import HorovodInternalError
from coordinator.process_sets import ProcessSet, global_process_set
from frontends.torch import _tensors

# backward() runs on the calling thread inside autograd's engine, whose own
# threads run the gradient hooks of CUDA tensors, which submit: the deadlock
# check counts the caller as one of them (coordinator/handles.py).
_core_handles.note_framework_runtime(os.path.join("torch", "autograd", ""))

# Reduction ops: Horovod's values, plain ints.
Average = core.Average
Sum = core.Sum
Adasum = core.Adasum
Min = core.Min
Max = core.Max
Product = core.Product

__all__ = ["ProcessSet", "global_process_set", "HorovodInternalError"]


# ------------------------------------------------------------------ handles
class _Handles:
    """Frontend handles: int -> (core handle, function building the torch
    result from the core's result). The counter also names unnamed ops."""

    def __init__(self):
        self.reset()

    def reset(self):
        self._counter = itertools.count(1)
        self._unnamed = {}  # process set id -> counter of unnamed ops
        self._pending = {}

    def new(self):
        return next(self._counter)

    def name(self, prefix, name, process_set):
        """The full name the core gets for an op."""
        if name:
            return f"{prefix}.{name}"
        pid = process_set.process_set_id if isinstance(process_set, ProcessSet) else None
        counter = self._unnamed.get(pid)
        if counter is None:
            counter = self._unnamed[pid] = itertools.count(1)
        k = next(counter)
        return f"{prefix}.noname.{k}" if pid == 0 else f"{prefix}.noname.set{pid}.{k}"

    def forget_set(self, process_set_id):
        """A set id was (re)registered or removed: its names start over."""
        self._unnamed.pop(process_set_id, None)

    def add(self, handle, core_handle, finish, device=-1):
        self._pending[handle] = (core_handle, finish, device)

    def get(self, handle):
        return self._pending.get(handle)

    def pop(self, handle):
        return self._pending.pop(handle, None)


_handles = _Handles()


def _submit(handle, call, finish, device=-1):
    """Runs the core submission `call()` (for CUDA tensors on `device`, with
    torch's current stream as CuPy's, where the core records their ready
    event); failures keep Horovod's types: ValueError (bad arguments,
    duplicate names) as is, anything else as HorovodInternalError."""
    try:
        if device < 0:  # (no context manager for the CPU: 1 us a call)
            core_handle = call()
        else:
            with _tensors.on_torch_stream(device):
                core_handle = call()
    except (HorovodInternalError, ValueError, TypeError, NotImplementedError):
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(str(exc)) from exc
    _handles.add(handle, core_handle, finish, device)
    return handle


def poll(handle):
    """True once the operation behind `handle` has completed; `synchronize`
    then returns without blocking."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"poll: handle {handle!r} is unknown (never returned by an _async "
                         "call, or already synchronized)")
    return bool(core.poll(pending[0]))


def synchronize(handle):
    """Waits for an asynchronous operation and returns its result: the output
    tensor (the input tensor itself for in-place variants), a tuple for
    grouped ops, (output, received_splits) for alltoall. Returns None for an
    unknown handle, as Horovod does. A failed operation raises
    HorovodInternalError carrying the core's message."""
    pending = _handles.pop(handle)
    if pending is None:
        return None
    core_handle, finish, device = pending
    try:
        if device < 0:  # (no context manager for the CPU, as in _submit)
            result = core.synchronize(core_handle)
        else:
            with _tensors.on_torch_stream(device):  # torch's stream waits for the result
                result = core.synchronize(core_handle)
    except HorovodInternalError:
        raise
    except Exception as exc:  # the core's shutdown/usage errors, as Horovod reports them
        raise HorovodInternalError(str(exc)) from exc
    return finish(result)


# --------------------------------------------------------------- lifecycle
def init(comm=None, process_sets=None):
    """Starts the coordinator, or joins the one already running in this
    process (TensorFlow and PyTorch share it). Calling it again is harmless,
    as in Horovod. comm: an mpi4py communicator or a list of global ranks;
    process_sets: ProcessSets to register, or "dynamic"."""
    fresh = not core.is_initialized()
    try:
        _core_basics.ensure_initialized(comm, process_sets)
    except RuntimeError as exc:
        if isinstance(exc, HorovodInternalError):
            raise
        raise HorovodInternalError(str(exc)) from exc
    if fresh:
        _handles.reset()


def shutdown():
    """Stops the coordinator; operations still in flight fail."""
    core.shutdown()
    _handles.reset()


is_initialized = core.is_initialized
size = core.size
rank = core.rank
local_size = core.local_size
local_rank = core.local_rank
cross_size = core.cross_size
cross_rank = core.cross_rank
is_homogeneous = core.is_homogeneous
mpi_threads_supported = core.mpi_threads_supported


def add_process_set(process_set):
    """Registers a process set (a ProcessSet or a list of global ranks) on
    every rank; all ranks call it, in the same order. Returns the set."""
    ps = core.add_process_set(process_set)
    _handles.forget_set(ps.process_set_id)
    return ps


def remove_process_set(process_set):
    """Unregisters a process set on every rank; False if it was not
    registered or is the global set."""
    pid = process_set.process_set_id
    removed = core.remove_process_set(process_set)
    if removed:
        _handles.forget_set(pid)
    return removed


# ----------------------------------------------------------------- helpers

def _results(bridged, grouped):
    if not grouped:
        return bridged[0].written()
    return tuple([b.written() for b in bridged])


def _device(bridged):
    """The GPU the tensors are on, or -1 (the core reads each array's own)."""
    return bridged[0].device if bridged else -1


# --------------------------------------------------- the one implementations
def _refuse(kind, name, error, process_set, tensors=(), grouped=False):
    """The frontend's own checks of its input (a supported dtype, a dense
    tensor, an in-place target without shared elements) failed: the other
    ranks fail too, naming this rank, instead of waiting for it."""
    _core_collectives.refuse(kind, name, error, process_set, len(tensors) if grouped else 0)


def _allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, *, grouped, inplace):
    op = handle_average_backwards_compatibility(op, average, stacklevel=4)
    handle = _handles.new()
    prefix = "grouped_allreduce" if grouped else "allreduce"
    name = _handles.name(prefix, name, process_set)
    try:
        what = _label(prefix, name)
        ins = [_tensors.bridge(t, what, reducible=True, inplace=inplace) for t in tensors]
    except (ValueError, TypeError) as exc:
        _refuse("allreduce", name, exc, process_set, tensors, grouped)
        raise
    outs = ins if inplace else [_tensors.bridge(_tensors.empty_like(t), prefix, True)
                                for t in tensors]
    # (by position, in the core's order: keywords cost a gradient 1 us)
    if grouped:
        def call():
            return core.grouped_allreduce_async([b.array for b in ins], None, name, op,
                                                prescale_factor, postscale_factor,
                                                process_set, [b.array for b in outs])
    else:
        def call():
            return core.allreduce_async(ins[0].array, None, name, op, prescale_factor,
                                        postscale_factor, process_set, outs[0].array)
    return _submit(handle, call, lambda _: _results(outs, grouped), _device(ins or outs))


def _allgather(tensors, name=None, process_set=global_process_set, *, grouped, inplace=False):
    handle = _handles.new()
    prefix = "grouped_allgather" if grouped else "allgather"
    name = _handles.name(prefix, name, process_set)
    try:
        what = _label(prefix, name)
        ins = [_tensors.bridge(t, what) for t in tensors]
    except (ValueError, TypeError) as exc:
        _refuse("allgather", name, exc, process_set, tensors, grouped)
        raise
    kwargs = dict(name=name, process_set=process_set)
    if grouped:
        def call():
            return core.grouped_allgather_async([b.array for b in ins], **kwargs)

        def finish(result):
            return tuple(_tensors.to_tensor(r, t) for r, t in zip(result, tensors))
    else:
        def call():
            return core.allgather_async(ins[0].array, **kwargs)

        def finish(result):
            return _tensors.to_tensor(result, tensors[0])
    return _submit(handle, call, finish, _device(ins))


def _broadcast(tensors, root_rank, name=None, process_set=global_process_set, *, grouped=False,
               inplace):
    handle = _handles.new()
    (tensor,) = tensors
    name = _handles.name("broadcast", name, process_set)
    try:
        src = _tensors.bridge(tensor, _label("broadcast", name), inplace=inplace)
    except (ValueError, TypeError) as exc:
        _refuse("broadcast", name, exc, process_set)
        raise
    out = src if inplace else _tensors.bridge(_tensors.empty_like(tensor), "broadcast")

    def call():
        return core.broadcast_async(src.array, root_rank, name=name, process_set=process_set,
                                    output=out.array)
    return _submit(handle, call, lambda _: out.written(), src.device)


def _alltoall(tensors, splits=None, name=None, process_set=global_process_set, *, grouped=False,
              inplace=False):
    handle = _handles.new()
    (tensor,) = tensors
    name = _handles.name("alltoall", name, process_set)
    try:
        src = _tensors.bridge(tensor, _label("alltoall", name))
        if isinstance(splits, torch.Tensor):
            if splits.dim() != 1 or splits.dtype != torch.int32:
                raise ValueError(f"{_label('alltoall', name)}: splits must be a 1-D "
                                 f"torch.int32 tensor, got {splits.dim()}-D {splits.dtype}")
            splits = splits.detach().cpu().numpy()
    except (ValueError, TypeError) as exc:
        _refuse("alltoall", name, exc, process_set)
        raise

    def call():
        return core.alltoall_async(src.array, splits=splits, name=name,
                                   process_set=process_set)

    def finish(result):
        output, received = result
        return (_tensors.to_tensor(output, tensor),
                torch.from_numpy(np.asarray(received, dtype=np.int32)))
    return _submit(handle, call, finish, src.device)


def _reducescatter(tensors, name=None, op=Average, process_set=global_process_set,
                   prescale_factor=1.0, postscale_factor=1.0, *, grouped, inplace=False):
    if op not in (Average, Sum):
        # Horovod reports this as an aborted operation, i.e. HorovodInternalError.
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM "
                                   f"(got op={op!r}).")
    handle = _handles.new()
    prefix = "grouped_reducescatter" if grouped else "reducescatter"
    name = _handles.name(prefix, name, process_set)
    try:
        what = _label(prefix, name)
        ins = [_tensors.bridge(t, what, reducible=True) for t in tensors]
    except (ValueError, TypeError) as exc:
        _refuse("reducescatter", name, exc, process_set, tensors, grouped)
        raise
    kwargs = dict(name=name, op=op, process_set=process_set,
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    if grouped:
        def call():
            return core.grouped_reducescatter_async([b.array for b in ins], **kwargs)

        def finish(result):
            return tuple(_tensors.to_tensor(r, t) for r, t in zip(result, tensors))
    else:
        def call():
            return core.reducescatter_async(ins[0].array, **kwargs)

        def finish(result):
            return _tensors.to_tensor(result, tensors[0])
    return _submit(handle, call, finish, _device(ins))


# --------------------------------------------------------- variant makers
def _variant(impl, public_name, doc, grouped=False, inplace=False):
    """A public function over `impl` for one (grouped, inplace) choice, with
    Horovod's signature: `tensor` (or `tensors`) first, then impl's arguments."""
    first = "tensors" if grouped else "tensor"
    params = list(inspect.signature(impl).parameters.values())
    signature = inspect.Signature([params[0].replace(name=first)] +
                                  [p for p in params[1:] if p.kind is not p.KEYWORD_ONLY])

    def variant(*args, **kwargs):
        if args:
            value, args = args[0], args[1:]
        elif first in kwargs:
            value = kwargs.pop(first)
        else:
            raise TypeError(f"{public_name}() missing required argument '{first}'")
        return impl(list(value) if grouped else [value], *args, grouped=grouped,
                    inplace=inplace, **kwargs)

    variant.__name__ = variant.__qualname__ = public_name
    variant.__module__ = __name__
    variant.__signature__ = signature
    variant.__doc__ = doc
    return variant


def _blocking(async_fn, public_name, doc):
    """The blocking form of an _async variant: submit, then synchronize."""

    @functools.wraps(async_fn)
    def run(*args, **kwargs):
        with _core_collectives.submitting_to_drive():
            handle = async_fn(*args, **kwargs)
        pending = _handles.get(handle)
        if pending is not None:
            _core_collectives.drive(pending[0])  # this thread runs the loop meanwhile
        return synchronize(handle)

    run.__name__ = run.__qualname__ = public_name
    run.__doc__ = doc
    return run


_REDUCE_DOC = ("op: Average (default), Sum, Min, Max, Product or Adasum; the result is "
               "postscale_factor * op(prescale_factor * tensor).")

allreduce_async = _variant(
    _allreduce, "allreduce_async",
    "Starts reducing `tensor` over the process set; returns a handle whose result is a new "
    "tensor. " + _REDUCE_DOC)
allreduce_async_ = _variant(
    _allreduce, "allreduce_async_",
    "Starts reducing `tensor` in place; returns a handle whose result is `tensor`. "
    + _REDUCE_DOC, inplace=True)
allreduce_ = _blocking(allreduce_async_, "allreduce_",
                       "Reduces `tensor` in place over the process set and returns it.")
grouped_allreduce_async = _variant(
    _allreduce, "grouped_allreduce_async",
    "Starts reducing a list of tensors as one unit; the handle's result is a tuple of new "
    "tensors.", grouped=True)
grouped_allreduce_async_ = _variant(
    _allreduce, "grouped_allreduce_async_",
    "Starts reducing a list of tensors in place as one unit; the handle's result is the "
    "tuple of those tensors.", grouped=True, inplace=True)
grouped_allreduce_ = _blocking(grouped_allreduce_async_, "grouped_allreduce_",
                               "Reduces a list of tensors in place; returns them as a tuple.")
allgather_async = _variant(
    _allgather, "allgather_async",
    "Starts concatenating every rank's `tensor` along dimension 0 (sizes may differ); "
    "returns a handle.")
grouped_allgather_async = _variant(
    _allgather, "grouped_allgather_async",
    "Starts gathering a list of tensors as one unit; the handle's result is a tuple.",
    grouped=True)
broadcast_async = _variant(
    _broadcast, "broadcast_async",
    "Starts sending `tensor` from `root_rank` (a global rank) to the process set; the "
    "handle's result is a new tensor.")
broadcast_async_ = _variant(
    _broadcast, "broadcast_async_",
    "Starts broadcasting into `tensor` in place from `root_rank`; returns a handle.",
    inplace=True)
broadcast_ = _blocking(broadcast_async_, "broadcast_",
                       "Broadcasts into `tensor` in place from `root_rank` and returns it.")
alltoall_async = _variant(
    _alltoall, "alltoall_async",
    "Starts sending splits[i] rows of `tensor` to rank i of the set (an even split when "
    "splits is None); the handle's result is (output, received_splits).")
reducescatter_async = _variant(
    _reducescatter, "reducescatter_async",
    "Starts reducing `tensor` (Sum or Average) and leaving each rank its share of "
    "dimension 0 (lower ranks get the extra rows); returns a handle.")
grouped_reducescatter_async = _variant(
    _reducescatter, "grouped_reducescatter_async",
    "Starts a reducescatter of a list of tensors as one unit; the result is a tuple.",
    grouped=True)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts reducing a sparse COO tensor by gathering every rank's indices
    and values (`<name>.indices`, `<name>.values`). Returns a callable, not an
    int handle: calling it waits and returns the reduced sparse tensor."""
    t = tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(),
                              name=f"{name}.indices", process_set=process_set)
    values = allgather_async(t._values().contiguous(), name=f"{name}.values",
                             process_set=process_set)

    def wait():
        vals = synchronize(values)
        idx = synchronize(indices)
        if op == Average:
            vals = vals / process_set.size()
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size(),
                                       check_invariants=False)
    return wait


# ----------------------------------------------------------------- control
def join(device=-1):
    """Marks this rank as done; until every rank has joined it takes part in
    the others' allreduces with zeros. Returns the last rank to join."""
    try:
        return int(core.join(device))
    except HorovodInternalError:
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(str(exc)) from exc


def barrier(process_set=global_process_set):
    """Blocks until every rank of the process set has reached it."""
    try:
        core.barrier(process_set=process_set)
    except (HorovodInternalError, ValueError):
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(str(exc)) from exc


# The differentiable blocking collectives (Horovod defines them in mpi_ops).
from frontends.torch.autograd import (allgather, allreduce, alltoall, broadcast,  # noqa: E402
                                      grouped_allgather, grouped_allreduce,
                                      grouped_reducescatter, reducescatter)
from frontends.torch.autograd import (HorovodAllgather, HorovodAllreduce,  # noqa: E402,F401
                                      HorovodAlltoall, HorovodBroadcast,
                                      HorovodGroupedAllgather, HorovodGroupedAllreduce,
                                      HorovodGroupedReducescatter, HorovodReducescatter)

# Also in Horovod's torch mpi_ops: its helpers and its `_basics` object.
from frontends._util import (Basics, get_average_backwards_compatibility_fun,  # noqa: E402,F401
                             gpu_available, num_rank_is_power_2)

_basics = Basics(globals())
