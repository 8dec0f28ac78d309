"""frontends.tensorflow's eager GPU path under mpirun, on a machine without a
GPU: CuPy is the fake of tests/gpu_fakes.py (device memory is host memory;
NCCL run over MPI when FAKE_NCCL=1, else the core stages device arrays
through host copies), and the bridge is told that TensorFlow's CPU tensors
are GPU tensors, so they take the GPU path: DLPack into CuPy arrays, the
core's device backend, DLPack back. Run by tests/test_gpu_fallback.py.

What this cannot show: TensorFlow's real GPU tensors, streams or NCCL (the
GPU machine's image has no TensorFlow)."""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402
from gpu_fakes import FakeDeviceArray  # noqa: E402

from tf_common import assert_equal, configure_tensorflow, data  # noqa: E402

configure_tensorflow()

import tensorflow as tf  # noqa: E402

import frontends.tensorflow as hvd  # noqa: E402
from frontends.tensorflow import tensor_bridge as bridge  # noqa: E402

WITH_NCCL = os.environ.get("FAKE_NCCL") == "1"
FAKE = {}
SYNCS = []  # one entry per device synchronisation the bridge asked for


def setup(core):
    from mpi4py import MPI

    from coordinator import gpu

    scratch = tempfile.mkdtemp(prefix=f"host-kernels-{MPI.COMM_WORLD.rank}-")
    FAKE["nccl"] = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup()) if WITH_NCCL else None
    FAKE["cupy"] = gpu._modules["cupy"] = gpu_fakes.fake_cupy(
        FAKE["nccl"], gpu_fakes.HostKernels(scratch))
    bridge._core_takes_devices.cache_clear()
    bridge.on_gpu = lambda tensor: True  # every eager tensor stands for a GPU tensor
    sync = tf.test.experimental.sync_devices

    def counted_sync():
        SYNCS.append(1)
        sync()
    tf.test.experimental.sync_devices = counted_sync
    hvd.init()


def _backend():
    from coordinator import runtime

    return runtime.current().ops.backends[0].name


class _Watch:
    """What went through the GPU path during a block: producers CuPy took,
    capsules the device arrays exported, NCCL calls, device syncs."""

    def __enter__(self):
        self.imported = len(FAKE["cupy"].imported)
        self.exported = FakeDeviceArray.exported
        self.nccl = len(FAKE["nccl"].calls) if WITH_NCCL else 0
        self.syncs = len(SYNCS)
        return self

    def __exit__(self, *exc):
        self.imported = len(FAKE["cupy"].imported) - self.imported
        self.exported = FakeDeviceArray.exported - self.exported
        self.nccl = (len(FAKE["nccl"].calls) - self.nccl) if WITH_NCCL else 0
        self.syncs = len(SYNCS) - self.syncs


def _everyone(shape, dtype, seed):
    return [data(r, shape, dtype, seed) for r in range(hvd.size())]


def case_the_core_runs_them_on_its_device_backend(core):
    assert _backend() == ("nccl" if WITH_NCCL else "mpi-staged"), _backend()


def case_allreduce_takes_and_returns_device_memory_in_every_dtype(core):
    n, me = hvd.size(), hvd.rank()
    for i, dtype in enumerate([np.float32, np.float64, np.float16, np.int32, np.int64,
                               np.uint8, "bfloat16"]):
        np_dtype = tf.bfloat16.as_numpy_dtype if dtype == "bfloat16" else np.dtype(dtype)
        xs = _everyone((3, 2), np_dtype, seed=i)
        with _Watch() as seen:
            out = hvd.allreduce(tf.constant(xs[me]), op=hvd.Sum, name=f"ar.{i}")
        want = sum(x.astype(np.float64) for x in xs).astype(np_dtype)
        assert_equal(out.numpy(), want, f"allreduce {dtype}")
        assert out.dtype == tf.as_dtype(np_dtype), out.dtype
        assert (seen.imported, seen.exported, seen.syncs) == (1, 1, 1), vars(seen)
        assert seen.nccl >= (1 if WITH_NCCL else 0), vars(seen)
    avg = hvd.allreduce(tf.constant(np.full(4, me + 1, np.float32)), name="avg",
                        postscale_factor=3.0)
    assert_equal(avg.numpy(), np.full(4, (n + 1) / 2 * 3.0, np.float32), "average")


