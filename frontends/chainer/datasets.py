"""Splitting a dataset across the ranks: scatter_dataset, scatter_index,
create_empty_dataset.

Ranges are contiguous and in rank order. With force_equal_length (the
default, as in ChainerMN) every rank gets ceil(n / size) examples, so
iterators stay in step; when size does not divide n, a few examples near
range boundaries appear on two ranks. Without it the ranges partition the
dataset exactly: the first n % size ranks get one example more.
"""

import numpy as np

import chainer.datasets
from frontends.chainer._checks import InvalidArgument, check_root

DEFAULT_MAX_BUF_LEN = 256 * 1024 * 1024


class DataSizeError(RuntimeError):
    pass


def _bcast_obj(comm, obj, root, max_buf_len=DEFAULT_MAX_BUF_LEN):
    if hasattr(comm, "bcast_obj"):
        return comm.bcast_obj(obj, max_buf_len=max_buf_len, root=root)
    return comm.bcast(obj, root=root)  # a bare mpi4py communicator


def index_ranges(n_total_samples, size, force_equal_length=True):
    """[(begin, end)] for each of `size` ranks."""
    if size <= 0 or n_total_samples < 0:
        raise InvalidArgument(f"cannot split {n_total_samples} samples over {size} ranks")
    if force_equal_length:
        length = -(-n_total_samples // size)
        return [(n_total_samples * i // size, n_total_samples * i // size + length)
                for i in range(size)]
    base, extra = divmod(n_total_samples, size)
    bounds = np.cumsum([0] + [base + (1 if i < extra else 0) for i in range(size)])
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(size)]


def scatter_index(n_total_samples, comm, root=0, *, force_equal_length=True):
    """(begin, end) of this rank's share of `n_total_samples` examples, as
    counted on `root` (other ranks' count is ignored)."""
    check_root("scatter_index", root, comm.size)
    n = _bcast_obj(comm, n_total_samples if comm.rank == root else None, root)
    return index_ranges(n, comm.size, force_equal_length)[comm.rank]


def scatter_dataset(dataset, comm, root=0, shuffle=False, seed=None,
                    max_buf_len=DEFAULT_MAX_BUF_LEN, *, force_equal_length=True):
    """This rank's SubDataset of root's `dataset` (other ranks may pass None).

    Root broadcasts the dataset (pickled, in pieces of max_buf_len bytes) and,
    with shuffle, one permutation drawn from numpy.random.RandomState(seed),
    so every rank splits the same order: a fixed seed fixes which rank gets
    which example."""
    check_root("scatter_dataset", root, comm.size)
    payload = None
    if comm.rank == root:
        order = (np.random.RandomState(seed).permutation(len(dataset))
                 if shuffle and dataset is not None else None)
        payload = (dataset, order)
    dataset, order = _bcast_obj(comm, payload, root, max_buf_len)
    begin, end = index_ranges(len(dataset), comm.size, force_equal_length)[comm.rank]
    return chainer.datasets.SubDataset(dataset, begin, end, order)


def create_empty_dataset(dataset):
    """A dataset as long as `dataset` whose examples are empty tuples: for
    models whose inputs arrive by communication rather than from data."""
    return [()] * len(dataset)


__all__ = ["DataSizeError", "scatter_dataset", "scatter_index", "create_empty_dataset"]
