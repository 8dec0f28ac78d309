"""The NCCL backend's host-aware allreduce (reduce-scatter in the host,
allreduce across hosts, allgather in the host), under mpirun at np=4 with
a simulated layout of 2 hosts x 2 ranks, on a machine without a GPU: the
fake CuPy of tests/gpu_fakes.py runs NCCL's calls as MPI calls on host
memory. Run by tests/test_gpu_fallback.py with HOROVOD_HIERARCHICAL_ALLREDUCE
or HOROVOD_TORUS_ALLREDUCE set."""

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402
from gpu_fakes import FakeDeviceArray  # noqa: E402

NCCL = {}


def setup(hvd):
    from mpi4py import MPI

    from coordinator import gpu

    scratch = tempfile.mkdtemp(prefix=f"host-kernels-{MPI.COMM_WORLD.rank}-")
    NCCL["fake"] = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup())
    gpu._modules["cupy"] = gpu_fakes.fake_cupy(NCCL["fake"], gpu_fakes.HostKernels(scratch))
    hvd.init()


def _backend():
    from coordinator import runtime

    backend = runtime.current().ops.backends[0]
    assert backend.name == "nccl", backend.name
    return backend


def _calls(kind):
    return [count for call, count in NCCL["fake"].calls if call == kind]


def _share(count, itemsize, ranks=2):
    """A rank's share: its part of `count` elements, rounded up to whole
    64 bytes of `itemsize`-byte elements."""
    part = -(-count // ranks)
    step = 64 // itemsize
    return -(-part // step) * step


def case_the_layout_is_two_hosts_of_two(hvd):
    assert hvd.size() == 4 and hvd.local_size() == 2 and hvd.cross_size() == 2


def case_allreduce_runs_in_the_host_then_across_hosts(hvd):
    n, me = hvd.size(), hvd.rank()
    backend = _backend()
    before = backend.two_level_calls
    NCCL["fake"].calls.clear()
    for dtype in (np.int16, np.int32, np.float32, np.float64):
        for count in (1, 2, 7, 1000):  # odd counts: the last share is padded
            x = [(np.arange(count) % 97 + 3 * r).astype(dtype) for r in range(n)]
            got = hvd.allreduce(FakeDeviceArray.of(x[me]), op=hvd.Sum,
                                name=f"s.{np.dtype(dtype).name}.{count}")
            assert isinstance(got, FakeDeviceArray)
            np.testing.assert_array_equal(got.get(), sum(x), err_msg=f"{dtype} {count}")
    avg = hvd.allreduce(FakeDeviceArray.of(np.full(5, me + 1, np.float32)), name="avg",
                        prescale_factor=3.0, postscale_factor=0.5)
    np.testing.assert_allclose(avg.get(), np.full(5, 3.0 * 0.5 * sum(range(1, n + 1)) / n))
    top = hvd.allreduce(FakeDeviceArray.of(np.array([me, -me, 7], np.float64)), op=hvd.Max,
                        name="max")
    np.testing.assert_array_equal(top.get(), [n - 1, 0, 7])
    assert backend.two_level_calls - before == 18
    # Per call: one reduce-scatter and one allgather of a share in the host,
    # one allreduce of that share across hosts; never a flat allreduce. Each
    # share is half the elements rounded up to whole 64 bytes of the fusion
    # buffer's type (int16 is reduced as int32).
    shares = [_share(c, size) for size in (4, 4, 4, 8) for c in (1, 2, 7, 1000)]
    shares += [_share(5, 4), _share(3, 8)]
    assert shares[:4] == [16, 16, 16, 512] and shares[12:16] == [8, 8, 8, 504]
    assert _calls("reduceScatter") == shares, _calls("reduceScatter")
    assert _calls("allGather") == shares
    assert _calls("allReduce") == shares


def case_fused_tensors_share_one_pass(hvd):
    n, me = hvd.size(), hvd.rank()
    NCCL["fake"].calls.clear()
    parts = [FakeDeviceArray.of(np.full(k + 1, me + k, np.float32)) for k in range(5)]
    outs = hvd.grouped_allreduce(parts, op=hvd.Sum, name="grouped")
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out.get(), np.full(k + 1, sum(r + k for r in range(n))))
    assert _calls("reduceScatter") == [16]  # 1+2+3+4+5 elements in one pass, 64-byte shares


def case_other_process_sets_and_host_tensors_do_not_use_it(hvd):
    me = hvd.rank()
    backend = _backend()
    before = backend.two_level_calls
    host = hvd.allreduce(np.full(3, me, np.float32), op=hvd.Sum, name="host")
    np.testing.assert_array_equal(host, np.full(3, 6.0))
    product = hvd.allreduce(FakeDeviceArray.of(np.full(2, me + 1, np.int64)), op=hvd.Product,
                            name="product")  # Product is reducible: two-level too
    np.testing.assert_array_equal(product.get(), np.full(2, 24))
    assert backend.two_level_calls == before + 1


def case_the_timeline_shows_each_level(hvd):
    import json

    path = os.path.join(tempfile.gettempdir(), f"host_aware_timeline_{os.getppid()}.json")
    hvd.start_timeline(path)
    hvd.allreduce(FakeDeviceArray.of(np.ones(10, np.float32)), op=hvd.Sum, name="levels")
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    (track,) = [e["pid"] for e in events if e.get("name") == "process_name"
                and e["args"]["name"].endswith("levels")]
    spans = [e["name"] for e in events if e.get("pid") == track and e["ph"] == "X"]
    assert spans == ["MEMCPY_IN_FUSION_BUFFER", "NCCL_REDUCESCATTER", "NCCL_ALLREDUCE",
                     "NCCL_ALLGATHER", "MEMCPY_OUT_FUSION_BUFFER"], spans
    labels = {e["name"] for e in events if e.get("pid") == track and e["ph"] == "B"}
    assert "NCCL_HIERARCHICAL_ALLREDUCE" in labels, labels
