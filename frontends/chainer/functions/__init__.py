"""ChainerMN's differentiable communication functions (chainermn.functions).

Collectives (allgather, alltoall, bcast, gather, scatter) and point-to-point
messages (send, recv, with pseudo_connect to keep the graph connected) whose
backward passes send the gradients the opposite way: the building blocks of
model parallelism. Their tensors travel through the coordinator. The
multi-node batch-normalization function is in `batch_normalization`.
"""

from frontends.chainer.functions import batch_normalization
from frontends.chainer.functions.collective_communication import (allgather, alltoall, bcast,
                                                                  gather, scatter)
from frontends.chainer.functions.point_to_point_communication import recv, send
from frontends.chainer.functions.pseudo_connect import pseudo_connect

__all__ = ["allgather", "alltoall", "bcast", "gather", "scatter", "send", "recv",
           "pseudo_connect", "batch_normalization"]
