"""Iterators that keep the ranks reading the same batches."""

from frontends.chainer.iterators.multi_node import create_multi_node_iterator
from frontends.chainer.iterators.synchronized import create_synchronized_iterator

__all__ = ["create_multi_node_iterator", "create_synchronized_iterator"]
