"""Trainer extensions for multi-node training."""

from frontends.chainer.extensions import _multi_node_snapshot
from frontends.chainer.extensions._multi_node_snapshot import multi_node_snapshot
from frontends.chainer.extensions.allreduce_persistent import AllreducePersistent
from frontends.chainer.extensions.checkpoint import create_multi_node_checkpointer
from frontends.chainer.extensions.evaluator import (GenericMultiNodeEvaluator,
                                                  create_multi_node_evaluator)
from frontends.chainer.extensions.multi_node_early_stopping_trigger import (
    MultiNodeEarlyStoppingTrigger, create_multi_node_early_stopping_trigger)
from frontends.chainer.extensions.observation_aggregator import ObservationAggregator

# (_multi_node_snapshot is ChainerMN's module name; its tests import it.)
__all__ = ["_multi_node_snapshot", "AllreducePersistent", "create_multi_node_checkpointer",
           "create_multi_node_evaluator", "GenericMultiNodeEvaluator", "ObservationAggregator",
           "multi_node_snapshot",
           "MultiNodeEarlyStoppingTrigger", "create_multi_node_early_stopping_trigger"]
