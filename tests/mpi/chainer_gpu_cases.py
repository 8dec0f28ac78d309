"""ChainerMN's GPU communicators on device arrays, under mpirun, on a machine
without a GPU: CuPy is the fake of tests/gpu_fakes.py (device memory is host
memory), with NCCL run over MPI when FAKE_NCCL=1 and no NCCL otherwise (the
core then stages device arrays through host memory). Run by
tests/test_gpu_fallback.py."""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402
from gpu_fakes import FakeDeviceArray  # noqa: E402

from core_cases import expect_raises  # noqa: E402

WITH_NCCL = os.environ.get("FAKE_NCCL") == "1"


def setup(hvd):
    from mpi4py import MPI

    from coordinator import gpu

    scratch = tempfile.mkdtemp(prefix=f"host-kernels-{MPI.COMM_WORLD.rank}-")
    nccl = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup()) if WITH_NCCL else None
    gpu._modules["cupy"] = gpu_fakes.fake_cupy(nccl, gpu_fakes.HostKernels(scratch))
    hvd.init()


def _chainermn():
    import frontends.chainer as chainermn

    return chainermn


class _Param:
    def __init__(self, array, grad=None):
        self.array, self.grad = array, grad


class _Model:
    """What the communicators read of a Chainer link: namedparams()."""

    def __init__(self, params):
        self.params = params

    def namedparams(self):
        return list(self.params.items())


def _device(values, dtype):
    return FakeDeviceArray.of(np.asarray(values, dtype))


def _gpu_comm(name=None):
    """pure_nccl where NCCL is, else 'flat' (pure_nccl refuses, as in ChainerMN)."""
    chainermn = _chainermn()
    if not WITH_NCCL:
        exc = expect_raises(RuntimeError, chainermn.create_communicator, "pure_nccl")
        assert "NCCL" in str(exc) and "'naive'" in str(exc), str(exc)
    return chainermn.create_communicator(name or ("pure_nccl" if WITH_NCCL else "flat"))


def case_gpu_communicators_average_device_gradients_in_place(hvd):
    from frontends.chainer.functions import batch_normalization as bn

    n, me = hvd.size(), hvd.rank()
    for name in (["pure_nccl"] if WITH_NCCL else []) + ["flat", "hierarchical",
                                                        "two_dimensional", "single_node",
                                                        "non_cuda_aware"]:
        comm = _chainermn().create_communicator(name)
        grads = {"/w": _device(np.arange(6).reshape(2, 3) * (me + 1), np.float32),
                 "/b": _device([me, 2 * me], np.float16),
                 "/v": _device(np.full(3, me + 1), np.float64)}
        model = _Model({k: _Param(_device(np.zeros(g.shape), g.dtype), g)
                        for k, g in grads.items()})
        model.params["/unused"] = _Param(_device(np.ones(2), np.float32))  # grad None
        comm.multi_node_mean_grad(model, zero_fill=True)
        mean = sum(range(1, n + 1)) / n
        for key, grad in grads.items():
            param = model.params[key]
            assert param.grad is grad, f"{name}: {key} was not averaged in place"
            assert isinstance(grad, FakeDeviceArray)
        np.testing.assert_allclose(grads["/w"].get(), np.arange(6).reshape(2, 3) * mean)
        np.testing.assert_allclose(grads["/b"].get(),
                                   np.array([(n - 1) / 2, n - 1], np.float16))
        np.testing.assert_allclose(grads["/v"].get(), np.full(3, mean))
        filled = model.params["/unused"].grad
        assert isinstance(filled, FakeDeviceArray) and filled.dtype == np.float32
        np.testing.assert_array_equal(filled.get(), np.zeros(2, np.float32))
        assert bn.get_communication_backend(comm, "auto") == (
            "nccl" if name == "pure_nccl" else "mpi")
        comm.finalize()


