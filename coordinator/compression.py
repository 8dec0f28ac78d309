"""The framework-independent part of Horovod's gradient compression.

A compressor has two static methods: `compress(tensor) -> (tensor to send,
context)` and `decompress(tensor, context) -> tensor`. Each frontend adds
the casts its framework needs (`FP16Compressor`) and its own `Compression`
namespace; sending a tensor as it is needs no framework at all.
"""


class Compressor:
    """compress(tensor) -> (tensor to send, context); decompress(tensor, context)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
