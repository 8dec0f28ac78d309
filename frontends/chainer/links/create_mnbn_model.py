"""create_mnbn_model: a copy of a model with every BatchNormalization link
replaced by a MultiNodeBatchNormalization carrying the same settings,
parameters and running statistics."""

import copy

import chainer
import chainer.links as L

from frontends.chainer.links.batch_normalization import MultiNodeBatchNormalization


def _convert(bn, comm, communication_backend):
    if bn.avg_mean is None:
        raise ValueError("create_mnbn_model: a BatchNormalization link is not initialised yet "
                         "(its size is inferred on the first call); run the model once, or "
                         "give the link its size")
    mnbn = MultiNodeBatchNormalization(
        size=bn.avg_mean.shape, comm=comm, decay=bn.decay, eps=bn.eps,
        dtype=bn.avg_mean.dtype, use_gamma=hasattr(bn, "gamma"), use_beta=hasattr(bn, "beta"),
        communication_backend=communication_backend)
    mnbn.copyparams(bn)
    for name in ("avg_mean", "avg_var", "N"):
        mnbn.__dict__[name] = copy.deepcopy(bn.__dict__[name])
    return mnbn


def create_mnbn_model(link, comm, communication_backend="auto"):
    """Returns a copy of `link` (a Chain, ChainList, Sequential or single
    link) whose BatchNormalization links average their statistics over the
    ranks of `comm`. The original is left unchanged."""
    if isinstance(link, L.BatchNormalization):
        return _convert(link, comm, communication_backend)
    if isinstance(link, chainer.Sequential):
        clone = copy.deepcopy(link)
        for i, layer in enumerate(link):
            clone[i] = create_mnbn_model(layer, comm, communication_backend)
        return clone
    if isinstance(link, chainer.ChainList):
        clone = copy.deepcopy(link)
        for i, child in enumerate(link):
            clone._children[i] = create_mnbn_model(child, comm, communication_backend)
        return clone
    if isinstance(link, chainer.Chain):
        clone = copy.deepcopy(link)
        for name in link._children:
            clone.__dict__[name] = create_mnbn_model(link.__dict__[name], comm,
                                                     communication_backend)
        return clone
    return copy.deepcopy(link)
