"""Horovod's `horovod.tensorflow.keras` API for Keras 3 on the coordinator.

    import frontends.tensorflow.keras as hvd

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

The collectives run as Python ops, which XLA cannot compile: compile the
model with jit_compile=False when training with the DistributedOptimizer
(Keras' default, jit_compile="auto", already chooses False on a machine
without GPUs).
"""

import tensorflow as tf

from coordinator import ProcessSet, add_process_set, global_process_set, remove_process_set
from frontends.tensorflow import collectives as _collectives
from frontends.tensorflow import mpi_ops as _mpi_ops
from frontends.tensorflow.basics import (ccl_built, cross_rank, cross_size, cuda_built,
                                         ddl_built, gloo_built, gloo_enabled, init,
                                         is_homogeneous, is_initialized, local_rank, local_size,
                                         mpi_built, mpi_enabled, mpi_threads_supported,
                                         nccl_built, rank, rocm_built, shutdown, size,
                                         start_timeline, stop_timeline)
from frontends.tensorflow.compression import Compression
from frontends.tensorflow.keras import callbacks, elastic
from frontends.tensorflow.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from frontends.tensorflow.keras.saving import load_model
from frontends.tensorflow.mpi_ops import Adasum, Average, Sum
from frontends.tensorflow.sync_batch_norm import SyncBatchNormalization


def broadcast_global_variables(root_rank):
    """TensorFlow 1 only in Horovod; with Keras 3 (always eager) use
    BroadcastGlobalVariablesCallback or hvd.broadcast_variables."""
    raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                       "Please use `hvd.callbacks.BroadcastGlobalVariablesCallback` or "
                       "`frontends.tensorflow.broadcast_variables(<variables>)` instead.")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """Reduces a tensor-compatible value over all ranks (op: default Average)
    and returns the result as a tensor."""
    return _collectives.allreduce(tf.constant(value), average=average, name=name,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, op=op,
                                  compression=compression)


def allgather(value, name=None):
    """Concatenates every rank's value along the first dimension."""
    return _mpi_ops.allgather(tf.constant(value), name=name)


def broadcast(value, root_rank, name=None):
    """Returns `root_rank`'s value on every rank."""
    return _mpi_ops.broadcast(tf.constant(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """Reduces a value over all ranks and returns this rank's share of the
    first dimension."""
    return _collectives.reducescatter(tf.constant(value), name=name, op=op)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_built",
    "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "ddl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Adasum", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter",
    "load_model", "callbacks", "elastic", "SyncBatchNormalization",
]
