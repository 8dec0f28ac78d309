"""`horovod.tensorflow.util`: the small helpers Horovod's TensorFlow module
exposes and scripts written for it reach (`hvd.util._executing_eagerly()`).
"""

import tensorflow as tf

from frontends.tensorflow.mpi_ops import _executing_eagerly

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars"]


def _make_subgraph(f):
    """`f` as a tf.function."""
    return tf.function(f)


def _cache(f):
    """`f` memoized on its (hashable) arguments and on whether it runs
    eagerly: a graph built once per mode."""
    results = {}

    def cached(*args):
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return cached


class _Ref:
    """A hashable reference, by identity, to a variable that has no `ref()`
    (a Keras 3 variable, which cannot be hashed)."""

    __slots__ = ("_variable",)

    def __init__(self, variable):
        self._variable = variable

    def deref(self):
        return self._variable

    def __hash__(self):
        return id(self._variable)

    def __eq__(self, other):
        return isinstance(other, _Ref) and other._variable is self._variable


def vars_to_refs(vars):  # (Horovod's parameter name, shadowing the builtin)
    """Hashable references to `vars` (nested lists become tuples)."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    ref = getattr(vars, "ref", None)
    return ref() if callable(ref) else _Ref(vars)


def refs_to_vars(refs):
    """The variables behind `vars_to_refs`' references."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    deref = getattr(refs, "deref", None)
    return deref() if callable(deref) else refs
