"""create_multi_node_n_step_rnn: a stacked RNN split across ranks by time.

The link receives its initial hidden states (hx, and cx for LSTMs) from
`rank_in`, runs the wrapped NStep RNN, and sends its final states to
`rank_out`. It returns the RNN's outputs plus a delegate variable (None if
it sends nothing): connect the loss to it with `functions.pseudo_connect`,
so backward also runs through the sends, receiving the states' gradients
from `rank_out`.

The states travel in order (hx, then cx), and their gradients must come
back in the reverse order, the order in which the sender's backward waits
for them. The receives are therefore chained like MultiNodeChainList's
(cx's receive depends on hx), which fixes that order; ChainerMN received
them independently and relied on the order in which the wrapped RNN's graph
happens to reach them.
"""

import chainer
from chainer.links.rnn import n_step_rnn
from frontends.chainer.functions.point_to_point_communication import recv, send
from frontends.chainer.functions.pseudo_connect import pseudo_connect


class _MultiNodeNStepRNN(chainer.Chain):

    def __init__(self, link, communicator, rank_in, rank_out):
        if not isinstance(link, n_step_rnn.NStepRNNBase):
            raise ValueError("link must be NStepRNN and its inherited link")
        super().__init__(actual_rnn=link)
        self.communicator = communicator
        self.rank_in = rank_in
        self.rank_out = rank_out
        self.n_cells = link.n_cells

    def forward(self, *inputs):
        cells = [None] * self.n_cells
        if self.rank_in is not None:
            delegate = None
            for i in range(self.n_cells):
                cells[i] = recv(self.communicator, rank=self.rank_in,
                                delegate_variable=delegate)
                delegate = cells[i]

        outputs = self.actual_rnn(*(tuple(cells) + inputs))
        states = outputs[:-1]

        delegate = None
        if self.rank_out is not None:
            for i, state in enumerate(states):
                if i > 0:
                    state, = pseudo_connect(delegate, state)
                delegate = send(state, self.communicator, rank=self.rank_out)
        return outputs + (delegate,)


def create_multi_node_n_step_rnn(actual_link, communicator, rank_in=None, rank_out=None):
    """Wraps a Chainer NStep RNN link (NStepLSTM, NStepGRU, NStepRNNTanh,
    NStepRNNReLU and their Bi- versions) for model parallelism over time.

    Args:
        actual_link: the RNN link.
        communicator: the ChainerMN communicator.
        rank_in (int or None): the rank that sends this link its initial
            hidden states (None: the RNN's default zeros).
        rank_out (int or None): the rank to send the final hidden states to.

    Returns:
        A link whose call returns the RNN's outputs followed by the
        delegate variable (None when rank_out is None).
    """
    return _MultiNodeNStepRNN(actual_link, communicator, rank_in, rank_out)
