"""The coordinator's collectives as TensorFlow ops, eager and in graphs.

Each collective is one Python body over NumPy arrays that calls the core's
blocking operation:

- Eagerly it runs at once on views of the input tensors, and its results
  become tensors through DLPack (see tensor_bridge.py): no copies. GPU
  tensors stay on their GPU where CuPy is installed (the core's NCCL path).
- In a graph it becomes a stateful `tf.numpy_function`, whose Python body
  blocks an executor thread until every rank has submitted it. Ranks must
  therefore run a graph's collectives in one order, or each may end up with
  all its threads waiting on collectives the others have not started.
  Inside a `tf.function` TensorFlow runs stateful ops without resource
  inputs in program order (auto_control_deps.py), so every rank submits its
  collectives in the order the function lists them. Other graphs (a
  tf.compat.v1 graph run by a Session) have no such order, and several
  independent collectives there deadlocked; ordering.py chains each
  collective after the one created before it in the same graph (and
  control-flow context), which gives them the order a tf.function has and
  leaves tf.function graphs exactly as they were. That was chosen over a
  non-blocking submit op plus a wait op, because a chain of submissions
  would pull earlier submissions, without their waits, into a Session step
  that fetches a later result (ordering.py says more). Output shapes are
  set for shape inference: allreduce and broadcast keep the input's shape;
  allgather, alltoall and reducescatter leave the first dimension unknown.
- Under `jit_compile=True` it cannot run (XLA does not compile Python ops):
  tracing raises InvalidArgumentError saying so.

Names follow Horovod's TensorFlow API. In a graph an unnamed op is called
`HorovodAllreduce_<input tensor name>` (non-alphanumerics replaced by `_`),
inside the current name scope and made unique in the graph, exactly like the
TensorFlow node Horovod creates; every rank traces the same program, so
every rank gets the same names. Eagerly an unnamed op is called by its op
type (`HorovodAllreduce`), as Horovod's eager kernels are: eager collectives
run one at a time and in the same order on every rank, so a fixed name is
unambiguous, and it lets the core's response cache recognise a training
loop's steady state.

Gradients are those Horovod registers: allreduce's is the same allreduce of
the incoming gradient; allgather's and broadcast's are an averaging allreduce
of it (for allgather, then this rank's slice; for broadcast, zero off the
root); alltoall's sends gradients back along the received splits;
reducescatter's gathers them.
"""

import contextlib
import os
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.ops import control_flow_util as _control_flow_util

import coordinator as core
from coordinator import collectives as _core_collectives
from coordinator import handles as _core_handles
from coordinator import runtime as _core_runtime
from coordinator.process_sets import global_process_set
from frontends.tensorflow import errors, ordering
from frontends.tensorflow import tensor_bridge as bridge

# A tf.function (Keras's fit()) runs on the calling thread inside TensorFlow's
# executor, whose own threads run the collectives in it: the deadlock check
# counts the caller as one of them (coordinator/handles.py).
_core_handles.note_framework_runtime(os.path.join("tensorflow", "python", "eager", ""))

Average = core.Average
Sum = core.Sum
Adasum = core.Adasum
Min = core.Min
Max = core.Max
Product = core.Product


def _executing_eagerly():
    return tf.executing_eagerly()


