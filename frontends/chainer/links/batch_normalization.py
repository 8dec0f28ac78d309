"""MultiNodeBatchNormalization: batch normalization over the global batch.

With Chainer's BatchNormalization each rank normalises with its own batch's
statistics, which are noisy when the per-rank batch is small. This link
averages the statistics over the ranks: forward uses the mean and variance
of the whole global batch (the mean of per-rank E[x] and E[x^2]), and
backward averages the per-rank sums of gy and gy * x_hat, so each rank's
input gradient is that of normalising the global batch. One allreduce of
2 * channels values runs in each direction, on the coordinator.

As in ChainerMN, the running variance's unbiased correction uses the local
batch size, and gamma's and beta's gradients come out as the mean over the
ranks of the per-rank sums.
"""

import copy

import numpy as np

import chainer
from chainer import initializers, link, variable
from chainer.functions.normalization import batch_normalization as bn
from frontends.chainer.functions.batch_normalization import (
    MultiNodeBNImplSelector, get_communication_backend)

class MultiNodeBatchNormalization(link.Link):
    """Batch normalization whose batch statistics span every rank of `comm`.

    Arguments are those of ChainerMN's link: size (channels), comm, decay,
    eps, dtype, use_gamma, use_beta, initial_gamma, initial_beta and
    communication_backend ('mpi' or 'auto'; both use the coordinator)."""

    def __init__(self, size, comm, decay=0.9, eps=2e-5, dtype=None, use_gamma=True,
                 use_beta=True, initial_gamma=None, initial_beta=None,
                 communication_backend="auto"):
        super().__init__()
        self._communication_backend = get_communication_backend(comm, communication_backend)
        self._highprec_dtype = chainer.get_dtype(dtype, map_mixed16=np.float32)
        self.comm = comm
        # Named by what every rank agrees on, not by how many links this
        # process made (a rank may build a model the others do not): the
        # allreduces are blocking, so links of one size share a name in
        # turn, as ChainerMN's share MPI's call order.
        self._name = f"{comm._prefix}.mnbn.{size}.{np.dtype(self._highprec_dtype).name}"
        self.avg_mean = np.zeros(size, dtype=self._highprec_dtype)
        self.register_persistent("avg_mean")
        self.avg_var = np.zeros(size, dtype=self._highprec_dtype)
        self.register_persistent("avg_var")
        self.N = 0
        self.register_persistent("N")
        self.decay = decay
        self.eps = eps
        with self.init_scope():
            if use_gamma:
                init = initializers._get_initializer(1 if initial_gamma is None
                                                     else initial_gamma)
                init.dtype = self._highprec_dtype
                self.gamma = variable.Parameter(init, size)
            if use_beta:
                init = initializers._get_initializer(0 if initial_beta is None
                                                     else initial_beta)
                init.dtype = self._highprec_dtype
                self.beta = variable.Parameter(init, size)

    def forward(self, x, finetune=False):
        shape = self.avg_mean.shape
        xp = self.xp  # CuPy on a GPU: NumPy arrays beside a CuPy x are refused
        gamma = self.gamma if hasattr(self, "gamma") else variable.Variable(
            xp.ones(shape, dtype=self._highprec_dtype))
        beta = self.beta if hasattr(self, "beta") else variable.Variable(
            xp.zeros(shape, dtype=self._highprec_dtype))
        if not chainer.config.train:
            return bn.fixed_batch_normalization(x, gamma, beta, variable.Variable(self.avg_mean),
                                                variable.Variable(self.avg_var), self.eps)
        if finetune:
            self.N += 1
            decay = 1.0 - 1.0 / self.N
        else:
            decay = self.decay
        selector = MultiNodeBNImplSelector(self.comm, self._communication_backend, self._name)
        func = bn.BatchNormalization(self.eps, self.avg_mean, self.avg_var, decay,
                                     impl_selector=selector)
        y = func.apply((x, gamma, beta))[0]
        self.avg_mean[...] = func.running_mean
        self.avg_var[...] = func.running_var
        return y

    def start_finetuning(self):
        """Restarts the population count of fine-tuning mode."""
        self.N = 0

    def __deepcopy__(self, memo):
        """Copies everything but the communicator, which the copy shares."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update({k: v if k == "comm" else copy.deepcopy(v, memo)
                               for k, v in self.__dict__.items()})
        return clone
