"""Links for multi-node training: batch normalization over every rank's
batch, and model parallelism (MultiNodeChainList, the multi-node NStep RNN)."""

from frontends.chainer.links.batch_normalization import MultiNodeBatchNormalization
from frontends.chainer.links.create_mnbn_model import create_mnbn_model
from frontends.chainer.links.multi_node_chain_list import MultiNodeChainList
from frontends.chainer.links.n_step_rnn import create_multi_node_n_step_rnn

__all__ = ["MultiNodeBatchNormalization", "create_mnbn_model", "MultiNodeChainList",
           "create_multi_node_n_step_rnn"]