def _normalize_name(name):
    """A TensorFlow name with everything but [a-zA-Z0-9_] replaced by `_`."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _op_name(op_type, default_suffix, name, ignore_name_scope):
    """The name the core negotiates this op under (see the module doc)."""
    if _executing_eagerly():
        return name if name is not None else op_type
    base = name if name is not None else f"{op_type}_{_normalize_name(default_suffix())}"
    full = _tf_ops.get_default_graph().unique_name(base)
    return full.rsplit("/", 1)[-1] if ignore_name_scope else full


def _run(what, body, inputs, out_dtypes, out_shapes, stateful=True, on_host=()):
    """Runs `body(*arrays) -> [arrays]` on `inputs` as described in the
    module doc; returns the output tensors. Eagerly, the inputs whose index
    is in `on_host` reach `body` as NumPy arrays even from a GPU."""
    if _executing_eagerly():
        arrays = bridge.as_arrays(inputs, on_host)
        results = errors.call(body, *arrays)
        return [bridge.to_tensor(r, dtype) for r, dtype in zip(results, out_dtypes)]
    if _control_flow_util.GraphOrParentsInXlaContext(_tf_ops.get_default_graph()):
        raise errors.xla_unsupported(what)

    def graph_body(*arrays):
        return [bridge.adoptable_result(r) for r in errors.graph_call(body, *arrays)]

    def create():
        outputs = tf.numpy_function(graph_body, list(inputs), list(out_dtypes),
                                    stateful=stateful)
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    outputs = ordering.in_creation_order(create) if stateful else create()
    for tensor, shape in zip(outputs, out_shapes):
        tensor.set_shape(shape)
    return outputs


def _differentiable(tensors):
    if not any(t.dtype.is_floating or t.dtype.is_complex for t in tensors):
        return False
    return not _executing_eagerly() or _record.could_possibly_record()


def _with_gradient(forward, backward, tensors):
    """forward(*tensors) -> list of outputs, recorded with gradient
    backward(inputs, outputs, grads) -> list of input gradients, when a
    gradient can be asked for (a float input, and in eager a live tape)."""
    if not _differentiable(tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def op(*xs):
        ys = forward(*xs)

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else tf.convert_to_tensor(dy)
                   for y, dy in zip(ys, dys)]
            dxs = backward(xs, ys, dys)
            return [dx if x.dtype.is_floating or x.dtype.is_complex else None
                    for x, dx in zip(xs, dxs)]

        return ys, grad

    return list(op(*tensors))


# The dtypes the core moves; reductions exclude bool. (Horovod's allreduce op
# takes int32, int64, float16, float32, float64; the core also reduces
# uint8, uint16, int8, int16 and bfloat16. Horovod's allgather, broadcast and
# alltoall take uint16 too.)
_MOVABLE = (tf.uint8, tf.uint16, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16,
            tf.bfloat16, tf.float32, tf.float64, tf.bool)
_REDUCIBLE = _MOVABLE[:-1]


def _check_dtypes(tensors, what, allowed):
    for t in tensors:
        if t.dtype not in allowed:
            raise TypeError(f"{what}: DataType {t.dtype.name} not in list of allowed values: "
                            f"{', '.join(d.name for d in allowed)}")
    return tensors


def _convert(tensors, what="collective", allowed=_MOVABLE):
    return _check_dtypes([tf.convert_to_tensor(t) for t in tensors], what, allowed)


def _refusing(kind, op_type, name, process_set, group_size=0):
    """Around an eager op's checks of its input: a refusal goes to the set's
    other ranks too, which then fail naming this rank instead of waiting
    for it (the name an eager op negotiates under does not depend on its
    tensors). In a graph the op is refused where it is built, under a name
    the graph gives it, and nothing is told.

    First, as Horovod's ops do where they are called (eagerly or built in a
    graph, where they ask the set its size): ValueError for a process set
    the coordinator does not hold, which no other rank needs to hear of. (A
    set without this rank is the op's InvalidArgumentError, as in Horovod.)"""
    rt = _core_runtime.current()
    if rt is not None:
        _core_collectives.registered(process_set, rt, kind)
    if not _executing_eagerly():
        return contextlib.nullcontext()
    return _core_collectives.refusing(kind, _op_name(op_type, None, name, False), process_set,
                                      group_size)


def _name_of(tensor):
    return lambda: tensor.name


def _group_name_of(tensors):
    return lambda: f"{tensors[0].name}_{tensors[-1].name}"


def _process_set_size(process_set):
    members = process_set.size()
    if members is None:
        raise ValueError(f"{process_set!r} is not registered; pass it to init(process_sets="
                         "...) or add_process_set() first")
    return members


# ----------------------------------------------------------------- allreduce
def _allreduce_op(tensors, op_name, single, op, prescale_factor, postscale_factor,
                  ignore_name_scope, process_set):
    def body(*arrays):
        outputs = [bridge.empty_like(a) for a in arrays]
        kwargs = dict(name=op_name, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set)
        if single:
            core.allreduce(arrays[0], output=outputs[0], **kwargs)
        else:
            core.grouped_allreduce(list(arrays), outputs=outputs, **kwargs)
        return outputs

    def forward(*xs):
        return _run("allreduce", body, xs, [x.dtype for x in xs], [x.shape for x in xs])

    def backward(xs, ys, dys):
        return _grouped_allreduce(dys, op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor,
                                  ignore_name_scope=ignore_name_scope, process_set=process_set)

    return _with_gradient(forward, backward, tensors)


def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set):
    """Reduces `tensor` over the ranks of `process_set`. `op` goes to the core
    as is (default Sum); no compression, no sparse tensors."""
    with _refusing("allreduce", "HorovodAllreduce", name, process_set):
        (tensor,) = _convert([tensor], "allreduce", _REDUCIBLE)
    op_name = _op_name("HorovodAllreduce", _name_of(tensor), name, ignore_name_scope)
    return _allreduce_op([tensor], op_name, True, op, prescale_factor, postscale_factor,
                         ignore_name_scope, process_set)[0]


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    """Reduces every tensor of `tensors` in one negotiation (the core fuses
    them); returns a list."""
    tensors = list(tensors)
    with _refusing("allreduce", "HorovodGroupedAllreduce", name, process_set, len(tensors)):
        tensors = _convert(tensors, "grouped_allreduce", _REDUCIBLE)
    if not tensors:
        return []
    op_name = _op_name("HorovodGroupedAllreduce", _group_name_of(tensors), name,
                       ignore_name_scope)
    return _allreduce_op(tensors, op_name, False, op, prescale_factor, postscale_factor,
                         ignore_name_scope, process_set)