def case_grouped_allreduce_synchronises_the_devices_once(core):
    me = hvd.rank()
    dtypes = [np.float32, np.float16, np.int32, "bfloat16"]
    np_dtypes = [tf.bfloat16.as_numpy_dtype if d == "bfloat16" else np.dtype(d) for d in dtypes]
    xs = [_everyone((k + 2,), d, seed=10 + k) for k, d in enumerate(np_dtypes)]
    with _Watch() as seen:
        outs = hvd.grouped_allreduce([tf.constant(x[me]) for x in xs], op=hvd.Sum,
                                     name="grouped")
    for k, (out, d) in enumerate(zip(outs, np_dtypes)):
        assert_equal(out.numpy(), sum(x.astype(np.float64) for x in xs[k]).astype(d),
                     f"grouped {d}")
    assert (seen.imported, seen.exported, seen.syncs) == (4, 4, 1), vars(seen)


def case_broadcast_allgather_alltoall_reducescatter_on_the_device(core):
    n, me = hvd.size(), hvd.rank()
    flags = _everyone((5,), np.bool_, seed=20)
    with _Watch() as seen:
        got = hvd.broadcast(tf.constant(flags[me]), root_rank=n - 1, name="bc.bool")
    assert_equal(got.numpy(), flags[n - 1], "broadcast bool")
    assert (seen.imported, seen.exported) == (1, 1), vars(seen)
    rows = [r + 1 for r in range(n)]  # a ragged first dimension
    gathered = hvd.allgather(tf.constant(np.full((rows[me], 2), me, np.float32)), name="ag")
    assert_equal(gathered.numpy(), np.concatenate(
        [np.full((rows[r], 2), r, np.float32) for r in range(n)]), "allgather")
    splits = [r + 1 for r in range(n)]
    src = np.repeat(np.arange(n, dtype=np.int32) + 10 * me, splits)
    out, received = hvd.alltoall(tf.constant(src), splits=splits, name="a2a")
    assert_equal(out.numpy(), np.array([10 * r + me for r in range(n) for _ in range(me + 1)],
                                       np.int32), "alltoall")
    assert_equal(received.numpy(), np.full(n, me + 1, np.int32), "alltoall received")
    total = 2 * n + 1
    xs = [np.arange(total * 2, dtype=np.float32).reshape(total, 2) * (r + 1) for r in range(n)]
    share = hvd.reducescatter(tf.constant(xs[me]), op=hvd.Sum, name="rs")
    counts = [total // n + (1 if r < total % n else 0) for r in range(n)]
    start = sum(counts[:me])
    assert_equal(share.numpy(), sum(xs)[start:start + counts[me]], "reducescatter")


def case_broadcast_variables_assigns_the_roots_values(core):
    me = hvd.rank()
    variables = [tf.Variable(np.full((2, 3), me + 1, np.float32)),
                 tf.Variable(np.full(4, me * 10, np.int64))]
    with _Watch() as seen:
        hvd.broadcast_variables(variables, root_rank=0)
    assert_equal(variables[0].numpy(), np.full((2, 3), 1, np.float32), "variable 0")
    assert_equal(variables[1].numpy(), np.zeros(4, np.int64), "variable 1")
    assert (seen.imported, seen.syncs) == (2, 1), vars(seen)


def case_distributed_gradient_tape_averages_on_the_device(core):
    n, me = hvd.size(), hvd.rank()
    w = tf.Variable(np.ones(3, np.float32))
    x = tf.constant(np.full(3, me + 1, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * x)
    tape = hvd.DistributedGradientTape(tape)
    with _Watch() as seen:
        (grad,) = tape.gradient(loss, [w])
    assert_equal(grad.numpy(), np.full(3, (n + 1) / 2, np.float32), "gradient")
    assert seen.imported >= 1 and seen.exported >= 1, vars(seen)
