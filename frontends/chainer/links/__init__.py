"""Links for multi-node training."""

from frontends.chainer.links.batch_normalization import MultiNodeBatchNormalization

__all__ = ["MultiNodeBatchNormalization"]
