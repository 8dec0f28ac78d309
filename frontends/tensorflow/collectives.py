"""Horovod's public reductions for TensorFlow: allreduce and reducescatter
with compression, op/average handling and tf.IndexedSlices.

A tf.IndexedSlices is reduced as Horovod does it: its values and indices are
gathered from every rank (two allgathers) and, for Average, the values are
divided by the set's size. Summing duplicate indices is left to whoever
applies the slices, as with any IndexedSlices.
"""

import tensorflow as tf

from coordinator.collectives import handle_average_backwards_compatibility
from coordinator.process_sets import global_process_set
from frontends.tensorflow import mpi_ops
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.mpi_ops import Adasum, Average, Sum


def _check_sparse(op, prescale_factor, postscale_factor):
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                  "tensors. As a workaround please pass sparse_as_dense=True "
                                  "to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with "
                                  "tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with "
                                  "tf.IndexedSlices")


def _check_adasum(process_set):
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")


def _average_values(values, op, process_set):
    if op != Average:
        return values
    return values / tf.cast(mpi_ops._process_set_size(process_set), values.dtype)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduces a tf.Tensor, tf.Variable or tf.IndexedSlices over the ranks
    of `process_set`; op defaults to Average. The result is
    postscale * op(prescale * tensor). `device_dense`/`device_sparse` are
    accepted for compatibility: collectives run on the host."""
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        values = mpi_ops.allgather(tensor.values, process_set=process_set,
                                   ignore_name_scope=ignore_name_scope)
        indices = mpi_ops.allgather(tensor.indices, process_set=process_set,
                                    ignore_name_scope=ignore_name_scope)
        return tf.IndexedSlices(_average_values(values, op, process_set), indices,
                                dense_shape=tensor.dense_shape)
    if op == Adasum:
        _check_adasum(process_set)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = mpi_ops._allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set,
                                 ignore_name_scope=ignore_name_scope)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """allreduce of a list of tensors (dense and IndexedSlices may be mixed)
    in one negotiation per kind; returns a list in the same order."""
    if not tensors:
        return tensors
    op = handle_average_backwards_compatibility(op, average)
    results = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        values = mpi_ops.grouped_allgather([tensors[i].values for i in sparse],
                                           process_set=process_set,
                                           ignore_name_scope=ignore_name_scope)
        indices = mpi_ops.grouped_allgather([tensors[i].indices for i in sparse],
                                            process_set=process_set,
                                            ignore_name_scope=ignore_name_scope)
        for i, v, idx in zip(sparse, values, indices):
            results[i] = tf.IndexedSlices(_average_values(v, op, process_set), idx,
                                          dense_shape=tensors[i].dense_shape)
    if dense:
        if op == Adasum:
            _check_adasum(process_set)
        compressed, ctxs = zip(*[compression.compress(tf.convert_to_tensor(tensors[i]))
                                 for i in dense])
        reduced = mpi_ops._grouped_allreduce(list(compressed), name=name, op=op,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor,
                                             process_set=process_set,
                                             ignore_name_scope=ignore_name_scope)
        for i, r, ctx in zip(dense, reduced, ctxs):
            results[i] = compression.decompress(r, ctx)
    return results


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` over `process_set` (Sum or Average, the default) and
    returns this rank's share of the first dimension; the first n % size
    ranks get one extra row."""
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = mpi_ops._reducescatter(compressed, name=name, op=op,
                                     ignore_name_scope=ignore_name_scope,
                                     process_set=process_set, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, name=None, ignore_name_scope=False):
    """reducescatter of a list of tensors in one negotiation; returns a list."""
    if not tensors:
        return tensors
    compressed, ctxs = zip(*[compression.compress(tf.convert_to_tensor(t)) for t in tensors])
    reduced = mpi_ops._grouped_reducescatter(list(compressed), name=name, op=op,
                                             ignore_name_scope=ignore_name_scope,
                                             process_set=process_set,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor)
    return [compression.decompress(r, ctx) for r, ctx in zip(reduced, ctxs)]
