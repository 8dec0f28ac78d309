"""Averaging gradients across ranks: what DistributedGradientTape and the
Keras DistributedOptimizer share.

By default every dense gradient of a step goes into ONE grouped allreduce: one
Python op, one negotiation, and the core fuses the tensors into one buffer.
(Horovod issues one allreduce per gradient and lets its background thread
fuse them; the result is the same, but here each op costs a Python call.)
`groups` keeps Horovod's meaning: an int splits the gradients into that many
grouped allreduces, a list of variable lists makes each list one group and
every other gradient a group of its own. IndexedSlices gradients are
gathered, unless `sparse_as_dense` turns them into dense tensors first.

Sources registered as local are not reduced; with `scale_local_gradients`
their gradient is divided by the set's size, as Horovod does, so it has the
same scale as the averaged ones.
"""

import tensorflow as tf

from frontends._util import split_list
from frontends.tensorflow import collectives, mpi_ops
from frontends.tensorflow.mpi_ops import Average


def source_key(source):
    """A hashable key for a variable or tensor (Keras 3 variables are not
    hashable; they wrap a tf.Variable, which has `ref()`)."""
    if hasattr(source, "ref"):
        return source.ref()
    inner = getattr(source, "value", None)
    if inner is not None and hasattr(inner, "ref"):
        return inner.ref()
    return id(source)


def check_groups(groups, num_groups):
    if num_groups:
        import warnings

        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "tf.Variable.")
    return groups


def _split_evenly(items, n):
    return [chunk for chunk in split_list(items, n) if chunk]


class GradientReducer:
    """Reduces a list of gradients (with their variables) across ranks."""

    def __init__(self, name, compression, sparse_as_dense, op, gradient_predivide_factor,
                 groups, process_set):
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        # Average = Sum scaled by postscale/size: split the division around it.
        self.prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale = gradient_predivide_factor if op == Average else 1.0
        self.groups = groups
        self.process_set = process_set

    def _index_groups(self, grads, variables):
        present = [i for i, g in enumerate(grads) if g is not None]
        if self.groups is None:
            return [present] if present else []
        if isinstance(self.groups, list):
            position = {source_key(variables[i]): i for i in present}
            chosen, out = set(), []
            for group in self.groups:
                members = [position[source_key(v)] for v in group
                           if source_key(v) in position and position[source_key(v)] not in chosen]
                chosen.update(members)
                if members:
                    out.append(sorted(members))
            out.extend([i] for i in present if i not in chosen)
            return out
        return _split_evenly(present, int(self.groups))

    def __call__(self, grads, variables=None, use_generic_names=False):
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        ps = self.process_set
        if not ps.included() or mpi_ops._process_set_size(ps) <= 1:
            return grads
        out = list(grads)
        with tf.name_scope(self.name + "_Allreduce"):
            for k, indices in enumerate(self._index_groups(grads, variables)):
                reduced = collectives.grouped_allreduce(
                    [grads[i] for i in indices], compression=self.compression, op=self.op,
                    prescale_factor=self.prescale, postscale_factor=self.postscale,
                    process_set=ps, name=f"grad_{k}" if use_generic_names else None,
                    ignore_name_scope=use_generic_names)
                for i, r in zip(indices, reduced):
                    out[i] = r
        return out


def reduce_except_local(reducer, grads, variables, local_keys, scale_local_gradients,
                        use_generic_names=False):
    """Reduces the gradients of non-local variables with `reducer`; local
    ones are kept (divided by the set's size when `scale_local_gradients`)."""
    grads = list(grads)
    shared = [i for i, v in enumerate(variables) if source_key(v) not in local_keys]
    reduced = reducer([grads[i] for i in shared], [variables[i] for i in shared],
                      use_generic_names)
    out = list(grads)
    for i, g in zip(shared, reduced):
        out[i] = g
    if scale_local_gradients and local_keys:
        size = mpi_ops._process_set_size(reducer.process_set)
        for i, v in enumerate(variables):
            g = out[i]
            if g is None or source_key(v) not in local_keys:
                continue
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
            else:
                out[i] = g / size
    return out
