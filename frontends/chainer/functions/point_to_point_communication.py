"""Differentiable send and recv: the building blocks of model parallelism.

`send(x, comm, rank)` sends x to `rank` and returns an empty "delegate
variable"; backward through it receives x's gradient from `rank`.
`recv(comm, rank)` returns what `rank` sent; backward through it sends the
gradient back. So the gradient of a model split across ranks flows back
along the messages of the forward pass, in the opposite direction.

The messages are the communicator's `send`/`recv`, which travel through the
coordinator's point-to-point operations: negotiated like every collective
(the stall inspector names a message whose peer never comes, the liveness
checks end the wait if the peer dies, the timeline shows them), then moved
with MPI_Isend/MPI_Irecv. The k-th message between two ranks with a given
tag pairs with the k-th receive of that tag, as MPI orders messages, both in
forward and in backward. A send returns once the peer has received.
"""

import numpy as np

import chainer
from frontends.chainer.functions.collective_communication import _metas, _zeros_for_missing


def _check_peer(communicator, rank):
    if rank == communicator.rank:
        raise ValueError("rank must be different from communicator rank, otherwise "
                         "deadlock occurs")


class Send(chainer.FunctionNode):
    """Sends inputs[:-1] to `peer_rank`; inputs[-1] is a placeholder that
    keeps the function in the graph when no input requires a gradient."""

    def __init__(self, comm, peer_rank, peer_tag):
        self.comm = comm
        self.peer_rank = peer_rank
        self.peer_tag = peer_tag

    @property
    def label(self):
        return f"{type(self).__name__} (peer_rank: {self.peer_rank})"

    def forward(self, inputs):
        xs = inputs[:-1]
        self.comm.send(xs[0] if len(xs) == 1 else tuple(xs), self.peer_rank, self.peer_tag)
        self._xp = chainer.backend.get_array_module(*inputs)
        return self._xp.empty((0,), dtype=np.float32),

    def backward(self, indexes, grad_outputs):
        grads = self.comm.recv(self.peer_rank, self.peer_tag)
        if not isinstance(grads, tuple):
            grads = (grads,)
        out = []
        for node, g in zip(self.inputs[:-1], grads):
            # Integer inputs (labels, indices) have no gradient.
            out.append(chainer.Variable(g) if node.dtype.kind == "f" else None)
        out.append(chainer.Variable(self._xp.empty((0,), np.float32)))
        return tuple(out)


class Recv(chainer.FunctionNode):
    """Receives from `peer_rank`; its input is a placeholder or the
    delegate variable of the previous component."""

    def __init__(self, comm, peer_rank, peer_tag):
        self.comm = comm
        self.peer_rank = peer_rank
        self.peer_tag = peer_tag

    @property
    def label(self):
        return f"{type(self).__name__} (peer_rank: {self.peer_rank})"

    def forward(self, inputs):
        data = self.comm.recv(self.peer_rank, self.peer_tag)
        if not isinstance(data, tuple):
            data = (data,)
        self._out = _metas(data)
        self._in_xp = chainer.backend.get_array_module(*inputs)
        return data

    def backward(self, indexes, grad_outputs):
        grads = _zeros_for_missing(grad_outputs, self._out)
        self.comm.send(grads, self.peer_rank, self.peer_tag)
        # A zero gradient for the delegate, so that backward goes on into
        # the component before it.
        return tuple(chainer.Variable(self._in_xp.zeros(n.shape, n.dtype))
                     for n in self.inputs)


def send(x, communicator, rank, tag=0):
    """Sends `x` (a Variable or array, or a list/tuple of them) to `rank`.

    Returns:
        chainer.Variable: the delegate variable, holding no data. Calling
        backward() on it (or on something connected to it by recv's
        `delegate_variable` or pseudo_connect) receives the gradients from
        `rank`, which sends them when it runs backward through its recv.
    """
    _check_peer(communicator, rank)
    xs = tuple(x) if isinstance(x, (list, tuple)) else (x,)
    # In the arrays' own module (CuPy on a GPU): Chainer refuses a NumPy
    # input beside CuPy ones.
    xp = chainer.backend.get_array_module(*xs)
    placeholder = chainer.Variable(xp.empty((0,), np.float32))
    delegate, = Send(communicator, peer_rank=rank, peer_tag=tag).apply(xs + (placeholder,))
    delegate.name = "delegate_variable"
    return delegate


def recv(communicator, rank, delegate_variable=None, tag=0, force_tuple=False):
    """Receives what `rank` sent with `send` (and the same tag).

    Args:
        delegate_variable: the output of this rank's previous graph
            component (e.g. the delegate returned by an earlier `send`);
            backward then runs through that component after this recv
            (see pseudo_connect).
        force_tuple: return a tuple even when one array was sent.

    Returns:
        chainer.Variable, or a tuple of them if a tuple was sent (or
        force_tuple). Backward through them sends their gradients to `rank`.
    """
    _check_peer(communicator, rank)
    if delegate_variable is None:
        inputs = (chainer.Variable(np.empty((0,), np.float32)),)
    else:
        delegate_variable.name = "delegate_variable"
        inputs = (delegate_variable,)
    ys = Recv(communicator, peer_rank=rank, peer_tag=tag).apply(inputs)
    if len(ys) == 1 and not force_tuple:
        return ys[0]
    return ys
