"""Broadcasting variables and Python objects (Horovod's tensorflow.functions).

Eagerly, broadcast_variables submits every variable's broadcast before
waiting for any, so they negotiate together and the core fuses them; each
result arrives in an aligned buffer that becomes a tensor without a copy, and
`assign` makes the one copy into the variable. Inside a tf.function each
variable gets a broadcast op and an assign.

Objects travel as cloudpickle bytes, one exchange each on the core
(coordinator/objects.py).
"""

import tensorflow as tf

import coordinator as core
from coordinator import objects
from coordinator.process_sets import global_process_set
from frontends.tensorflow import errors, mpi_ops
from frontends.tensorflow import tensor_bridge as bridge


def _variable_name(var):
    return getattr(var, "path", None) or var.name


def _broadcast_eagerly(variables, root_rank, process_set, prefix):
    pending = []
    try:
        values = [tf.convert_to_tensor(var) for var in variables]
        arrays = bridge.as_arrays(values)  # (GPU values: one device synchronisation)
        for i, (var, value, array) in enumerate(zip(variables, values, arrays)):
            output = bridge.empty_like(array)
            name = f"{prefix}.{i}.{mpi_ops._normalize_name(_variable_name(var))}"
            handle = core.broadcast_async(array, root_rank, name=name,
                                          process_set=process_set, output=output)
            # `value` stays referenced until the broadcast has read it.
            pending.append((var, value, output, handle))
        for var, _, output, handle in pending:
            core.synchronize(handle)
            var.assign(bridge.to_tensor(output, var.dtype))
    except Exception as exc:  # noqa: BLE001 - translated to Horovod's tf.errors types
        translated = errors.translate(exc)
        if translated is exc:
            raise
        raise translated from exc


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Sets every variable to its value on `root_rank` (a global rank), on
    every rank of `process_set`. `inplace` is accepted for compatibility;
    the values always arrive in new buffers and are assigned. Inside a
    tf.function returns the op grouping the assignments."""
    variables = list(variables)
    if tf.executing_eagerly():
        _broadcast_eagerly(variables, root_rank, process_set, "HorovodBroadcastVariables")
        return None
    return tf.group(*[var.assign(mpi_ops.broadcast(var, root_rank, process_set=process_set))
                      for var in variables])


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Broadcasts `variables` from `root_rank` into themselves and returns
    their new values."""
    variables = list(variables)
    if tf.executing_eagerly():
        _broadcast_eagerly(variables, root_rank, process_set,
                           name or "HorovodBroadcastInplace")
        return [tf.convert_to_tensor(v) for v in variables]
    return [var.assign(mpi_ops.broadcast(var, root_rank, process_set=process_set))
            for var in variables]


def _outside_tf_function(what):
    """Objects are exchanged on the host when the call is made: eagerly, or
    with a TF1 graph as the default one (tf.compat.v1, where Horovod ran
    them through a session; the core needs none). Not while a tf.function is
    traced: the exchange would run once, at tracing, not at each call."""
    if tf.inside_function():
        raise RuntimeError(f"{what} works on Python objects and runs at once; call it "
                           "outside tf.function")


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Returns `root_rank`'s `obj` (pickled with cloudpickle) on every rank
    of `process_set`, in one exchange on the core (coordinator/objects.py).
    `session` is accepted for compatibility (TF1). Unlike Horovod's, the
    default name does not depend on `obj`'s type, so the others may pass
    None."""
    _outside_tf_function("broadcast_object")
    return errors.call(objects.broadcast_object, obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that returns `root_rank`'s object on every rank of
    `process_set`, call after call, as broadcast_object does (Horovod built
    it for TF1 sessions; the core needs no session, so it also works
    eagerly). Every call exchanges under the same name, `name` or
    'broadcast_object_fn'."""
    name = name or "broadcast_object_fn"

    def _bcast(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return _bcast


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Returns the list of every rank's `obj` (pickled with cloudpickle), in
    rank order of `process_set`: one exchange on the core."""
    _outside_tf_function("allgather_object")
    return errors.call(objects.allgather_object, obj, name, process_set)
