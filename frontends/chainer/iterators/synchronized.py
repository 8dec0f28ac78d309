"""create_synchronized_iterator: the same shuffled order on every rank.

Rank 0 draws a seed and broadcasts it; each rank's iterator then shuffles
with a ShuffleOrderSampler on that seed, so the ranks (e.g. the encoder and
the decoder of a model split across processes) read the same examples in
the same order without sending any data."""

import numpy as np

import chainer

from frontends.chainer.iterators._wrapper import IteratorWrapper


class _SynchronizedIterator(IteratorWrapper):
    def __init__(self, actual_iterator, communicator):
        if not hasattr(actual_iterator, "order_sampler"):
            raise ValueError("actual_iterator must have order_sampler (e.g. "
                             "chainer.iterators.SerialIterator)")
        object.__setattr__(self, "actual_iterator", actual_iterator)
        object.__setattr__(self, "communicator", communicator)
        seed = np.random.randint(0, 2 ** 32 - 1) if communicator.rank == 0 else None
        seed = communicator.bcast_obj(seed, root=0)
        actual_iterator.order_sampler = chainer.iterators.ShuffleOrderSampler(
            np.random.RandomState(seed))
        actual_iterator.reset()

    def __next__(self):
        return self.actual_iterator.__next__()

    next = __next__


def create_synchronized_iterator(actual_iterator, communicator):
    """Wraps a Chainer iterator with an order_sampler so every rank of the
    communicator iterates in the same shuffled order."""
    return _SynchronizedIterator(actual_iterator, communicator)
