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

Model parallelism as in ChainerMN: `functions` (send, recv, pseudo_connect
and the differentiable collectives), `links.MultiNodeChainList` and
`links.create_multi_node_n_step_rnn`; their messages also go through the
coordinator. `global_except_hook` turns one rank's uncaught exception into
the end of the whole job (CHAINERMN_FORCE_ABORT_ON_EXCEPTION=1).

Modules, as in ChainerMN: communicators, datasets, extensions, functions,
global_except_hook, iterators, links, optimizers.
"""

import coordinator  # noqa: F401  (first: its MPI settings must be in place before MPI starts)
from coordinator import runtime as _runtime
from frontends.chainer._import_chainer import import_chainer

chainer = import_chainer()
# ChainerMN's names need mpi4py's MPI, whose import starts MPI: start it as
# init() does (under HOROVOD_START_TIMEOUT's watcher, finalized at exit).
_runtime.start_mpi()

from frontends.chainer import (communicators, datasets, extensions, functions,
                               global_except_hook, iterators, links, optimizers)
from frontends.chainer.communicators import CommunicatorBase, create_communicator
from frontends.chainer.datasets import (DataSizeError, create_empty_dataset, scatter_dataset,
                                        scatter_index)
from frontends.chainer.extensions import (create_multi_node_checkpointer,
                                          create_multi_node_evaluator)
from frontends.chainer.iterators import create_multi_node_iterator, create_synchronized_iterator
from frontends.chainer.links import MultiNodeBatchNormalization, MultiNodeChainList
from frontends.chainer.optimizers import create_multi_node_optimizer

global_except_hook._add_hook_if_enabled()

__version__ = chainer.__version__

__all__ = [
    "communicators", "datasets", "extensions", "functions", "global_except_hook", "iterators",
    "links", "optimizers",
    "CommunicatorBase", "create_communicator", "DataSizeError", "create_empty_dataset",
    "scatter_dataset", "scatter_index", "create_multi_node_checkpointer",
    "create_multi_node_evaluator", "create_multi_node_iterator",
    "create_synchronized_iterator", "MultiNodeBatchNormalization", "MultiNodeChainList",
    "create_multi_node_optimizer",
]
