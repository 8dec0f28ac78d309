"""create_multi_node_iterator: one rank reads batches, every rank gets them.

The master rank runs the real iterator. For each batch it broadcasts a
header (stop flag, epoch counters) with bcast_obj, and the batch's fields,
stacked over the examples: inside the header when they are small (at most
INLINE_BYTES: one negotiated round a batch), else as coordinator broadcasts
submitted together after it, the header giving their shapes and dtypes (two
rounds, without pickling the data). The other ranks rebuild the same list of
examples, with the same dtypes (ChainerMN's version casts to float32).
Examples are arrays or scalars, or tuples of them, with equal shapes per
field across a batch (what concat_examples also needs).

`serialize` is collective, as ChainerMN's: every rank calls it at the same
time, and the other ranks save the master's state (its order included), so
any rank's snapshot loads into a Chainer iterator.
"""

import numpy as np

import chainer
import coordinator as hvd
from coordinator import dtypes as core_dtypes

from frontends.chainer.iterators._wrapper import IteratorWrapper


class _Recorder(chainer.serializer.Serializer):
    """A serializer that changes nothing and keeps what it is given: the
    (key, value) pairs an iterator's serialize() writes, in order."""

    def __init__(self, prefix=""):
        self.prefix = prefix
        self.items = []

    def __getitem__(self, key):
        child = _Recorder(f"{self.prefix}{key}/")
        child.items = self.items
        return child

    def __call__(self, key, value):
        self.items.append((self.prefix + key,
                           value.copy() if isinstance(value, np.ndarray) else value))
        return value


# Batches up to this size travel pickled inside the header. An MNIST batch of
# 32 (100 KB), np=2, here: 0.64-0.70 ms a batch with a shape exchange per
# field (before 58db13f), 0.87-0.90 ms as a header then one round of
# broadcasts, 0.48-0.64 ms inline.
INLINE_BYTES = 1 << 20


def _field_names(communicator, count):
    return [f"{communicator._prefix}.mn_iterator.{i}" for i in range(count)]


def _layout(batch):
    """(is_tuple, stacked fields) of a list of examples, or TypeError."""
    if not isinstance(batch, (list, tuple)) or len(batch) == 0:
        raise TypeError(f"multi-node iterator: a batch must be a non-empty list, got "
                        f"{type(batch).__name__}")
    is_tuple = isinstance(batch[0], tuple)
    columns = list(zip(*batch)) if is_tuple else [batch]
    fields = []
    for i, column in enumerate(columns):
        try:
            fields.append(np.stack([np.asarray(v) for v in column]))
        except ValueError as exc:
            raise TypeError(f"multi-node iterator: field {i} of the batch cannot be stacked "
                            f"({exc}); examples must have equal shapes per field") from exc
        if fields[-1].dtype == object:
            raise TypeError(f"multi-node iterator: field {i} holds Python objects; only "
                            "arrays and numbers can be sent")
        if core_dtypes.info_for(fields[-1].dtype) is None:
            raise TypeError(f"multi-node iterator: field {i} has dtype {fields[-1].dtype}, "
                            f"which cannot be sent (supported: {core_dtypes.SUPPORTED_NAMES})")
    return is_tuple, fields


