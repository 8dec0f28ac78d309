"""Gradient compression, as in horovod.torch: `Compression.none` and
`Compression.fp16` (floating-point tensors travel as float16 and come back
in their own dtype)."""

import torch

from coordinator.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; other dtypes pass unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The compression algorithms an allreduce can use."""

    none = NoneCompressor
    fp16 = FP16Compressor
