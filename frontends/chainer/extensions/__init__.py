"""Trainer extensions for multi-node training."""

from frontends.chainer.extensions.allreduce_persistent import AllreducePersistent
from frontends.chainer.extensions.checkpoint import create_multi_node_checkpointer
from frontends.chainer.extensions.evaluator import create_multi_node_evaluator
from frontends.chainer.extensions.observation_aggregator import ObservationAggregator

__all__ = ["AllreducePersistent", "create_multi_node_checkpointer",
           "create_multi_node_evaluator", "ObservationAggregator"]
