"""Horovod's TensorFlow 1 API, for tf.compat.v1 graphs run by a Session
(TensorFlow 2.21 still ships them): broadcast_global_variables,
BroadcastGlobalVariablesHook, and the DistributedOptimizer of a
tf.compat.v1.train.Optimizer.

    opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.001))
    train_op = opt.minimize(loss, global_step=global_step)
    hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
        ...

The optimizer reduces in `compute_gradients` (which `minimize` calls), with
the reducer the gradient tape and the Keras optimizer use (gradients.py);
`apply_gradients` is the wrapped optimizer's. backward_passes_per_step > 1
is legacy_aggregation.py (graphs only, as in Horovod). With op=Adasum the
wrapped optimizer steps on local gradients, and every
backward_passes_per_step steps the ranks combine with Adasum how far their
variables moved since the last exchange. Both optimizers also work eagerly
(minimize with a callable loss).

The broadcast of the global variables is created apart from the graph's
other collectives (ordering.apart): a program creates it after its training
step and runs it on its own, without the step's feeds.

Deliberate difference from Horovod 0.28.1: its Adasum optimizer forwards
apply_gradients to the wrapped optimizer, so its own exchange never runs (and
is written with TensorFlow 1 names TensorFlow 2 lacks); here the exchange
runs as that class describes it.
"""

import tensorflow as tf

from coordinator.process_sets import global_process_set
from frontends.tensorflow import collectives, gradients, ordering
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.functions import broadcast_variables
from frontends.tensorflow.legacy_aggregation import LocalAggregation
from frontends.tensorflow.mpi_ops import Adasum, Average, _executing_eagerly


def broadcast_global_variables(root_rank):
    """The op that sets every global variable of the default graph to its
    value on `root_rank`; run it in a session of its own (after the
    variables are initialized). TensorFlow 1 graphs only."""
    if _executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` "
                           "instead.")
    with ordering.apart():
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the global variables from `root_rank` once the session is
    created (and the variables initialized or restored), so that every rank
    starts from the same values."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self.bcast_op.graph is not graph:
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer: compute_gradients reduces the
    gradients across the ranks of `process_set`; the rest is the wrapped
    optimizer's."""

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="",
                 device_sparse="", compression=Compression.none, sparse_as_dense=False,
                 op=Average, gradient_predivide_factor=1.0, backward_passes_per_step=1,
                 average_aggregated_gradients=False, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        name = name or f"Distributed{type(optimizer).__name__}"
        super().__init__(use_locking, name)
        self._optimizer = optimizer
        self._reducer = gradients.GradientReducer(name, compression, sparse_as_dense, op,
                                                  gradient_predivide_factor, groups,
                                                  process_set)
        self._local_keys = set()
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._aggregation = None
        if backward_passes_per_step > 1:
            if _executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not yet supported for "
                                 "_LegacyOptimizer with eager execution.")
            self._aggregation = LocalAggregation(backward_passes_per_step,
                                                 average_aggregated_gradients,
                                                 sparse_as_dense, name)

    def register_local_var(self, var):
        """Marks `var` as local to this rank: its gradient is not reduced
        (and is divided by the set's size with scale_local_gradients)."""
        self._local_keys.add(gradients.source_key(var))

    def _reduce(self, grads, variables):
        return gradients.reduce_except_local(self._reducer, grads, variables,
                                             self._local_keys, self.scale_local_gradients)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's (gradient, variable) pairs, with the
        gradients reduced across ranks (None stays None)."""
        grads_and_vars = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not grads_and_vars:
            return grads_and_vars
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        if self._aggregation is None:
            reduced = self._reduce(grads, variables)
        else:
            reduced = self._aggregation.compute_gradients(grads, variables, self._reduce)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's apply_gradients (with
        backward_passes_per_step > 1, on every N-th pass only)."""
        if self._aggregation is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        grads_and_vars = list(grads_and_vars)
        return self._aggregation.apply_gradients(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                    name=name),
            grads_and_vars, global_step)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class _DistributedAdasumOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train.Optimizer that steps on local gradients;
    every `backward_passes_per_step` steps the ranks combine with Adasum how
    far each variable moved since the last exchange (slot "delta_start" holds
    where it was), and every rank continues from the combined point."""

    def __init__(self, optimizer, name=None, use_locking=False, device_dense="",
                 device_sparse="", compression=Compression.none, backward_passes_per_step=1):
        name = name or f"DistributedDelta{type(optimizer).__name__}"
        super().__init__(use_locking, name)
        self._optimizer = optimizer
        self._compression = compression
        self._backward_passes_per_step = backward_passes_per_step

    def compute_gradients(self, *args, **kwargs):
        return self._optimizer.compute_gradients(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's step, then, on every
        backward_passes_per_step-th call, the exchange."""
        grads_and_vars = list(grads_and_vars)
        variables = [v for g, v in grads_and_vars if g is not None]
        if not variables:  # the wrapped optimizer says so
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        with tf.init_scope():
            starts = [self._zeros_slot(v, "delta_start", self._name) for v in variables]
            steps = self._create_non_slot_variable(0, "delta_steps", variables[0])
        step = steps.read_value()

        def remember_starts():
            return tf.group(*[s.assign(v, read_value=False) for s, v in zip(starts, variables)])

        first = tf.cond(tf.equal(step, 0), remember_starts, tf.no_op)
        with tf.control_dependencies([first]):
            update = self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        passes = self._backward_passes_per_step
        with tf.control_dependencies([update]):
            exchanged = tf.cond(tf.equal(step % passes, passes - 1),
                                lambda: self._exchange(starts, variables), tf.no_op)
        with tf.control_dependencies([exchanged]):
            return steps.assign_add(1, read_value=False)

    def _exchange(self, starts, variables):
        deltas = [v - s for v, s in zip(variables, starts)]
        combined = collectives.grouped_allreduce(deltas, compression=self._compression,
                                                 op=Adasum)
        moved = [s.assign_add(d) for s, d in zip(starts, combined)]
        return tf.group(*[v.assign(m, read_value=False) for v, m in zip(variables, moved)])

    def get_slot(self, var, name):
        """This optimizer's slot ("delta_start"), else the wrapped one's."""
        slot = super().get_slot(var, name)
        return slot if slot is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return super().get_slot_names() + self._optimizer.get_slot_names()

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def distributed_optimizer(optimizer, name, use_locking, compression, sparse_as_dense,
                          backward_passes_per_step, op, gradient_predivide_factor,
                          average_aggregated_gradients, groups, process_set,
                          scale_local_gradients):
    """hvd.DistributedOptimizer for a tf.compat.v1.train.Optimizer, after
    hvd.DistributedOptimizer checked its arguments."""
    if op == Adasum:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support process sets yet")
        return _DistributedAdasumOptimizer(optimizer, name, use_locking,
                                           compression=compression,
                                           backward_passes_per_step=backward_passes_per_step)
    return _DistributedOptimizer(
        optimizer, name, use_locking, compression=compression, sparse_as_dense=sparse_as_dense,
        op=op, gradient_predivide_factor=gradient_predivide_factor,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
