"""Horovod's `horovod.tensorflow` API for TensorFlow 2 on the coordinator.

    import frontends.tensorflow as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

Everything is Python over the shared coordinator (no TensorFlow custom ops,
so nothing is compiled against TensorFlow). Collectives work eagerly and
inside tf.function; they cannot be compiled by XLA (jit_compile=True raises
InvalidArgumentError at trace time). See mpi_ops.py for names, ordering.py
for the order collectives run in within a graph (tf.compat.v1 Sessions
included), tensor_bridge.py for copies, errors.py for exception types, and
legacy.py for Horovod's TensorFlow 1 API (broadcast_global_variables,
BroadcastGlobalVariablesHook, DistributedOptimizer of a
tf.compat.v1.train.Optimizer).
"""

import warnings

import tensorflow as tf

from coordinator import ProcessSet, add_process_set, global_process_set, remove_process_set
from frontends._util import check_extension, check_num_rank_power_of_2, gpu_available, split_list
from frontends.tensorflow.basics import (ccl_built, cross_rank, cross_size, cuda_built,
                                         ddl_built, gloo_built, gloo_enabled, init,
                                         is_homogeneous, is_initialized, local_rank, local_size,
                                         mpi_built, mpi_enabled, mpi_threads_supported,
                                         nccl_built, rank, rocm_built, shutdown, size,
                                         start_timeline, stop_timeline)
from frontends.tensorflow.collectives import (allreduce, grouped_allreduce,
                                              grouped_reducescatter,
                                              handle_average_backwards_compatibility,
                                              reducescatter)
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.functions import (allgather_object, broadcast_, broadcast_object,
                                            broadcast_object_fn, broadcast_variables)
from frontends.tensorflow.gradient_tape import (DistributedGradientTape,
                                                PartialDistributedGradientTape)
from frontends.tensorflow.legacy import BroadcastGlobalVariablesHook, broadcast_global_variables
from frontends.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, Sum,
                                          _allreduce, _executing_eagerly,
                                          _grouped_allreduce, _grouped_reducescatter,
                                          _reducescatter, allgather, alltoall, barrier,
                                          broadcast, grouped_allgather, join, local_rank_op,
                                          local_size_op, process_set_included_op, rank_op,
                                          size_op)
from frontends.tensorflow.sync_batch_norm import SyncBatchNormalization
from frontends.tensorflow import errors as _errors
from frontends.tensorflow import gradients as _gradients
from frontends.tensorflow import legacy as _legacy
from frontends.tensorflow import elastic  # hvd.elastic.run, as in Horovod
from frontends.tensorflow import util  # hvd.util, as in Horovod
from frontends.tensorflow.util import _cache, _make_subgraph, refs_to_vars, vars_to_refs

# Mismatches inside a tf.function raise FailedPreconditionError, as Horovod's
# compiled ops do (errors.py says how).
_errors.install_graph_error_types()


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """For a tf.compat.v1.train.Optimizer, one that reduces its gradients in
    compute_gradients (see legacy.py); for a Keras optimizer, the Keras
    DistributedOptimizer (see frontends.tensorflow.keras)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    groups = _gradients.check_groups(groups, num_groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return _legacy.distributed_optimizer(
            optimizer, name, use_locking, compression, sparse_as_dense,
            backward_passes_per_step, op, gradient_predivide_factor,
            average_aggregated_gradients, groups, process_set, scale_local_gradients)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "Provided optimizer doesn't inherit from either legacy TensorFlow or Keras "
            f"optimizer: {optimizer!r} ({type(optimizer).__name__}; DistributedOptimizer wraps "
            "Keras 3 optimizers and tf.compat.v1.train.Optimizer). For a custom training loop "
            "use hvd.DistributedGradientTape.")
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    if op != Average:
        warnings.warn(
            "hvd.DistributedOptimizer of a Keras optimizer with op other than Average: Horovod "
            "0.28.1 does not pass op on to its Keras optimizer here, and averages; this one "
            "reduces with the op given", stacklevel=2)
    from frontends.tensorflow.keras.optimizer import DistributedOptimizer as _keras_optimizer

    return _keras_optimizer(optimizer, name=name, compression=compression,
                            sparse_as_dense=sparse_as_dense,
                            gradient_predivide_factor=gradient_predivide_factor, op=op,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients,
                            groups=groups, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "ddl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "size_op", "local_size_op", "rank_op", "local_rank_op", "process_set_included_op",
    "broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "Compression",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
    "SyncBatchNormalization", "handle_average_backwards_compatibility",
]
