"""create_multi_node_optimizer: any Chainer optimizer, updating with the mean
gradient over the ranks.

Both wrappers behave as ChainerMN's: the first update, and any update after
the set of initialised parameters changed (a lazily sized link that just got
its shape), broadcasts rank 0's parameters instead of updating, so every rank
starts from the same model. Later updates average the gradients over the
ranks, then run the wrapped optimizer. Attributes other than these methods
(lr, t, target, hooks, serialize, ...) are the wrapped optimizer's.

With double_buffering=True an update hands the gradients just computed to
the coordinator and updates with those of the previous iteration, averaged
while this iteration's forward and backward ran (ChainerMN's documented
semantics; there it needs the pure_nccl GPU communicator, here it runs on
every communicator, CPU or GPU, through the coordinator's asynchronous
handles). Counting updates after the
initial broadcast, update 1 only starts communication, and update k >= 2
applies the mean gradient computed in update k - 1: the gradient is one step
stale. `wait()` finishes the communication in flight; call it before reading
gradients or stopping.
"""

from frontends.chainer.communicators.coordinator_communicator import CoordinatorCommunicator


def _signature(target):
    return [(name, param.array is not None) for name, param in sorted(target.namedparams())]


class _Wrapper:
    """Forwards everything it does not define to the wrapped optimizer."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        object.__setattr__(self, "actual_optimizer", actual_optimizer)
        object.__setattr__(self, "communicator", communicator)
        object.__setattr__(self, "zero_fill", zero_fill)
        object.__setattr__(self, "_signature", None)

    def _own(self, name, value):
        object.__setattr__(self, name, value)

    def setup(self, link):
        self.actual_optimizer.setup(link)
        return self

    def _backward(self, lossfun, args, kwds):
        loss = lossfun(*args, **kwds)
        if getattr(self.actual_optimizer, "_use_cleargrads", True):
            self.target.cleargrads()
        else:
            self.target.zerograds()
        loss.backward(loss_scale=self.actual_optimizer._loss_scale)

    def _changed(self, target):
        signature = _signature(target)
        changed = signature != self._signature
        self._own("_signature", signature)
        return changed

    def __getattr__(self, name):
        return getattr(self.actual_optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.actual_optimizer, name, value)


class _MultiNodeOptimizer(_Wrapper):
    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        if self._changed(target):
            self.communicator.bcast_data(target)
        else:
            self.communicator.multi_node_mean_grad(target, self.zero_fill)
            self.actual_optimizer.update(None, *args, **kwds)


class _DoubleBufferingOptimizer(_Wrapper):
    def __init__(self, actual_optimizer, communicator, zero_fill):
        super().__init__(actual_optimizer, communicator, zero_fill)
        self._own("_inflight", None)  # gradients being averaged by the coordinator
        self._own("_ready", None)     # param id -> averaged gradient, waited for

    def wait(self):
        """Finishes the averaging in flight; the next update applies it."""
        pending = self._inflight
        if pending is None:
            return
        self._own("_inflight", None)
        self.communicator._finish_mean_grad(pending)
        self._own("_ready", {id(param): grad for param, grad, *_ in pending})

    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        if self._changed(target):
            self.wait()
            self._own("_ready", None)
            self.communicator.bcast_data(target)
            return
        self.wait()
        previous = self._ready
        self._own("_ready", None)
        params = self.communicator._grad_params(target, self.zero_fill)
        # The current gradient arrays now belong to the coordinator (averaged
        # in place); the parameters take the previous iteration's averages.
        self._own("_inflight", self.communicator._start_mean_grad(params))
        for _, param in params:
            param.grad = None if previous is None else previous.get(id(param))
        if previous is not None:
            self.actual_optimizer.update(None, *args, **kwds)


def create_multi_node_optimizer(actual_optimizer, communicator, double_buffering=False,
                                zero_fill=True):
    """Wraps a Chainer optimizer (e.g. chainer.optimizers.Adam()) so its
    updates use the mean gradient over the communicator's ranks.

    double_buffering: overlap the averaging with the next iteration's
        forward and backward, updating with one-step-stale gradients (see
        the module docstring).
    zero_fill: parameters left without a gradient this step take part with
        zeros, so every rank reduces the same tensors; without it they are
        skipped (and every rank must skip the same ones)."""
    if double_buffering:
        if not isinstance(communicator, CoordinatorCommunicator):
            raise ValueError("This communicator does not support double buffering.")
        return _DoubleBufferingOptimizer(actual_optimizer, communicator, zero_fill)
    return _MultiNodeOptimizer(actual_optimizer, communicator, zero_fill)


__all__ = ["create_multi_node_optimizer"]
