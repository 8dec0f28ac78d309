"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged
across ranks.

`DistributedGradientTape(tape)` returns an object of a subclass of the tape's
own class that shares the recorded state of `tape` (wrap it after the `with`
block, or wrap a fresh tape and use the result as the context manager). Its
`gradient()` computes the local gradients, then reduces them (see
gradients.py). Eagerly the reduction runs at once; inside a tf.function it
becomes one Python op in the graph.
"""

import tensorflow as tf

from coordinator.process_sets import global_process_set
from frontends.tensorflow import gradients
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.mpi_ops import Average

_TAPE_CLASSES = {}


class _DistributedTape:
    """Mixed in front of the wrapped tape's class."""

    def register_local_source(self, source):
        """Marks `source` as local to this rank: its gradient is not reduced."""
        self._hvd_local_sources.add(gradients.source_key(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        # (Horovod's order: use_generic_names is the fourth; tf.GradientTape's
        # unconnected_gradients, which Horovod's tape lacks, comes after it.)
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = gradients.reduce_except_local(
            self._hvd_reducer, flat_grads, flat_sources, self._hvd_local_sources,
            self._hvd_scale_local_gradients, use_generic_names)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """([(local source, grad)], [(shared source, grad)])."""
        grads = self.gradient(target, sources, output_gradients=output_gradients,
                              use_generic_names=use_generic_names)
        local, shared = [], []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if gradients.source_key(s) in self._hvd_local_sources else shared).append(
                (s, g))
        return local, shared


def _distributed_class(tape_class):
    cls = _TAPE_CLASSES.get(tape_class)
    if cls is None:
        cls = type(tape_class.__name__, (_DistributedTape, tape_class),
                   {"__module__": tape_class.__module__, "_hvd_wrapped_class": tape_class})
        _TAPE_CLASSES[tape_class] = cls
    return cls


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wraps `gradtape` so that `gradient()` averages (op) the gradients over
    the ranks of `process_set`.

    compression: Compression.none or Compression.fp16.
    sparse_as_dense: reduce IndexedSlices gradients as dense tensors.
    gradient_predivide_factor: with Average, scale by 1/f before the sum
        and f/size after it.
    groups: int, or list of lists of variables (see gradients.py).
    device_dense/device_sparse: accepted for compatibility (host only)."""
    groups = gradients.check_groups(groups, num_groups)
    reducer = gradients.GradientReducer("DistributedGradientTape", compression,
                                        sparse_as_dense, op, gradient_predivide_factor, groups,
                                        process_set)
    if isinstance(gradtape, _DistributedTape):
        base = type(gradtape)._hvd_wrapped_class
    else:
        base = type(gradtape)
    tape = object.__new__(_distributed_class(base))
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reducer = reducer
    tape._hvd_local_sources = set(getattr(gradtape, "_hvd_local_sources", ()))
    tape._hvd_scale_local_gradients = scale_local_gradients
    tape.process_set = process_set
    tape.scale_local_gradients = scale_local_gradients
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that leaves the gradients of `local_layers`
    (Keras layers) on each rank unreduced."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
