"""create_multi_node_iterator: one rank reads batches, every rank gets them.

The master rank runs the real iterator. For each batch it broadcasts a small
header (stop flag, epoch counters, the batch's layout) with bcast_obj, then
each field of the batch, stacked over the examples, with the communicator's
`bcast` (a coordinator broadcast). The other ranks rebuild the same list of
examples, with the same dtypes (ChainerMN's version casts to float32).
Examples are arrays or scalars, or tuples of them, with equal shapes per
field across a batch (what concat_examples also needs).
"""

import numpy as np

import chainer

from frontends.chainer.iterators._wrapper import IteratorWrapper


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
        header = ("batch", is_tuple, len(fields), it.epoch, it.is_new_epoch,
                  it.current_position, it.epoch_detail, it.previous_epoch_detail)
        comm.bcast_obj(header, root=self.rank_master)
        for field in fields:
            comm.bcast(field, root=self.rank_master)
        return batch

    next = __next__


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

    def __next__(self):
        header = self.communicator.bcast_obj(None, root=self.rank_master)
        if header[0] == "stop":
            raise StopIteration
        if header[0] == "error":
            raise TypeError(f"{header[1]} (on the master rank {self.rank_master})")
        (_, is_tuple, n_fields, self.epoch, self.is_new_epoch, self.current_position,
         self._epoch_detail, self._previous_epoch_detail) = header
        fields = [self.communicator.bcast(None, root=self.rank_master)
                  for _ in range(n_fields)]
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
        self.epoch = serializer("epoch", self.epoch)
        self.is_new_epoch = serializer("is_new_epoch", self.is_new_epoch)
        self.current_position = serializer("current_position", self.current_position)


def create_multi_node_iterator(actual_iterator, communicator, rank_master=0):
    """On `rank_master`, wraps `actual_iterator`; on the other ranks, returns
    an iterator yielding the master's batches. Every rank must call next()
    (and create the iterator) in step with the master."""
    if communicator.rank == rank_master:
        return _MultiNodeIteratorMaster(actual_iterator, communicator, rank_master)
    return _MultiNodeIteratorSlave(communicator, rank_master)
