"""The multi-node batch-normalization function: Chainer's
batch_normalization with the batch statistics of every rank.

As in ChainerMN 7.8.1 this is an implementation that Chainer's
`BatchNormalization` function node runs (`impl_selector`), not a function
of its own: forward uses the mean and variance of the whole global batch
(the mean over ranks of per-rank E[x] and E[x^2]); backward averages the
per-rank sums of gy and gy * x_hat, so each rank's input gradient is that of
normalising the global batch. One allreduce of 2 * channels values runs in
each direction, on the coordinator. `MultiNodeBatchNormalization` (links)
uses it; so can anyone calling the function node directly:

    impl = MultiNodeBNImplSelector(comm, get_communication_backend(comm))
    func = chainer.functions.normalization.batch_normalization.BatchNormalization(
        eps, running_mean, running_var, decay, impl_selector=impl)
    y, = func.apply((x, gamma, beta))

The 'nccl' backend needs the pure_nccl communicator, as in ChainerMN; on
CuPy arrays the statistics stay on the device either way.
"""

from chainer.functions.normalization import batch_normalization as bn
import coordinator as hvd


class _MpiImpl(bn.GeneralBatchNormalizationImpl):
    """Chainer's batch normalization with statistics averaged over the ranks
    of `comm`, on the device the arrays are on (`xp`: NumPy or CuPy). With a
    `name`, the two allreduces are named after it (stable names hit the
    core's response cache); without one they take the communicator's next
    numbered names."""

    def __init__(self, comm, name=None):
        self.comm = comm
        self.name = name

    def _mean_over_ranks(self, tmp, what):
        if self.name is None:
            return self.comm._multi_node_mean(None, tmp)
        return hvd.allreduce(tmp, op=hvd.Average, name=f"{self.name}.{what}",
                             process_set=self.comm.process_set, output=tmp)

    def get_mean_and_var(self, axis, gamma, x, xp, interm_dtype):
        n = gamma.size
        tmp = xp.empty(2 * n, dtype=gamma.dtype)
        x.mean(axis=axis, out=tmp[:n], dtype=gamma.dtype)
        xp.square(x).mean(axis=axis, out=tmp[n:], dtype=gamma.dtype)
        self._mean_over_ranks(tmp, "stats")
        mean = tmp[:n]
        return mean, tmp[n:] - xp.square(mean)

    def get_ggamma_and_gbeta(self, axis, gamma, gy, x_hat, xp):
        # (Chainer's name; like Chainer's own, it returns gbeta first.)
        n = gamma.size
        tmp = xp.empty(2 * n, dtype=gamma.dtype)
        gy.sum(axis=axis, out=tmp[:n], dtype=gamma.dtype)
        (gy * x_hat).sum(axis=axis, out=tmp[n:], dtype=gamma.dtype)
        self._mean_over_ranks(tmp, "grads")
        return tmp[:n], tmp[n:]


def get_communication_backend(comm, communication_backend="auto"):
    """As ChainerMN: 'auto' is 'nccl' with the pure_nccl communicator and
    'mpi' otherwise; 'nccl' with any other communicator raises. Both run
    through the coordinator, which reduces device arrays with NCCL where it
    has it, whichever the name."""
    if communication_backend not in ("mpi", "nccl", "auto"):
        raise ValueError(f"MultiNodeBatchNormalization does not support "
                         f"{communication_backend}.")
    pure_nccl = getattr(comm, "name", None) == "pure_nccl"
    if communication_backend == "nccl" and not pure_nccl:
        raise ValueError(f"nccl is not supported in MultiNodeBatchNormalization when using "
                         f"{type(comm)} {getattr(comm, 'name', '')!r}: it needs the "
                         "pure_nccl communicator (use 'mpi' or 'auto')")
    if communication_backend == "auto":
        return "nccl" if pure_nccl else "mpi"
    return communication_backend


class MultiNodeBNImplSelector:
    """The `impl_selector` of Chainer's BatchNormalization function node."""

    def __init__(self, comm, communication_backend_name, name=None):
        get_communication_backend(comm, communication_backend_name)
        self.comm = comm
        self.communication_backend_name = communication_backend_name
        self.name = name

    def __call__(self, batch_norm_func, inputs):
        return _MpiImpl(self.comm, self.name)
