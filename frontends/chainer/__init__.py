"""ChainerMN's API on the coordinator: `import frontends.chainer as chainermn`.

A ChainerMN script runs unchanged on CPU with the 'naive' communicator:

    comm = chainermn.create_communicator('naive')
    optimizer = chainermn.create_multi_node_optimizer(chainer.optimizers.Adam(), comm)
    train = chainermn.scatter_dataset(train, comm, shuffle=True)
    evaluator = chainermn.create_multi_node_evaluator(extensions.Evaluator(...), comm)

Unlike ChainerMN, gradients and parameters do not take a private MPI path:
they are submitted by name to the process's coordinator, the background
thread PyTorch and TensorFlow frontends share, so Chainer's tensors get the
same negotiation, fusion, response cache, timeline and error reporting.

Modules, as in ChainerMN: communicators, datasets, extensions, iterators,
links, optimizers.
"""

from frontends.chainer._import_chainer import import_chainer

chainer = import_chainer()

from frontends.chainer import communicators, datasets, extensions, iterators, links, optimizers
from frontends.chainer.communicators import CommunicatorBase, create_communicator
from frontends.chainer.datasets import (DataSizeError, create_empty_dataset, scatter_dataset,
                                        scatter_index)
from frontends.chainer.extensions import (create_multi_node_checkpointer,
                                          create_multi_node_evaluator)
from frontends.chainer.iterators import create_multi_node_iterator, create_synchronized_iterator
from frontends.chainer.links import MultiNodeBatchNormalization
from frontends.chainer.optimizers import create_multi_node_optimizer

__version__ = chainer.__version__

__all__ = [
    "communicators", "datasets", "extensions", "iterators", "links", "optimizers",
    "CommunicatorBase", "create_communicator", "DataSizeError", "create_empty_dataset",
    "scatter_dataset", "scatter_index", "create_multi_node_checkpointer",
    "create_multi_node_evaluator", "create_multi_node_iterator",
    "create_synchronized_iterator", "MultiNodeBatchNormalization",
    "create_multi_node_optimizer",
]
