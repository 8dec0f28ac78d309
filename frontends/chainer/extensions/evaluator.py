"""Evaluation over ranks, ChainerMN's two ways.

`create_multi_node_evaluator`: an Evaluator whose results are means over
ranks. Each rank evaluates its own share of the validation data; the
patched `evaluate` then averages every reported value over the ranks with
an allreduce per key on the coordinator (fused; named by key, so later
evaluations hit the response cache). Ranks must report the same keys; when
they do not, every rank raises a ValueError that lists what each reported.

`GenericMultiNodeEvaluator`: for results a mean cannot combine (a median,
per-example outputs, a metric over the whole set) and for shares of
different sizes. Every rank runs `calc_local` on its batches; the root
receives every result and hands them to `aggregate` once.
"""

import copy
import types

import numpy as np

import chainer
import coordinator as hvd
from chainer.dataset import convert
from coordinator import gpu
from chainer.training import extension
from chainer.utils import argument
from frontends.chainer._checks import check_root


def _as_array(value):
    if isinstance(value, chainer.Variable):
        value = value.array
    # A CuPy array (what Chainer's reporter gives on a GPU) stays on its
    # device, where the core reduces it; np.asarray would refuse it.
    arr = value if gpu.is_device_array(value) else np.asarray(value)
    if arr.dtype.kind not in "f":
        arr = arr.astype(np.float64)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def mean_over_ranks(communicator, values, tag="eval"):
    """{key: mean over the communicator's ranks of values[key]}; arrays keep
    their shape and float dtype, scalars come back as NumPy scalars."""
    keys = sorted(values)
    everyone = communicator._allgather_obj(keys, communicator._name(f"{tag}.keys"))
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
        is_array = (isinstance(original, (np.ndarray, chainer.Variable))
                    or gpu.is_device_array(original))
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


class GenericMultiNodeEvaluator(extension.Extension):
    """ChainerMN's evaluator for results that do not average.

    Each rank iterates over its own `iterator` (not repeating; its share of
    the data, of any size) and calls `calc_local(*batch)` on each converted
    batch without backprop (`calc_local(**batch)` for a dict,
    `calc_local(batch)` otherwise); by default that calls `target`.
    The root receives every rank's results, a round at a time, and calls
    `aggregate(results)` once with all of them: round by round, and within
    a round in rank order (round k holds each rank's k-th batch, for the
    ranks that still had one). `__call__` returns what `aggregate` returned
    on the root and None on the other ranks. Override both methods; by
    default `aggregate` returns the list itself. `progress_hook(batch)` is
    called on the root for each of its own batches.

    Unlike ChainerMN's, a `calc_local` that returns None keeps its place
    in the list (ChainerMN dropped it), and `comm=None` runs on one process.
    The ranks check that they are all done every `gather_interval` rounds.
    """

    trigger = 1, "epoch"
    default_name = "validation"
    priority = extension.PRIORITY_WRITER
    name = None
    gather_interval = 8

    def __init__(self, comm, iterator, target, device=None,
                 converter=convert.concat_examples, root=0, **kwargs):
        progress_hook, = argument.parse_kwargs(kwargs, ("progress_hook", None))
        if comm is not None:
            check_root("GenericMultiNodeEvaluator", root, comm.size)
        self.comm = comm
        self.iterator = iterator
        self._targets = {"main": target}
        self.converter = converter
        self.device = chainer.backend.get_device(device) if device is not None else None
        self.root = root
        self._progress_hook = progress_hook

    def __call__(self, trainer=None):
        it = self._restarted_iterator()
        if self.comm is None:
            return self.aggregate(list(self._local(it)))
        results = self._gathered(self._local(it))
        return self.aggregate(results) if self.comm.rank == self.root else None

    def calc_local(self, *args, **kwargs):
        """One batch's result on this rank: by default `target(batch)`."""
        return self._targets["main"](*args, **kwargs)

    def aggregate(self, results):
        """Called once, on the root, with every rank's results; its return
        value is the evaluator's. By default the list itself."""
        return results

    def _restarted_iterator(self):
        if hasattr(self.iterator, "reset"):
            self.iterator.reset()
            return self.iterator
        return copy.copy(self.iterator)

    def _local(self, it):
        """calc_local's result for each of this rank's batches."""
        at_root = self.comm is None or self.comm.rank == self.root
        for batch in it:
            in_arrays = convert._call_converter(self.converter, batch, self.device)
            with chainer.no_backprop_mode():
                if isinstance(in_arrays, tuple):
                    result = self.calc_local(*in_arrays)
                elif isinstance(in_arrays, dict):
                    result = self.calc_local(**in_arrays)
                else:
                    result = self.calc_local(in_arrays)
            if at_root and self._progress_hook:
                self._progress_hook(batch)
            yield result

    def _gathered(self, local):
        """Every rank's results, on the root ([] elsewhere). Each round
        gathers one (result,) per rank, or None from a rank that is done."""
        comm, root, results = self.comm, self.root, []
        at_root = comm.rank == root
        wrapped = ((result,) for result in local)  # a result of None is not the end
        done = False
        while not done:
            for _ in range(self.gather_interval):
                sent = comm.gather_obj(next(wrapped, None), root=root)
                if at_root:
                    round_ = [r[0] for r in sent if r is not None]
                    results.extend(round_)
                    done = not round_
            done = comm.bcast_obj(done, root=root)
        return results