def case_pure_nccl_reduces_gradients_in_allreduce_grad_dtype(hvd):
    if not WITH_NCCL:
        return  # pure_nccl needs NCCL (checked in the case above)
    n, me = hvd.size(), hvd.rank()
    comm = _chainermn().create_communicator("pure_nccl", allreduce_grad_dtype=np.float16)
    assert comm.get_config("allreduce_grad_dtype") == np.float16
    base = np.array([0.1, 0.2, 1 / 3, 1000.1], np.float32)
    grad = _device(base * (me + 1), np.float32)
    model = _Model({"/w": _Param(_device(np.zeros(4), np.float32), grad)})
    comm.multi_node_mean_grad(model)
    got = model.params["/w"].grad
    assert got is grad and got.dtype == np.float32
    halves = [np.float16(base * (r + 1)).astype(np.float32) for r in range(n)]
    if n == 2:  # one reduction step, rounded once to float16, then halved
        want = (np.float16(halves[0] + halves[1]).astype(np.float32) / 2)
        np.testing.assert_array_equal(got.get(), want)
    exact = base * sum(range(1, n + 1)) / n
    assert not np.array_equal(got.get(), exact), "reduced in float32, not float16"
    np.testing.assert_allclose(got.get(), exact, rtol=2e-3)
    comm.set_config("allreduce_grad_dtype", None)  # back to the gradients' own dtype
    grad = _device(base * (me + 1), np.float32)
    model.params["/w"].grad = grad
    comm.multi_node_mean_grad(model)
    np.testing.assert_allclose(grad.get(), exact, rtol=1e-6)
    expect_raises(ValueError, comm.set_config, "allreduce_grad_dtype", np.int8)
    comm.finalize()


def case_array_collectives_keep_device_arrays_on_the_device(hvd):
    n, me = hvd.size(), hvd.rank()
    comm = _gpu_comm()
    params = {"/w": _Param(_device(np.full((2, 2), me), np.float32)),
              "/b": _Param(_device([me, me, me], np.int32))}
    comm.bcast_data(_Model(params))
    np.testing.assert_array_equal(params["/w"].array.get(), np.zeros((2, 2)))
    np.testing.assert_array_equal(params["/b"].array.get(), np.zeros(3))
    root = n - 1
    x = comm.bcast(_device(np.arange(4) + me, np.float32) if me == root else None, root=root)
    assert isinstance(x, FakeDeviceArray)
    np.testing.assert_array_equal(x.get(), np.arange(4) + root)
    total = comm.allreduce(_device([me, 1], np.float64))
    assert isinstance(total, FakeDeviceArray)
    np.testing.assert_array_equal(total.get(), [sum(range(n)), n])
    gathered = comm.allgather(_device(np.full((me + 1, 2), me), np.float32))
    assert len(gathered) == n
    for r, part in enumerate(gathered):
        assert isinstance(part, FakeDeviceArray) and part.shape == (r + 1, 2)
        np.testing.assert_array_equal(part.get(), np.full((r + 1, 2), r))
    received = comm.alltoall(tuple(_device([10 * me + r] * (r + 1), np.int64)
                                   for r in range(n)))
    for r, part in enumerate(received):
        assert isinstance(part, FakeDeviceArray)
        np.testing.assert_array_equal(part.get(), [10 * r + me] * (me + 1))
    at_root = comm.gather(_device([me, me], np.float32), root=0)
    if me == 0:
        assert all(isinstance(p, FakeDeviceArray) for p in at_root)
        np.testing.assert_array_equal(np.stack([p.get() for p in at_root]),
                                      [[r, r] for r in range(n)])
    else:
        assert at_root is None
    mine = comm.scatter(tuple(_device([r, r * r], np.float32) for r in range(n))
                        if me == 0 else None, root=0)
    assert isinstance(mine, FakeDeviceArray)
    np.testing.assert_array_equal(mine.get(), [me, me * me])
    if me == 0:
        comm.send(_device(np.arange(3), np.float16), 1, tag=7)
    elif me == 1:
        got = comm.recv(0, tag=7)
        assert isinstance(got, FakeDeviceArray)
        np.testing.assert_array_equal(got.get(), np.arange(3, dtype=np.float16))
    comm.finalize()


