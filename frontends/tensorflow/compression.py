"""Gradient compression applied around an allreduce (Horovod's Compression)."""

import tensorflow as tf

from coordinator.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts the result back;
    other dtypes go as they are."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compression algorithms: `none` (the default) and `fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