# ----------------------------------------------------------------- allgather
def _allgather_backward(x, dy, ignore_name_scope, process_set):
    """Horovod's allgather gradient: the averaged gradient, then the slice
    this rank contributed."""
    dy = _allreduce(dy, op=Average, ignore_name_scope=ignore_name_scope,
                    process_set=process_set)
    members = _process_set_size(process_set)
    rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
    rows = tf.reshape(allgather(rows, ignore_name_scope=ignore_name_scope,
                                process_set=process_set), [members])
    return tf.split(dy, rows, axis=0, num=members)[process_set.rank()]


def _unknown_first_dim(shape):
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


def _allgather_op(tensors, op_name, single, ignore_name_scope, process_set):
    def body(*arrays):
        if single:
            return [core.allgather(arrays[0], name=op_name, process_set=process_set)]
        return core.grouped_allgather(list(arrays), name=op_name, process_set=process_set)

    def forward(*xs):
        return _run("allgather", body, xs, [x.dtype for x in xs],
                    [_unknown_first_dim(x.shape) for x in xs])

    def backward(xs, ys, dys):
        return [_allgather_backward(x, dy, ignore_name_scope, process_set)
                for x, dy in zip(xs, dys)]

    return _with_gradient(forward, backward, tensors)


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates `tensor` with the same tensor of every other rank of
    `process_set` along the first dimension, which may differ per rank; the
    other dimensions must match."""
    with _refusing("allgather", "HorovodAllgather", name, process_set):
        (tensor,) = _convert([tensor], "allgather")
    op_name = _op_name("HorovodAllgather", _name_of(tensor), name, ignore_name_scope)
    return _allgather_op([tensor], op_name, True, ignore_name_scope, process_set)[0]


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """allgather of every tensor of `tensors` in one negotiation; returns a
    list."""
    tensors = list(tensors)
    with _refusing("allgather", "HorovodGroupedAllgather", name, process_set, len(tensors)):
        tensors = _convert(tensors, "grouped_allgather")
    if not tensors:
        return []
    op_name = _op_name("HorovodGroupedAllgather", _group_name_of(tensors), name,
                       ignore_name_scope)
    return _allgather_op(tensors, op_name, False, ignore_name_scope, process_set)


# ----------------------------------------------------------------- broadcast
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns `root_rank`'s `tensor` on every rank of `process_set`.
    `root_rank` is a global rank."""
    with _refusing("broadcast", "HorovodBroadcast", name, process_set):
        (tensor,) = _convert([tensor], "broadcast")
    op_name = _op_name("HorovodBroadcast", _name_of(tensor), name, ignore_name_scope)

    def body(array):
        output = bridge.empty_like(array)
        core.broadcast(array, root_rank, name=op_name, process_set=process_set, output=output)
        return [output]

    def forward(x):
        return _run("broadcast", body, [x], [x.dtype], [x.shape])

    def backward(xs, ys, dys):
        dy = _allreduce(dys[0], op=Average, ignore_name_scope=ignore_name_scope,
                        process_set=process_set)
        # The same ops on every rank (names come from the graph): scale by 1 or 0.
        return [dy * tf.constant(1 if core.rank() == root_rank else 0, dy.dtype)]

    return _with_gradient(forward, backward, [tensor])[0]


