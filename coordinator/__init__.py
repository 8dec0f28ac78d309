"""coordinator: a Horovod-style coordinator for data-parallel training.

`import coordinator as hvd` gives Horovod's vocabulary over NumPy arrays:
init/shutdown, rank/size, allreduce, allgather, broadcast, alltoall,
reducescatter (each with _async and grouped variants), barrier, join,
poll/synchronize and process sets. One background thread per process
negotiates tensors by name with the other ranks, fuses them, and runs the
collectives over MPI in the same order everywhere.
"""

import os as _os
import sys as _sys

from coordinator.runtime import _mpi_defaults

# Open MPI reads its settings when MPI starts. A script (or a frontend) that
# imports mpi4py's MPI after this package but before init() would otherwise
# start MPI without them.
if "mpi4py.MPI" not in _sys.modules:
    _mpi_defaults(_os.environ)

from coordinator.basics import (add_process_set, ccl_built, cross_rank, cross_size,
                                cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                                is_homogeneous, is_initialized, local_rank, local_size,
                                mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                                rank, remove_process_set, rocm_built, shutdown, size,
                                start_timeline, stop_timeline)
from coordinator.collectives import (Adasum, Average, Max, Min, Product, Sum, allgather,
                                     allgather_async, allreduce, allreduce_async, alltoall,
                                     alltoall_async, barrier, broadcast, broadcast_async,
                                     grouped_allgather, grouped_allgather_async,
                                     grouped_allreduce, grouped_allreduce_async,
                                     grouped_reducescatter, grouped_reducescatter_async, join,
                                     poll, recv, recv_async, reducescatter,
                                     reducescatter_async, send, send_async, synchronize)
from coordinator.objects import allgather_object, broadcast_object
from coordinator.errors import (DeadlockError, HorovodInternalError, InvalidOperationError,
                                NotInitializedError, RankFailedError, ShutdownError,
                                StallError, TensorMismatchError)
from coordinator.process_sets import ProcessSet, global_process_set

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "start_timeline", "stop_timeline", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "send", "send_async", "recv", "recv_async",
    "barrier", "join", "poll", "synchronize", "broadcast_object", "allgather_object",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "NotInitializedError", "RankFailedError", "ShutdownError",
    "StallError", "TensorMismatchError", "DeadlockError", "InvalidOperationError", "run",
]


def __getattr__(name):
    """`coordinator.run(fn, args=(), kwargs={}, np=...)` is horovod.run: the
    module coordrun lives in is callable for that (coordinator/run.py). It
    is imported on first use, so `python -m coordinator.run` finds it
    unimported."""
    if name == "run":
        import importlib

        return importlib.import_module("coordinator.run")
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
