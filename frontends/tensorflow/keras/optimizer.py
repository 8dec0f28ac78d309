"""DistributedOptimizer for Keras 3.

A Keras 3 optimizer updates variables in `apply(grads, variables)`;
`apply_gradients(grads_and_vars)` and `model.fit`'s train step go through it.
The distributed optimizer is a subclass of the wrapped optimizer's own class,
made on the fly (as Horovod does), whose `apply` averages the gradients
across ranks before the wrapped class's `apply` clips, unscales (loss
scaling), decays and steps. It keeps the class name, module and config of
the wrapped optimizer, so a saved model loads without this package and its
variables are exactly the wrapped optimizer's.

backward_passes_per_step = N > 1 accumulates gradients locally and reduces
and applies them on every N-th call (summed, or averaged over the N passes
with average_aggregated_gradients); the calls in between only advance
`iterations`, as in Horovod. The accumulators are plain tf.Variables kept out
of the optimizer's tracked variables, so checkpoints keep the wrapped
optimizer's layout.
"""

import tensorflow as tf

from coordinator.process_sets import global_process_set
from frontends.tensorflow import gradients
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.mpi_ops import Adasum, Average, Sum

_CLASSES = {}


class _Settings:
    """Horovod's state of one distributed optimizer (a plain object, so
    Keras and TensorFlow do not track what it holds)."""

    def __init__(self, reducer, backward_passes_per_step, average_aggregated_gradients,
                 sparse_as_dense, scale_local_gradients):
        self.reducer = reducer
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.scale_local_gradients = scale_local_gradients
        self.local_keys = set()
        self.accumulators = None  # one tf.Variable per trainable variable

    def make_accumulators(self, variables):
        if self.accumulators is None:
            with tf.init_scope():
                self.accumulators = [
                    tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                name="horovod_gradient_accumulator")
                    for v in variables]
        return self.accumulators


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class."""

    _HAS_AGGREGATE_GRAD = True

    def register_local_var(self, var):
        """Marks `var` as local to this rank: its gradient is not reduced."""
        self._hvd.local_keys.add(gradients.source_key(var))

    def build(self, variables):
        super().build(variables)
        if self._hvd.backward_passes_per_step > 1:
            self._hvd.make_accumulators(list(variables))

    def _hvd_reduce(self, grads, variables):
        hvd = self._hvd
        return gradients.reduce_except_local(hvd.reducer, grads, variables, hvd.local_keys,
                                             hvd.scale_local_gradients)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        elif self.built:
            variables = list(self._trainable_variables)
        else:  # let the wrapped optimizer raise its own error
            return super().apply(grads, trainable_variables)
        if self._hvd.backward_passes_per_step > 1:
            return self._hvd_accumulate_and_apply(grads, trainable_variables, variables)
        return super().apply(self._hvd_reduce(grads, variables), trainable_variables)

    def _hvd_accumulate_and_apply(self, grads, trainable_variables, variables):
        hvd = self._hvd
        if not self.built:
            with tf.name_scope(self.name):
                self.build(variables)
        accumulators = hvd.make_accumulators(list(self._trainable_variables))
        index = {gradients.source_key(v): i for i, v in enumerate(self._trainable_variables)}
        mine = [accumulators[index[gradients.source_key(v)]] for v in variables]
        present = []
        for g, acc in zip(grads, mine):
            if g is None:
                present.append(False)
                continue
            if isinstance(g, tf.IndexedSlices):
                if not hvd.sparse_as_dense:
                    raise ValueError("IndexedSlices are not supported when "
                                     "`backward_passes_per_step` > 1 and `sparse_as_dense` is "
                                     "False.")
                g = tf.convert_to_tensor(g)
            acc.assign_add(tf.cast(g, acc.dtype))
            present.append(True)
        passes = hvd.backward_passes_per_step

        def reduce_and_apply():
            summed = [acc.read_value() if p else None for acc, p in zip(mine, present)]
            reduced = self._hvd_reduce(summed, variables)
            if hvd.average_aggregated_gradients:
                reduced = [None if r is None else r / passes for r in reduced]
            super(_DistributedOptimizer, self).apply(reduced, trainable_variables)
            for acc in mine:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        def count_pass():
            self._iterations.assign_add(1)
            return tf.constant(False)

        last_pass = tf.equal((self._iterations + 1) % passes, 0)
        tf.cond(last_pass, reduce_and_apply, count_pass)


def _distributed_class(cls):
    dist = _CLASSES.get(cls)
    if dist is None:
        dist = type(cls.__name__, (_DistributedOptimizer, cls),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                     "_hvd_wrapped_class": cls})
        _CLASSES[cls] = dist
    return dist


def _settings(cls, name, compression, sparse_as_dense, gradient_predivide_factor, op,
              backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
              process_set, scale_local_gradients):
    if op not in (Average, Sum, Adasum):
        raise ValueError("op currently only supports Average, Sum and Adasum")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    groups = gradients.check_groups(groups, num_groups)
    # As Horovod's Keras optimizer: the factor splits Average's division, and
    # a Sum has none to split, so it is left out there rather than refused.
    predivide = gradient_predivide_factor if op == Average else 1.0
    reducer = gradients.GradientReducer(name or f"Distributed{cls.__name__}", compression,
                                        sparse_as_dense, op, predivide, groups, process_set)
    return _Settings(reducer, backward_passes_per_step, average_aggregated_gradients,
                     sparse_as_dense, scale_local_gradients)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of the Keras 3 `optimizer` (same class, same config; its state
    is not copied) that averages gradients over the ranks of `process_set`
    before applying them.

    op: Average (default) or Sum. compression: Compression.none or .fp16.
    sparse_as_dense: reduce IndexedSlices gradients as dense tensors.
    gradient_predivide_factor: with Average, scale by 1/f before the sum and
        f/size after it.
    backward_passes_per_step, average_aggregated_gradients: see the module doc.
    groups: int, or list of lists of variables (gradients.py).
    name: prefix of the allreduce ops' names (default "Distributed<Class>").
    device_dense/device_sparse: accepted for compatibility (host only)."""
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    cls = type(optimizer)
    settings = _settings(cls, name, compression, sparse_as_dense, gradient_predivide_factor, op,
                         backward_passes_per_step, average_aggregated_gradients, num_groups,
                         groups, process_set, scale_local_gradients)
    distributed = _distributed_class(cls).from_config(optimizer.get_config())
    distributed._hvd = settings
    distributed.process_set = process_set
    return distributed


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                num_groups=0, groups=None, process_set=global_process_set,
                                scale_local_gradients=True, local_layers=None):
    """A DistributedOptimizer that leaves the gradients of `local_layers`
    (a Keras layer or a list of them) unreduced on each rank, for models
    that are partly model-parallel; the other arguments are
    DistributedOptimizer's."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    distributed = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            distributed.register_local_var(var)
    return distributed


def make_distributed_in_place(optimizer, compression=Compression.none, **kwargs):
    """Turns `optimizer` itself, with its variables and state, into a
    DistributedOptimizer (used by load_model). Keyword arguments as for
    DistributedOptimizer."""
    if isinstance(optimizer, _DistributedOptimizer):
        return optimizer
    cls = type(optimizer)
    options = dict(name=None, sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                   backward_passes_per_step=1, average_aggregated_gradients=False,
                   num_groups=0, groups=None, process_set=global_process_set,
                   scale_local_gradients=True)
    options.update(kwargs)
    settings = _settings(cls, compression=compression, **options)
    optimizer.__class__ = _distributed_class(cls)
    optimizer._hvd = settings
    optimizer.process_set = options["process_set"]
    if settings.backward_passes_per_step > 1 and optimizer.built:
        settings.make_accumulators(list(optimizer._trainable_variables))
    return optimizer
