"""horovod.torch.elastic over the coordinator: `run`, `TorchState`,
`ElasticSampler` (and the core's `State`, `ObjectState`).

    import frontends.torch as hvd

    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

    train(state)

TorchState keeps a model, an optimizer, an LR scheduler and an
ElasticSampler through handlers (as Horovod does) and any other keyword
argument as a plain object; `commit()` copies them to host memory,
`restore()` puts the last copy back, `sync()` broadcasts rank 0's. The
handler registry (`get_handler_registry`, `set_handler_registry`) is
Horovod's, so a custom type can bring its own handler.
"""

import copy
import math
import random

import torch

from coordinator.elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn
from coordinator.elastic.loop import make_reset
from frontends.torch.functions import (broadcast_object, broadcast_optimizer_state,
                                       broadcast_parameters)
from frontends.torch.mpi_ops import init, rank, shutdown, size

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt"]


def run(func):
    """Runs `func(state, ...)` elastically: after a lost worker it goes on
    from the last commit, after a change of hosts from the current state,
    each time on the re-formed job with the state synced from rank 0.
    `func` must not start with a collective (a new worker would run it while
    the others sync)."""
    return run_fn(func, make_reset(shutdown, init))


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset over the ranks and re-partitions what is left of
    the epoch after a reset. Keep it in the TorchState, call
    `record_batch()` after each batch and `set_epoch()` at the end of each
    epoch.

    dataset: its size must not change; shuffle: shuffle the indices
    (deterministically from seed + epoch, identically on every rank)."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch):
        """Starts `epoch` with nothing processed (call it at the end of the
        previous epoch, so a reset mid-epoch does not repeat samples)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Counts a batch of `batch_size` samples as processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self):
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def reset(self):
        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        self.indices = self.remaining_indices[:]
        self.indices += self.indices[:(self.total_size - len(self.indices))]
        self.indices = self.indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


class StateHandler:
    """Keeps one object of a TorchState: save, restore, sync."""

    def __init__(self, value):
        self.value = value

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def set_value(self, value):
        self.value = value
        self.save()


def _copy_into(saved, current):
    """`current` (a state_dict: nested dicts and lists of tensors and plain
    values) copied into `saved`, reusing the tensors `saved` already holds
    where shapes and dtypes match (a commit then allocates nothing); returns
    the copy."""
    if isinstance(current, torch.Tensor):
        if (isinstance(saved, torch.Tensor) and saved.shape == current.shape
                and saved.dtype == current.dtype and saved.device == current.device
                and saved.layout == current.layout == torch.strided):
            return saved.copy_(current.detach())
        return current.detach().clone()
    if isinstance(current, dict):
        old = saved if isinstance(saved, dict) else {}
        return type(current)((k, _copy_into(old.get(k), v)) for k, v in current.items()) \
            if type(current) is not dict else {k: _copy_into(old.get(k), v)
                                               for k, v in current.items()}
    if isinstance(current, (list, tuple)):
        old = saved if isinstance(saved, type(current)) and len(saved) == len(current) \
            else [None] * len(current)
        items = [_copy_into(o, v) for o, v in zip(old, current)]
        return items if isinstance(current, list) else type(current)(items)
    return copy.deepcopy(current)


class _StateDictHandler(StateHandler):
    """An object with state_dict()/load_state_dict(): saved as a copy in
    host memory (the previous copy's tensors are reused)."""

    def __init__(self, value):
        super().__init__(value)
        self._saved = _copy_into(None, value.state_dict())

    def save(self):
        self._saved = _copy_into(self._saved, self.value.state_dict())

    def restore(self):
        # A fresh copy: an optimizer's load_state_dict keeps the tensors it
        # is given, which the next steps would then change in place.
        self.value.load_state_dict(_copy_into(None, self._saved))

    def sync(self):
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class ModelStateHandler(_StateDictHandler):
    def __init__(self, model):  # (Horovod's parameter names, here and below)
        super().__init__(model)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def __init__(self, optimizer):
        super().__init__(optimizer)

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    pass


class SamplerStateHandler(_StateDictHandler):
    def __init__(self, sampler):
        super().__init__(sampler)


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    return _handler_registry


def set_handler_registry(registry):
    global _handler_registry
    _handler_registry = registry


def _get_handler(value):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process: a model, an optimizer and
    any other keyword arguments (attributes of the state). Objects with a
    handler (models, optimizers, LR schedulers, ElasticSamplers) are synced
    through it; the rest as plain Python objects."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(dict(model=model, optimizer=optimizer))
        handlers, plain = {}, {}
        for key, value in kwargs.items():
            handler = _get_handler(value)
            if handler is not None:
                handlers[key] = handler
            else:
                plain[key] = value
        self._handlers = handlers
        for key, handler in handlers.items():
            setattr(self, key, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        if hasattr(self, name) and name in getattr(self, "_handlers", {}):
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)
