"""Links for multi-node training."""

from frontends.chainer.links.batch_normalization import MultiNodeBatchNormalization
from frontends.chainer.links.create_mnbn_model import create_mnbn_model

__all__ = ["MultiNodeBatchNormalization", "create_mnbn_model"]
