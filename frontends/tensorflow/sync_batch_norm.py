"""SyncBatchNormalization: batch normalization with statistics over the
global batch of every rank.

Training-mode moments come from one allreduce (Sum) of each rank's per-
channel sum, sum of squares and element count, so ranks with different batch
sizes are weighted by their sizes (Horovod averages the ranks' means, which
is the same when batches are equal). The variance is E[x^2] - E[x]^2, as in
Horovod. The allreduce's gradient (the summed gradient of every rank) makes
the backward pass that of the global batch once the weight gradients are
averaged by DistributedGradientTape or DistributedOptimizer.
"""

import keras
import tensorflow as tf

from frontends.tensorflow import mpi_ops
from coordinator.process_sets import global_process_set
from frontends.tensorflow.mpi_ops import Sum


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training statistics are those
    of the batch of all ranks together."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if global_process_set.size() in (None, 1):
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            total = tf.reduce_sum(inputs, axes)
            squares = tf.reduce_sum(tf.square(inputs), axes)
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
            total = tf.reduce_sum(inputs * weights, axes)
            squares = tf.reduce_sum(tf.square(inputs) * weights, axes)
            count = tf.reshape(tf.reduce_sum(weights, axes), [-1])[0]
        channels = tf.size(total)
        stacked = tf.concat([tf.reshape(total, [-1]), tf.reshape(squares, [-1]),
                             tf.reshape(count, [1])], axis=0)
        reduced = mpi_ops._allreduce(stacked, op=Sum)
        n = reduced[-1]
        mean = tf.reshape(reduced[:channels] / n, tf.shape(total))
        mean_of_squares = tf.reshape(reduced[channels:2 * channels] / n, tf.shape(total))
        variance = tf.maximum(mean_of_squares - tf.square(mean), 0.0)
        return mean, variance
