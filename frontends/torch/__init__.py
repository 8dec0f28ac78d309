"""horovod.torch's API over the coordinator.

    import frontends.torch as hvd     # instead of: import horovod.torch as hvd

Same names, signatures, defaults, results and exception types as horovod.torch
0.28.1. CPU tensors reach the coordinator as zero-copy NumPy views; every
tensor goes through the one background coordinator of the process (shared
with the other frontends), with its fusion, response cache and timeline.
"""

from coordinator.errors import HorovodInternalError
from coordinator.process_sets import ProcessSet, global_process_set
from frontends.torch.compression import Compression
from frontends._util import check_extension  # noqa: F401 (Horovod's horovod.torch has it)
from frontends.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, add_process_set,
                                     allgather, allgather_async, allreduce, allreduce_,
                                     allreduce_async, allreduce_async_, alltoall,
                                     alltoall_async, barrier, broadcast, broadcast_,
                                     broadcast_async, broadcast_async_, ccl_built, cross_rank,
                                     cross_size, cuda_built, ddl_built, gloo_built,
                                     gloo_enabled, grouped_allgather, grouped_allgather_async,
                                     grouped_allreduce, grouped_allreduce_,
                                     grouped_allreduce_async, grouped_allreduce_async_,
                                     grouped_reducescatter, grouped_reducescatter_async, init,
                                     is_homogeneous, is_initialized, join, local_rank,
                                     local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                     nccl_built, poll, rank, reducescatter, reducescatter_async,
                                     remove_process_set, rocm_built, shutdown, size,
                                     sparse_allreduce_async, start_timeline, stop_timeline,
                                     synchronize)
from frontends.torch.functions import (allgather_object, broadcast_object,
                                       broadcast_optimizer_state, broadcast_parameters)
from frontends.torch.optimizer import DistributedOptimizer
from frontends.torch.sync_batch_norm import SyncBatchNorm
from frontends.torch import elastic  # noqa: E402  (hvd.elastic.run, as in Horovod)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built",
    "cuda_built", "rocm_built", "ddl_built", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "poll", "synchronize", "join", "barrier",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "SyncBatchNorm",
]
