"""create_multi_node_evaluator: an Evaluator whose results are means over ranks.

Each rank evaluates its own share of the validation data; the patched
`evaluate` then averages every reported value over the ranks with an
allreduce per key on the coordinator (fused; named by key, so later
evaluations hit the response cache). Ranks must report the same keys; when they do not,
every rank raises a ValueError that lists what each reported.
"""

import types

import numpy as np

import chainer
import coordinator as hvd


def _as_array(value):
    if isinstance(value, chainer.Variable):
        value = value.array
    arr = np.asarray(value)
    if arr.dtype.kind not in "f":
        arr = arr.astype(np.float64)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def mean_over_ranks(communicator, values, tag="eval"):
    """{key: mean over the communicator's ranks of values[key]}; arrays keep
    their shape and float dtype, scalars come back as NumPy scalars."""
    keys = sorted(values)
    everyone = communicator.mpi_comm.allgather(keys)
    if any(k != keys for k in everyone):
        listing = "; ".join(f"rank {r}: {k}" for r, k in enumerate(everyone))
        raise ValueError(f"multi-node evaluator: ranks reported different keys ({listing})")
    if not keys:
        return {}
    arrays = [_as_array(values[k]) for k in keys]
    prefix = f"{communicator._prefix}.{tag}"
    handles = [hvd.allreduce_async(arr, op=hvd.Average, name=f"{prefix}.{key}",
                                   process_set=communicator.process_set)
               for key, arr in zip(keys, arrays)]
    means = [hvd.synchronize(h) for h in handles]
    out = {}
    for key, mean in zip(keys, means):
        original = values[key]
        is_array = isinstance(original, (np.ndarray, chainer.Variable))
        out[key] = mean if is_array and mean.ndim else mean[()]
    return out


def create_multi_node_evaluator(actual_evaluator, communicator):
    """Patches `actual_evaluator` (e.g. chainer.training.extensions.Evaluator)
    so that `evaluate()` returns the mean over ranks of its local results,
    and returns it. Give each rank its part of the validation set (e.g. with
    scatter_dataset); the mean of per-rank means equals the global mean when
    the parts have equal sizes."""
    actual_evaluator._mn_original_evaluate = actual_evaluator.evaluate
    actual_evaluator._mn_communicator = communicator

    def evaluate(self):
        return mean_over_ranks(self._mn_communicator, self._mn_original_evaluate())

    actual_evaluator.evaluate = types.MethodType(evaluate, actual_evaluator)
    return actual_evaluator