class _MultiNodeIteratorMaster(IteratorWrapper):
    def __init__(self, actual_iterator, communicator, rank_master):
        object.__setattr__(self, "actual_iterator", actual_iterator)
        object.__setattr__(self, "communicator", communicator)
        object.__setattr__(self, "rank_master", rank_master)
        communicator.bcast_obj(len(actual_iterator.dataset), root=rank_master)

    def __next__(self):
        comm, it = self.communicator, self.actual_iterator
        try:
            batch = it.__next__()
        except StopIteration:
            comm.bcast_obj(("stop",), root=self.rank_master)
            raise
        try:
            is_tuple, fields = _layout(batch)
        except TypeError as exc:
            comm.bcast_obj(("error", str(exc)), root=self.rank_master)
            raise
        inline = sum(f.nbytes for f in fields) <= INLINE_BYTES
        header = ("batch", is_tuple, inline,
                  fields if inline else [(f.shape, f.dtype) for f in fields], it.epoch,
                  it.is_new_epoch, it.current_position, it.epoch_detail,
                  it.previous_epoch_detail)
        comm.bcast_obj(header, root=self.rank_master)
        if not inline:
            _broadcast_fields(comm, self.rank_master, fields)
        return batch

    next = __next__

    def serialize(self, serializer):
        """Collective: the other ranks take what the master's iterator holds
        once it has saved (or loaded) its state."""
        self.actual_iterator.serialize(serializer)
        recorder = _Recorder()
        self.actual_iterator.serialize(recorder)  # changes nothing: reads the state
        self.communicator.bcast_obj(recorder.items, root=self.rank_master)


def _broadcast_fields(comm, rank_master, fields):
    """The master's fields into `fields` on every rank (submitted together)."""
    root = comm._global[rank_master]
    handles = [hvd.broadcast_async(f, root, name=name, process_set=comm.process_set,
                                   output=f)
               for f, name in zip(fields, _field_names(comm, len(fields)))]
    for handle in handles:
        hvd.synchronize(handle)


class _MultiNodeIteratorSlave(chainer.dataset.iterator.Iterator):
    def __init__(self, communicator, rank_master):
        self.communicator = communicator
        self.rank_master = rank_master
        self.dataset_size = communicator.bcast_obj(None, root=rank_master)
        self.epoch = 0
        self.is_new_epoch = False
        self.current_position = 0
        self._epoch_detail = 0.0
        self._previous_epoch_detail = None
        self._order = None  # the master's, as of the last serialize

    def __next__(self):
        header = self.communicator.bcast_obj(None, root=self.rank_master)
        if header[0] == "stop":
            raise StopIteration
        if header[0] == "error":
            raise TypeError(f"{header[1]} (on the master rank {self.rank_master})")
        (_, is_tuple, inline, layout, self.epoch, self.is_new_epoch, self.current_position,
         self._epoch_detail, self._previous_epoch_detail) = header
        if inline:
            fields = layout
        else:
            fields = [np.empty(shape, dtype) for shape, dtype in layout]
            _broadcast_fields(self.communicator, self.rank_master, fields)
        return list(zip(*fields)) if is_tuple else list(fields[0])

    next = __next__

    @property
    def epoch_detail(self):
        return self._epoch_detail

    @property
    def previous_epoch_detail(self):
        return self._previous_epoch_detail

    def reset(self):
        """The master's iterator decides where reading starts."""

    def serialize(self, serializer):
        """Collective (see the module): saves the master's state under its
        iterator's keys, and takes it as this rank's."""
        items = self.communicator.bcast_obj(None, root=self.rank_master)
        for key, value in items:
            try:
                serializer(key, value.copy() if isinstance(value, np.ndarray) else value)
            except KeyError:  # loading a snapshot that lacks it (Chainer allows some)
                pass
        state = dict(items)
        self.epoch = state.get("epoch", self.epoch)
        self.is_new_epoch = state.get("is_new_epoch", self.is_new_epoch)
        self.current_position = state.get("current_position", self.current_position)
        self._previous_epoch_detail = state.get("previous_epoch_detail",
                                                self._previous_epoch_detail)
        self._order = state.get("order", state.get("_order"))


def create_multi_node_iterator(actual_iterator, communicator, rank_master=0):
    """On `rank_master`, wraps `actual_iterator`; on the other ranks, returns
    an iterator yielding the master's batches. Every rank must call next()
    (and create the iterator) in step with the master."""
    if communicator.rank == rank_master:
        return _MultiNodeIteratorMaster(actual_iterator, communicator, rank_master)
    return _MultiNodeIteratorSlave(communicator, rank_master)
