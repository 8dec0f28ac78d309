"""The single-process parts of ChainerMN's model parallelism in
frontends.chainer: pseudo_connect, and the names a ChainerMN script imports."""

import numpy as np
import pytest

from chainer_presence import CHAINER_REASON, NO_CHAINER

if NO_CHAINER:
    pytest.skip(CHAINER_REASON, allow_module_level=True)

import frontends.chainer as chainermn

import chainer  # noqa: E402 (after the frontend, which makes Chainer importable)
import chainer.functions as F  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("delegate_shape", [(3, 2), ()])
@pytest.mark.parametrize("shapes", [[(4, 5), (3, 2)], [(3, 2)], [()]])
def test_pseudo_connect_passes_values_and_gradients_through_and_zeros_to_the_delegate(
        dtype, delegate_shape, shapes):
    rng = np.random.RandomState(0)
    delegate = chainer.Variable(rng.uniform(-1, 1, delegate_shape).astype(dtype))
    xs = [chainer.Variable(rng.uniform(-1, 1, s).astype(dtype)) for s in shapes]
    gys = [rng.uniform(-1, 1, s).astype(dtype) for s in shapes]
    ys = chainermn.functions.pseudo_connect(delegate, *xs)
    assert isinstance(ys, tuple) and len(ys) == len(xs)
    for x, y in zip(xs, ys):
        assert y.dtype == dtype
        np.testing.assert_array_equal(y.array, x.array)
    for y, gy in zip(ys, gys):
        y.grad = gy
    chainer.backward(list(ys))
    for x, gy in zip(xs, gys):
        np.testing.assert_array_equal(x.grad, gy)
    np.testing.assert_array_equal(delegate.grad, np.zeros(delegate_shape, dtype))


def test_pseudo_connect_makes_backward_run_through_the_delegates_graph():
    w = chainer.Variable(np.ones(3, np.float32))
    delegate = F.sum(w * 2)  # stands for the output of an earlier component
    x = chainer.Variable(np.arange(3, dtype=np.float32))
    y, = chainermn.functions.pseudo_connect(delegate, x)
    F.sum(y * y).backward()
    np.testing.assert_array_equal(x.grad, 2 * x.array)
    np.testing.assert_array_equal(w.grad, np.zeros(3, np.float32))  # reached, with zeros


def test_pseudo_connect_without_a_delegate_is_the_identity():
    x = chainer.Variable(np.ones((2, 2), np.float32))
    y, = chainermn.functions.pseudo_connect(None, x)
    F.sum(y).backward()
    np.testing.assert_array_equal(x.grad, np.ones((2, 2), np.float32))


def test_a_chainermn_model_parallel_script_finds_every_name():
    # What ChainerMN's model-parallel tests and examples import.
    for name in ("allgather", "alltoall", "bcast", "gather", "scatter", "send", "recv",
                 "pseudo_connect"):
        assert callable(getattr(chainermn.functions, name)), name
    assert chainermn.MultiNodeChainList is chainermn.links.MultiNodeChainList
    assert callable(chainermn.links.create_multi_node_n_step_rnn)
    assert callable(chainermn.extensions.multi_node_snapshot)
    assert callable(chainermn.extensions._multi_node_snapshot._parse_replica_sets)
    assert callable(chainermn.extensions.MultiNodeEarlyStoppingTrigger)
    assert callable(chainermn.extensions.create_multi_node_early_stopping_trigger)
    assert callable(chainermn.global_except_hook.add_hook)
    bn = chainermn.functions.batch_normalization
    assert bn.get_communication_backend(None, "auto") == "mpi"
    with pytest.raises(ValueError, match="does not support"):
        bn.get_communication_backend(None, "gloo")
    with pytest.raises(ValueError, match="pure_nccl"):
        bn.get_communication_backend(None, "nccl")

    class PureNccl:
        name = "pure_nccl"
    assert bn.get_communication_backend(PureNccl(), "auto") == "nccl"
    assert bn.get_communication_backend(PureNccl(), "nccl") == "nccl"
    assert bn.get_communication_backend(PureNccl(), "mpi") == "mpi"