# ------------------------------------------------------------------ alltoall
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends `splits[i]` rows of `tensor` to rank i of `process_set` (an even
    split when `splits` is None) and returns the rows received, concatenated
    in rank order; with `splits`, also the int32 tensor of rows received from
    each rank."""
    with _refusing("alltoall", "HorovodAlltoall", name, process_set):
        (tensor,) = _convert([tensor], "alltoall")
    op_name = _op_name("HorovodAlltoall", _name_of(tensor), name, ignore_name_scope)
    members = _process_set_size(process_set)

    def body(array, splits_array=None):
        output, received = core.synchronize(core.alltoall_async(
            array, splits=splits_array, name=op_name, process_set=process_set))
        return [output, np.asarray(received, np.int32)]

    def forward(x, *split_tensor):
        return _run("alltoall", body, [x] + list(split_tensor), [x.dtype, tf.int32],
                    [_unknown_first_dim(x.shape), tf.TensorShape([members])], on_host=(1,))

    def backward(xs, ys, dys):
        dx, _ = alltoall(dys[0], splits=ys[1], ignore_name_scope=ignore_name_scope,
                         process_set=process_set)
        return [dx] + [None] * (len(xs) - 1)

    inputs = [tensor]
    if splits is not None:
        inputs.append(tf.cast(tf.convert_to_tensor(splits), tf.int32))
    output, received = _with_gradient(forward, backward, inputs)
    return output if splits is None else (output, received)


# ------------------------------------------------------------- reducescatter
def _check_reducescatter_op(op):
    if op not in (Sum, Average):
        raise tf.errors.AbortedError(
            None, None, "Reducescatter currently only supports AVERAGE and SUM (got op "
            f"{op!r}).")


def _reducescatter_op(tensors, op_name, single, op, ignore_name_scope, process_set,
                      prescale_factor, postscale_factor):
    def body(*arrays):
        kwargs = dict(op=op, name=op_name, process_set=process_set,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        if single:
            return [core.reducescatter(arrays[0], **kwargs)]
        return core.grouped_reducescatter(list(arrays), **kwargs)

    def forward(*xs):
        return _run("reducescatter", body, xs, [x.dtype for x in xs],
                    [_unknown_first_dim(x.shape) for x in xs])

    def backward(xs, ys, dys):
        scale = prescale_factor * postscale_factor
        if op == Sum:
            scale *= _process_set_size(process_set)
        return [allgather(dy * tf.cast(scale, dy.dtype) if scale != 1.0 else dy,
                          ignore_name_scope=ignore_name_scope, process_set=process_set)
                for dy in dys]

    return _with_gradient(forward, backward, tensors)


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False,
                   process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` over `process_set` and leaves this rank its share of
    the first dimension (the first n % size ranks get one extra row)."""
    _check_reducescatter_op(op)
    with _refusing("reducescatter", "HorovodReducescatter", name, process_set):
        (tensor,) = _convert([tensor], "reducescatter", _REDUCIBLE)
    op_name = _op_name("HorovodReducescatter", _name_of(tensor), name, ignore_name_scope)
    return _reducescatter_op([tensor], op_name, True, op, ignore_name_scope, process_set,
                             prescale_factor, postscale_factor)[0]


