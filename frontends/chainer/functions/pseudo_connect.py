"""pseudo_connect: ties a graph component to the one before it.

In model parallelism one rank's graph falls apart into components joined
only by messages: `send` ends a component (its output, the "delegate
variable", holds no data), `recv` starts one. Chainer walks back only along
the graph, so a component that does not depend on the delegate would never
run backward through the `send`, and the peer waiting for that gradient
would wait forever. `pseudo_connect(delegate, *xs)` returns `xs` unchanged
but makes them depend on the delegate: backward passes the gradients of
`xs` through and gives the delegate a zero gradient, which is enough for
Chainer to go on into the `send` before it (its backward then receives the
real gradient from the peer).
"""

import numpy as np

import chainer
from chainer import backend


class PseudoConnect(chainer.FunctionNode):
    """Returns inputs[1:] as they are; inputs[0] is the delegate."""

    def forward(self, inputs):
        delegate = inputs[0]
        self._delegate = (delegate.shape, delegate.dtype)
        return tuple(inputs[1:])

    def backward(self, indexes, grad_outputs):
        shape, dtype = self._delegate
        xp = backend.get_array_module(*[g.array for g in grad_outputs if g is not None])
        return (chainer.Variable(xp.zeros(shape, dtype)),) + tuple(grad_outputs)


def pseudo_connect(delegate_variable, *actual_variables):
    """Returns `actual_variables` (as a tuple) connected to
    `delegate_variable` in the graph, so that backward from them also runs
    backward through the component that produced the delegate.

    Args:
        delegate_variable (chainer.Variable or None): the output of the
            previous component, usually returned by `send`; None stands for
            an empty one (nothing to connect to).
        actual_variables: the Variables (or arrays) to pass through.

    Returns:
        tuple of chainer.Variable: the same values as `actual_variables`.
    """
    if delegate_variable is None:  # (in the variables' module: NumPy or CuPy)
        xp = chainer.backend.get_array_module(*actual_variables)
        delegate_variable = xp.empty((0,), np.float32)
    return PseudoConnect().apply((delegate_variable,) + tuple(actual_variables))
