"""MultiNodeChainList: one rank's share of a model split across ranks.

Each rank builds its own MultiNodeChainList and adds its components in the
order they run, saying where each one's input comes from and where its
output goes:

    model.add_link(link, rank_in=None, rank_out=1)   # takes the model's inputs, sends to 1
    model.add_link(link2, rank_in=1, rank_out=None)  # receives from 1, is the model's output

`rank_in`/`rank_out` are a rank, a list of ranks (several inputs, several
receivers; this rank itself goes through a local queue), or None (the
model's inputs / the model's output). Calling the model runs the components
in order, receiving and sending with `functions.recv`/`functions.send`, and
threads a delegate variable through them (see `functions.pseudo_connect`),
so one backward() from the returned variable runs backward through every
component of this rank, in the reverse order, sending and receiving the
gradients each message needs. On a rank whose components all send, the
returned variable is that delegate: call backward() on it.

Semantics are ChainerMN's; in addition, ranks out of range are refused when
a component is added, components may take several model inputs or pass
tuples between ranks that have several inputs, and a component may return
a tuple as the model's output.
"""

import collections

import numpy as np

import chainer
from frontends.chainer.functions.point_to_point_communication import recv, send
from frontends.chainer.functions.pseudo_connect import pseudo_connect


def _first(x):
    """A variable of `x` (a Variable or a tuple of them) to delegate with:
    all outputs of one function node lead backward to the same node."""
    return x[0] if isinstance(x, tuple) else x


def _connect(delegate, x):
    """`x` made to depend on `delegate` (no-op without one)."""
    if delegate is None:
        return x
    if isinstance(x, tuple):
        return pseudo_connect(delegate, *x)
    y, = pseudo_connect(delegate, x)
    return y


class MultiNodeChainList(chainer.ChainList):
    """A ChainList whose components receive from and send to other ranks.

    Args:
        comm: the ChainerMN communicator the components talk over.
    """

    def __init__(self, comm):
        super().__init__()
        self._comm = comm
        self._rank_inouts = []

    def _ranks(self, ranks, what):
        if ranks is None:
            return None
        if isinstance(ranks, (int, np.integer)):
            ranks = [ranks]
        ranks = list(ranks)
        bad = [r for r in ranks
               if not isinstance(r, (int, np.integer)) or not 0 <= r < self._comm.size]
        if bad or not ranks:
            raise ValueError(f"MultiNodeChainList.add_link: {what}={ranks!r} must be None, a "
                             f"rank or a non-empty list of ranks of the communicator "
                             f"(size {self._comm.size})")
        return [int(r) for r in ranks]

    def add_link(self, link, rank_in=None, rank_out=None):
        """Adds the next component.

        Args:
            link (chainer.Link): the component.
            rank_in (int, list of int, or None): ranks it receives its
                inputs from, in order (None: the model's inputs).
            rank_out (int, list of int, or None): ranks it sends its
                output to, in order (None: it is the model's output; at
                most one component may be).
        """
        rank_in = self._ranks(rank_in, "rank_in")
        rank_out = self._ranks(rank_out, "rank_out")
        if rank_out is None and any(out is None for _, out in self._rank_inouts):
            raise ValueError("MultiNodeChainList cannot have more than one computational "
                             "graph component whose rank_out is None (the model's output)")
        super().add_link(link)
        self._rank_inouts.append((rank_in, rank_out))

    def forward(self, *inputs):
        comm = self._comm
        to_self = collections.deque()  # outputs this rank sends to itself
        y = None                # the model's output
        y_delegate = None       # the delegate just after y was produced
        delegate = None         # the last thing backward must pass through

        for i, (component, (rank_in, rank_out)) in enumerate(
                zip(self._children, self._rank_inouts)):
            if rank_in is None:
                xs = inputs if i == 0 else pseudo_connect(delegate, *inputs)
            else:
                xs = []
                for r in rank_in:
                    if r == comm.rank:
                        if not to_self:
                            raise ValueError(
                                f"MultiNodeChainList: component {i} receives from this rank "
                                f"({r}), but no earlier component sent to it")
                        x = _connect(delegate, to_self.popleft())
                    else:
                        x = recv(comm, rank=r, delegate_variable=delegate)
                    xs.append(x)
                    # The next receive runs backward before this one.
                    delegate = _first(x)
                # Backward reaches the earlier components through xs.
                delegate = None
            x = component(*xs)

            if rank_out is None:
                y = x
                delegate = y_delegate = _first(y)
                continue
            for j, r in enumerate(rank_out):
                if r == comm.rank:
                    x = _connect(delegate, x)
                    to_self.append(x)
                    delegate = _first(x)
                else:
                    if j > 0:
                        # Several receivers: their gradients arrive in reverse order.
                        x = _connect(delegate, x)
                    delegate = send(x, comm, rank=r)

        if to_self:
            raise ValueError("Communication queue is not empty at the end of forward. Make "
                             "sure if all rank_in and rank_out correspond each other.")
        if y is None:
            return delegate
        if delegate is y_delegate:
            return y
        return _connect(delegate, y)