def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False,
                           process_set=global_process_set, prescale_factor=1.0,
                           postscale_factor=1.0):
    """reducescatter of every tensor of `tensors` in one negotiation."""
    _check_reducescatter_op(op)
    tensors = list(tensors)
    with _refusing("reducescatter", "HorovodGroupedReducescatter", name, process_set,
                   len(tensors)):
        tensors = _convert(tensors, "grouped_reducescatter", _REDUCIBLE)
    if not tensors:
        return []
    op_name = _op_name("HorovodGroupedReducescatter", _group_name_of(tensors), name,
                       ignore_name_scope)
    return _reducescatter_op(tensors, op_name, False, op, ignore_name_scope, process_set,
                             prescale_factor, postscale_factor)


# --------------------------------------------------------- join and barrier
def join():
    """Marks this rank as done with its data: until every rank has joined it
    takes part in the others' allreduces with zeros. Returns (an int32
    scalar tensor) the rank that joined last."""
    def body():
        return [np.asarray(core.join(), np.int32)]

    return _run("join", body, [], [tf.int32], [tf.TensorShape([])])[0]


def barrier(process_set=global_process_set):
    """Blocks until every rank of `process_set` has reached the barrier.
    Inside a tf.function it is a stateful op, so it runs in program order."""
    def body():
        core.barrier(process_set=process_set)
        return [np.zeros((), np.int32)]

    _run("barrier", body, [], [tf.int32], [tf.TensorShape([])])


# ------------------------------------------------- queries as graph-time ops
def _query_op(fn, name):
    if _executing_eagerly():
        return tf.constant(errors.call(fn), dtype=tf.int32, name=name)

    def body():
        return [np.asarray(fn(), np.int32)]

    return _run(name or "query", body, [], [tf.int32], [tf.TensorShape([])], stateful=False)[0]


def size_op(process_set_id=0, name=None):
    """The size of a process set (default: all ranks), read when the op runs."""
    def fn():
        if process_set_id == 0:
            return core.size()
        ps = _registered_process_set(process_set_id)
        return ps.size()

    return _query_op(fn, name)


def local_size_op(name=None):
    """The number of ranks on this host, read when the op runs."""
    return _query_op(core.local_size, name)


def rank_op(name=None):
    """This process's rank, read when the op runs."""
    return _query_op(core.rank, name)


def local_rank_op(name=None):
    """This process's rank on its host, read when the op runs."""
    return _query_op(core.local_rank, name)


HOROVOD_PROCESS_SET_ERROR_INIT = -1
HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET = -2


def process_set_included_op(process_set_id=0, name=None):
    """1 if this process belongs to the process set, 0 if not; -1 before
    init, -2 for an unknown set (Horovod's codes)."""
    def fn():
        if not core.is_initialized():
            return HOROVOD_PROCESS_SET_ERROR_INIT
        if process_set_id == 0:
            return 1
        try:
            ps = _registered_process_set(process_set_id)
        except ValueError:
            return HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET
        return int(bool(ps.included()))

    return _query_op(fn, name)


def _registered_process_set(process_set_id):
    from coordinator import runtime

    rt = runtime.current()
    ps = rt.process_sets.get(process_set_id) if rt is not None else None
    if ps is None:
        raise ValueError(f"process set {process_set_id} is not registered")
    return ps


# Also in Horovod's TensorFlow mpi_ops: the life-cycle and query functions,
# the process-set calls, its helpers, the in-place broadcast and `_basics`.
from coordinator import ProcessSet, add_process_set, remove_process_set  # noqa: E402,F401
from coordinator.collectives import handle_average_backwards_compatibility  # noqa: E402,F401
from frontends._util import (Basics, check_num_rank_power_of_2,  # noqa: E402,F401
                             get_average_backwards_compatibility_fun, gpu_available,
                             num_rank_is_power_2)
from frontends.tensorflow.basics import (ccl_built, cross_rank, cross_size,  # noqa: E402,F401
                                         cuda_built, ddl_built, gloo_built, gloo_enabled,
                                         init, is_homogeneous, is_initialized, local_rank,
                                         local_size, mpi_built, mpi_enabled,
                                         mpi_threads_supported, nccl_built, rank,
                                         rocm_built, shutdown, size, start_timeline,
                                         stop_timeline)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """frontends.tensorflow.broadcast_ (in place), where Horovod has it."""
    from frontends.tensorflow import functions

    return functions.broadcast_(variables, root_rank, name=name, process_set=process_set)


_basics = Basics(globals())
