"""ObservationAggregator: one summary of an observed value over all ranks.

Each rank records the value of `original_key` at every call; when
`comm_trigger` fires, rank 0 gathers every rank's list of recorded values,
applies `aggregator` to the list of lists (default: the mean of all the
values), and every rank stores the result under `aggregated_key`. Values are
gathered as Python objects because the aggregator may be any function of
them. If the aggregator raises on rank 0, every rank raises (ChainerMN's
other ranks waited for rank 0's summary forever).
"""

import numpy as np

import chainer
from chainer.training import extension, util


def _mean_of_all(lists):
    values = [v for per_rank in lists for v in per_rank]
    return sum(values) / len(values)


class ObservationAggregator(extension.Extension):
    trigger = 1, "iteration"
    priority = extension.PRIORITY_EDITOR
    name = None

    def __init__(self, comm, original_key, aggregated_key=None, *,
                 comm_trigger=(1, "iteration"), aggregator=None):
        self.comm = comm
        self.original_key = original_key
        self.aggregated_key = original_key if aggregated_key is None else aggregated_key
        self.comm_trigger = util.get_trigger(comm_trigger)
        self.aggregator = aggregator or _mean_of_all
        self.observation_history = []

    def compute_summary(self, trainer):
        """Records this call's value; returns the summary when the ranks
        communicated, else None."""
        if self.original_key in trainer.observation:
            value = trainer.observation[self.original_key]
            if isinstance(value, chainer.Variable):
                value = value.array
            if isinstance(value, np.ndarray) and value.ndim == 0:
                value = value[()]
            self.observation_history.append(value)
        if not self.comm_trigger(trainer):
            return None
        gathered = self.comm.gather_obj(self.observation_history)
        self.observation_history = []
        outcome, failure = None, None
        if self.comm.rank == 0:
            try:
                outcome = ("ok", self.aggregator(gathered))
            except Exception as exc:
                failure = exc
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        # Every rank learns the outcome, an error included, so no rank is
        # left waiting for a summary that rank 0 never computed.
        outcome = self.comm.bcast_obj(outcome)
        if failure is not None:
            raise failure
        if outcome[0] == "error":
            raise RuntimeError(f"ObservationAggregator: the aggregator of {self.original_key!r} "
                               f"raised on rank 0: {outcome[1]}")
        return outcome[1]

    def __call__(self, trainer):
        summary = self.compute_summary(trainer)
        if summary is not None:
            trainer.observation[self.aggregated_key] = summary
