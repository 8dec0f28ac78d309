"""Differentiable collectives: ChainerMN's allgather, alltoall, bcast,
gather and scatter as Chainer functions.

Forward runs the communicator's array method (so the tensors go through the
coordinator and appear in its timeline); backward runs the collective that
sends the gradients the opposite way:

    forward                      backward
    allgather                    alltoall, then the sum of what came back
    alltoall                     alltoall
    bcast (root to all)          allreduce (Sum); the root keeps the result
    gather (all to root)         scatter from the root
    scatter (root to all)        gather to the root

Every rank of the communicator must call the function and, later, run
backward through it: the backward collective needs every rank. Ranks
that do not hold the data (bcast and scatter away from the root) still get
an output that is part of the graph, so their backward joins in.

Unlike ChainerMN, float16 travels as float16 (the core moves and sums it;
ChainerMN converted to float32 and back), outputs keep the sender's dtype,
an output that gets no gradient takes part in backward with zeros
(ChainerMN failed), and the list-returning functions return a tuple even on
one rank.
"""

import numpy as np

import chainer


def _zeros_for_missing(grads, metas):
    """Gradients as arrays, zeros where an output got none (NumPy or CuPy
    zeros, as the output was: Chainer refuses the two mixed)."""
    return tuple(xp.zeros(shape, dtype) if g is None else g.array
                 for g, (shape, dtype, xp) in zip(grads, metas))


def _metas(arrays):
    return [(a.shape, a.dtype, chainer.backend.get_array_module(a)) for a in arrays]


def _sum(arrays, dtype):
    """Sum of same-shaped arrays, an array (0-d ones too: NumPy's sum gives
    a scalar, which Chainer refuses as a gradient); float16 is accumulated
    in float32."""
    acc = np.float32 if np.dtype(dtype) == np.float16 else dtype
    return np.asarray(np.sum(np.stack(arrays), axis=0, dtype=acc)).astype(dtype, copy=False)


def _variables(arrays):
    return tuple(chainer.Variable(a) for a in arrays)


def _placeholder():
    """A grad-requiring empty input for ranks without data, so that their
    output is in the graph and their backward joins the collective."""
    return chainer.Variable(np.empty((0,), dtype=np.float32))


class AllGather(chainer.FunctionNode):
    """Every rank receives every rank's array (shapes may differ)."""

    def __init__(self, comm):
        self.comm = comm

    def forward(self, inputs):
        x, = inputs
        ys = self.comm.allgather(x)
        self._out = _metas(ys)
        return ys

    def backward(self, indexes, grad_outputs):
        # gys[j] is the gradient of rank j's array: send it back to rank j,
        # which sums what every rank sent it.
        gys = _zeros_for_missing(grad_outputs, self._out)
        gxs = self.comm.alltoall(gys)
        node = self.inputs[0]
        return chainer.Variable(_sum(gxs, node.dtype).reshape(node.shape)),


class AllToAll(chainer.FunctionNode):
    """Rank j receives the j-th array of every rank."""

    def __init__(self, comm):
        self.comm = comm

    def forward(self, inputs):
        if len(inputs) != self.comm.size:
            raise ValueError("The length of inputs must be same as communicator size.")
        ys = self.comm.alltoall(tuple(inputs))
        self._out = _metas(ys)
        return ys

    def backward(self, indexes, grad_outputs):
        gys = _zeros_for_missing(grad_outputs, self._out)
        return _variables(self.comm.alltoall(gys))


class Bcast(chainer.FunctionNode):
    """The root's array, on every rank."""

    def __init__(self, comm, root):
        self.comm = comm
        self.root = root

    def forward(self, inputs):
        x = inputs[0] if self.comm.rank == self.root else None
        y = self.comm.bcast(x, self.root)
        self._out = _metas([y])
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = _zeros_for_missing(grad_outputs, self._out)
        total = self.comm.allreduce(gy)
        if self.comm.rank == self.root:
            return chainer.Variable(total),
        return None,  # the input is the placeholder


class Gather(chainer.FunctionNode):
    """Every rank's array, on the root; an empty delegate elsewhere."""

    def __init__(self, comm, root):
        self.comm = comm
        self.root = root

    def forward(self, inputs):
        x, = inputs
        ys = self.comm.gather(x, self.root)
        if self.comm.rank == self.root:
            self._out = _metas(ys)
            return ys
        xp = chainer.backend.get_array_module(x)
        self._out = [((0,), x.dtype, xp)]
        return xp.empty((0,), dtype=x.dtype),

    def backward(self, indexes, grad_outputs):
        if self.comm.rank == self.root:
            gx = self.comm.scatter(_zeros_for_missing(grad_outputs, self._out), self.root)
        else:
            gx = self.comm.scatter(None, self.root)
        return chainer.Variable(gx),


class Scatter(chainer.FunctionNode):
    """Rank i receives the root's i-th array."""

    def __init__(self, comm, root):
        self.comm = comm
        self.root = root

    def forward(self, inputs):
        xs = tuple(inputs) if self.comm.rank == self.root else None
        y = self.comm.scatter(xs, self.root)
        self._out = _metas([y])
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = _zeros_for_missing(grad_outputs, self._out)
        gxs = self.comm.gather(gy, self.root)
        if self.comm.rank == self.root:
            return _variables(gxs)
        return None,  # the input is the placeholder


def allgather(comm, x):
    """Differentiable all-gather: a tuple of every rank's `x` (a Variable
    or array; shapes may differ, dtypes may not). Backward sends each
    gradient back to the rank the array came from and sums there.

    Returns:
        tuple of chainer.Variable, one per rank, in rank order.
    """
    return AllGather(comm).apply((x,))


def alltoall(comm, xs):
    """Differentiable all-to-all: `xs` holds one Variable per rank; rank j
    receives the j-th of every rank. Backward passes the gradients back
    the same way.

    Returns:
        tuple of chainer.Variable, one per sending rank.
    """
    if len(xs) != comm.size:
        raise ValueError("The length of xs must be same as communicator size.")
    return AllToAll(comm).apply(tuple(xs))


def bcast(comm, x, root=0):
    """Differentiable broadcast of the root's `x` (ignored elsewhere).
    Backward sums every rank's gradient on the root.

    Returns:
        chainer.Variable: the root's array.
    """
    inputs = (x,) if comm.rank == root else (_placeholder(),)
    y, = Bcast(comm, root).apply(inputs)
    return y


def gather(comm, x, root=0):
    """Differentiable gather of every rank's `x` on the root. Backward
    scatters the root's gradients back to their ranks.

    Returns:
        On the root, a tuple of chainer.Variable (one per rank); elsewhere
        an empty delegate Variable to call backward() on (see
        pseudo_connect).
    """
    ys = Gather(comm, root).apply((x,))
    return ys if comm.rank == root else ys[0]


def scatter(comm, xs, root=0):
    """Differentiable scatter: rank i receives the root's xs[i] (`xs` is
    ignored away from the root). Backward gathers the gradients to the root.

    Returns:
        chainer.Variable: this rank's part.
    """
    inputs = tuple(xs) if comm.rank == root else (_placeholder(),)
    y, = Scatter(comm, root).apply(inputs)
    return y
