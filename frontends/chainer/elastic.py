"""Elastic training for Chainer: an ObjectState-based state and the run
decorator (ChainerMN has no elastic mode; this follows Horovod's).

    import frontends.chainer as chainermn
    from frontends.chainer import elastic

    state = elastic.ChainerState(model, optimizer, epoch=0)
    comm = elastic.create_communicator("naive")

    def rebuild():                      # after every reset: the job changed
        global comm
        comm = elastic.create_communicator("naive")
    state.register_reset_callbacks([rebuild])

    @elastic.run
    def train(state):
        ...                             # iterate, update, state.commit()

A ChainerMN communicator is made over one MPI communicator and its
topology; after a reset the job has a new one, so make the communicator
again (create_communicator() here uses the elastic job's current one).
`save()` copies the links' parameters and persistent values and the
optimizers' state (Chainer's DictionarySerializer), `restore()` loads the
copy back and `sync()` broadcasts rank 0's.
"""

import copy

import numpy as np

from coordinator.elastic import ObjectState, State, broadcast_object, run
from frontends.chainer._import_chainer import import_chainer

chainer = import_chainer()

__all__ = ["ChainerState", "State", "ObjectState", "run", "create_communicator"]


def _snapshot(target):
    values = {}
    chainer.serializers.DictionarySerializer(values).save(target)
    return {key: copy.deepcopy(np.asarray(value)) if value is not None else None
            for key, value in values.items()}


def _load(target, values):
    chainer.serializers.NpzDeserializer(values, strict=False).load(target)


class ChainerState(ObjectState):
    """State of Chainer links and optimizers (given as `model`, `optimizer`,
    or any keyword whose value is a Link or an Optimizer); other keyword
    arguments are synced as plain objects."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._targets = {k: v for k, v in kwargs.items()
                         if isinstance(v, (chainer.Link, chainer.Optimizer))}
        plain = {k: v for k, v in kwargs.items() if k not in self._targets}
        for key, value in self._targets.items():
            setattr(self, key, value)
        self._saved_targets = {}
        self._save_targets()
        super().__init__(bcast_object=broadcast_object, **plain)

    def _save_targets(self):
        self._saved_targets = {k: _snapshot(v) for k, v in self._targets.items()}

    def save(self):
        self._save_targets()
        super().save()

    def restore(self):
        for key, target in self._targets.items():
            _load(target, self._saved_targets[key])
        super().restore()

    def sync(self):
        current = {k: _snapshot(v) for k, v in self._targets.items()}
        synced = self._bcast_object(current)
        for key, target in self._targets.items():
            _load(target, synced[key])
        self._save_targets()
        super().sync()


def create_communicator(communicator_name="naive", **kwargs):
    """ChainerMN's create_communicator over the elastic job's current
    membership (COMM_WORLD outside an elastic job)."""
    from coordinator.elastic import membership
    from frontends.chainer.communicators import create_communicator as create

    return create(communicator_name, mpi_comm=membership.default_comm(), **kwargs)
