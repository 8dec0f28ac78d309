"""MultiNodeEarlyStoppingTrigger: early stopping that every rank agrees on.

Chainer's EarlyStoppingTrigger, fed at each check interval with the mean of
the monitored value over every observation of every rank since the last
check (ChainerMN's semantics: the mean of all values, so a rank that
observed more counts more). Each rank's (sum, count) goes to every rank in
one allgather through the coordinator, and every rank adds them up in rank
order, so all ranks compute the same number to the last bit (an allreduce
may round differently on different ranks), compare it with the same
history and stop at the same iteration.

Unlike ChainerMN, Variables in the observation are read on the CPU without
ChainerX (ChainerMN called `Variable.to_device('native')`, which fails when
ChainerX is not built, as here), and a check at which no rank observed the
value leaves the aggregated key unset on every rank (the wrapped trigger
warns and goes on), where ChainerMN's rank 0 divided by zero and the other
ranks waited for its answer.
"""

import numpy as np

import chainer
from chainer.training import util
from chainer.training.triggers import EarlyStoppingTrigger
import coordinator as hvd
from coordinator import gpu

def _scalar(value):
    if isinstance(value, chainer.Variable):
        value = value.array
    if gpu.is_device_array(value):  # a GPU's loss: np.asarray refuses CuPy arrays
        value = value.get()
    return float(np.asarray(value, dtype=np.float64))


class _MeanOverRanks:
    """Sets observation[aggregated_key] to the mean over ranks of
    observation[key] whenever `comm_trigger` fires."""

    def __init__(self, comm, key, aggregated_key, comm_trigger):
        self.comm = comm
        self.key = key
        self.aggregated_key = aggregated_key
        self.comm_trigger = util.get_trigger(comm_trigger)
        # Named by the key, not by how many triggers this process made (a
        # rank may make one the others do not): the allgather is blocking,
        # so triggers on one key share the name in turn.
        self.name = f"{comm._prefix}.early_stopping.{key}"
        self._sum_count = np.zeros(2, np.float64)

    def __call__(self, trainer):
        if self.key in trainer.observation:
            self._sum_count += (_scalar(trainer.observation[self.key]), 1.0)
        if not self.comm_trigger(trainer):
            return
        rows = hvd.allgather(self._sum_count.reshape(1, 2), name=self.name,
                             process_set=self.comm.process_set)
        self._sum_count = np.zeros(2, np.float64)
        total, count = 0.0, 0.0
        for row_sum, row_count in rows:  # the same order on every rank
            total, count = total + row_sum, count + row_count
        if count > 0:
            trainer.observation[self.aggregated_key] = total / count


class MultiNodeEarlyStoppingTrigger:
    """Early stopping on the mean over ranks of `monitor`.

    Args (ChainerMN's, keyword-only after comm):
        comm: the ChainerMN communicator.
        check_trigger: how often to compare, e.g. (1, 'epoch').
        monitor (str): the observed value, e.g. 'main/loss'.
        patience (int): checks without improvement before stopping (3);
            `patients` is accepted as an alias.
        mode (str): 'max', 'min' or 'auto' (max when the key says accuracy).
        verbose (bool): print what the trigger decides.
        max_trigger: stop here in any case, e.g. (100, 'epoch').
        suffix (str): the mean is stored as monitor + suffix.
    """

    def __init__(self, comm, *, check_trigger=(1, "epoch"), monitor="main/loss",
                 patience=None, mode="auto", verbose=False, max_trigger=(100, "epoch"),
                 suffix="_aggregated", **kwargs):
        monitor_aggregated = monitor + suffix
        self.actual_trigger = EarlyStoppingTrigger(
            check_trigger=check_trigger, monitor=monitor_aggregated, patience=patience,
            mode=mode, verbose=verbose, max_trigger=max_trigger, **kwargs)
        self.aggregator = _MeanOverRanks(comm, monitor, monitor_aggregated, check_trigger)

    def __call__(self, trainer):
        self.aggregator(trainer)
        return self.actual_trigger(trainer)

    def _stop_condition(self):
        return self.actual_trigger._stop_condition()

    def _init_summary(self):
        return self.actual_trigger._init_summary()

    def get_training_length(self):
        return self.actual_trigger.get_training_length()


def create_multi_node_early_stopping_trigger(comm, **kwargs):
    """MultiNodeEarlyStoppingTrigger(comm, **kwargs), by the factory name
    the other multi-node extensions use."""
    return MultiNodeEarlyStoppingTrigger(comm, **kwargs)