def case_dummy_checks_gradients_and_leaves_them(hvd):
    me = hvd.rank()
    comm = _chainermn().create_communicator("dummy")
    grad = _device([me, me + 1], np.float32)
    comm.multi_node_mean_grad(_Model({"/w": _Param(_device([0, 0], np.float32), grad)}))
    np.testing.assert_array_equal(grad.get(), [me, me + 1])
    comm.finalize()


class _RecordingOptimizer:
    """Stands for a Chainer optimizer: records the gradients each update sees."""

    def __init__(self, target):
        self.target = target
        self.seen = []

    def update(self, lossfun=None, *args, **kwds):
        self.seen.append({k: None if p.grad is None else p.grad.get()
                          for k, p in self.target.params.items()})


def case_double_buffering_updates_with_the_previous_steps_device_mean(hvd):
    n, me = hvd.size(), hvd.rank()
    comm = _gpu_comm()
    model = _Model({"/w": _Param(_device(np.full(3, me), np.float32))})
    actual = _RecordingOptimizer(model)
    opt = _chainermn().create_multi_node_optimizer(actual, comm, double_buffering=True)
    opt.update()  # the first update broadcasts rank 0's parameters
    np.testing.assert_array_equal(model.params["/w"].array.get(), np.zeros(3))
    assert actual.seen == []
    for step in range(1, 4):
        model.params["/w"].grad = _device(np.full(3, (me + 1) * step), np.float32)
        opt.update()
    opt.wait()
    mean = sum(range(1, n + 1)) / n
    # update k applies the mean of update k - 1's gradients: steps 1 and 2
    assert len(actual.seen) == 2, actual.seen
    for got, step in zip(actual.seen, (1, 2)):
        np.testing.assert_allclose(got["/w"], np.full(3, mean * step))
    comm.finalize()


class _LinkWithPersistents:
    """What AllreducePersistent reads of a Chainer link: namedlinks(), each
    link's _persistent names and their values in __dict__."""

    def __init__(self, **persistents):
        self._persistent = set(persistents)
        self.__dict__.update(persistents)

    def namedlinks(self):
        return [("/bn", self)]


def case_extensions_take_device_arrays(hvd):
    """On a GPU, Chainer's persistents and reported values are CuPy arrays:
    AllreducePersistent skipped them (the running statistics were never
    averaged), the multi-node evaluator and the early-stopping trigger
    passed them to np.asarray, which CuPy refuses."""
    from frontends.chainer.extensions import evaluator
    from frontends.chainer.extensions import multi_node_early_stopping_trigger as early

    n, me = hvd.size(), hvd.rank()
    mean = sum(range(n)) / n
    comm = _gpu_comm()
    link = _LinkWithPersistents(avg_mean=_device(np.full(3, me), np.float32),
                                N=_device(np.full(1, me), np.int64))
    from frontends.chainer.extensions.allreduce_persistent import AllreducePersistent

    AllreducePersistent(link, comm)()
    assert isinstance(link.avg_mean, FakeDeviceArray)
    np.testing.assert_allclose(link.avg_mean.get(), np.full(3, mean))
    np.testing.assert_array_equal(link.N.get(), [me])  # integers are left alone
    out = evaluator.mean_over_ranks(comm, {"main/loss": _device(float(me), np.float32),
                                           "main/acc": float(me)})
    assert isinstance(out["main/loss"], FakeDeviceArray), out
    np.testing.assert_allclose(np.asarray(out["main/loss"].get()), mean)
    np.testing.assert_allclose(out["main/acc"], mean)
    assert early._scalar(_device(2.5, np.float32)) == 2.5
    comm.finalize()
