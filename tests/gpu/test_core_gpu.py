"""The core API on CuPy arrays, checked against NumPy, on every rank of the
job (np=2 under `make test-gpu`). Every rank can compute every other rank's
input (`data`), so each test knows the exact result."""

import time

import numpy as np
import pytest

from coordinator import dtypes, gpu

BF16 = dtypes.BFLOAT16
REDUCE = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"] + \
    (["bfloat16"] if BF16 is not None else [])
MOVE = REDUCE + ["bool"]


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def data(rank, shape, name, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    if name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(np_dtype(name)).kind in "iu":
        return rng.integers(1, 5, size=shape).astype(np_dtype(name))
    return rng.integers(-8, 8, size=shape).astype(np.float32).astype(np_dtype(name))


def on_device(cp, host):
    """The device form of a host array (bfloat16: the marked int16 view)."""
    host = np.ascontiguousarray(host)
    if host.dtype == BF16:
        return gpu.bfloat16(cp.asarray(host.view(np.int16)))
    return cp.asarray(host)


def to_host(arr, name):
    host = arr.get()
    return host.view(BF16) if name == "bfloat16" else host


def check(actual, expected, what):
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    np.testing.assert_array_equal(actual.astype(np.float64), expected.astype(np.float64),
                                  err_msg=what)


@pytest.mark.parametrize("name", REDUCE)
def test_allreduce_every_op_and_dtype_against_numpy(hvd, cp, name):
    n, me = hvd.size(), hvd.rank()
    inputs = [data(r, (3, 5), name, seed=1) for r in range(n)]
    wide = np.stack([x.astype(np.float64) for x in inputs])
    expected = {hvd.Sum: wide.sum(0), hvd.Min: wide.min(0), hvd.Max: wide.max(0),
                hvd.Product: wide.prod(0)}
    for op, want in expected.items():
        out = hvd.allreduce(on_device(cp, inputs[me]), op=op, name=f"ar.{name}.{op}")
        assert isinstance(out, cp.ndarray) and out.device.id == cp.cuda.Device().id
        check(to_host(out, name), want, f"{name} op {op}")
    avg = to_host(hvd.allreduce(on_device(cp, inputs[me]), name=f"ar.{name}.avg"), name)
    want = wide.sum(0) / n
    check(avg, np.trunc(want) if np.dtype(np_dtype(name)).kind in "iu" else want, f"{name} avg")


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "int32"])
def test_fused_allreduce_with_scale_factors(hvd, cp, name):
    if name == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    n, me = hvd.size(), hvd.rank()
    shapes = [(3,), (2, 4), (0,), (7, 1)]
    inputs = [[data(r, s, name, seed=i) for i, s in enumerate(shapes)] for r in range(n)]
    outs = hvd.grouped_allreduce([on_device(cp, x) for x in inputs[me]], op=hvd.Sum,
                                 prescale_factor=0.5, postscale_factor=4.0,
                                 name=f"fused.{name}")
    for i, out in enumerate(outs):
        want = sum(inputs[r][i].astype(np.float64) * 0.5 for r in range(n)) * 4.0
        if np.dtype(np_dtype(name)).kind in "iu":
            want = sum(np.trunc(inputs[r][i] * 0.5) for r in range(n)) * 4.0
        check(to_host(out, name), want, f"{name} tensor {i}")


def test_allreduce_in_place_into_output(hvd, cp):
    x = cp.full(1000, hvd.rank() + 1, cp.float32)
    out = hvd.allreduce(x, op=hvd.Sum, output=x, name="inplace")
    assert out is x
    assert float(x[0]) == sum(r + 1 for r in range(hvd.size()))


@pytest.mark.parametrize("name", MOVE)
def test_allgather_ragged_first_dimension(hvd, cp, name):
    n, me = hvd.size(), hvd.rank()
    inputs = [data(r, (r + 1, 3), name, seed=2) for r in range(n)]
    out = hvd.allgather(on_device(cp, inputs[me]), name=f"ag.{name}")
    check(to_host(out, name), np.concatenate(inputs), f"allgather {name}")
    outs = hvd.grouped_allgather([on_device(cp, inputs[me]), on_device(cp, inputs[me][:, :1])],
                                 name=f"gag.{name}")
    check(to_host(outs[1], name), np.concatenate([x[:, :1] for x in inputs]), name)


@pytest.mark.parametrize("name", MOVE)
def test_broadcast_from_the_last_rank_in_place(hvd, cp, name):
    n, me = hvd.size(), hvd.rank()
    inputs = [data(r, (4, 2), name, seed=3) for r in range(n)]
    x = on_device(cp, inputs[me])
    out = hvd.broadcast(x, root_rank=n - 1, output=x, name=f"bc.{name}")
    check(to_host(out, name), inputs[n - 1], f"broadcast {name}")


@pytest.mark.parametrize("name", ["uint8", "float16", "bfloat16", "float32", "int64", "bool"])
def test_alltoall_with_splits(hvd, cp, name):
    if name == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    n, me = hvd.size(), hvd.rank()
    splits = [[(r + p) % 3 for p in range(n)] for r in range(n)]  # rows rank r sends to p
    inputs = [data(r, (sum(splits[r]), 2), name, seed=4) for r in range(n)]
    out, received = hvd.alltoall(on_device(cp, inputs[me]), splits=splits[me], name=f"a2a.{name}")
    parts = []
    for r in range(n):
        start = sum(splits[r][:me])
        parts.append(inputs[r][start:start + splits[r][me]])
    check(to_host(out, name), np.concatenate(parts), f"alltoall {name}")
    assert list(received) == [splits[r][me] for r in range(n)]


@pytest.mark.parametrize("name", ["int16", "int32", "float16", "bfloat16", "float32", "float64"])
def test_reducescatter_uneven_rows(hvd, cp, name):
    if name == "bfloat16" and BF16 is None:
        pytest.skip("needs ml_dtypes")
    n, me = hvd.size(), hvd.rank()
    rows = 2 * n + 1  # the first rank gets one row more
    inputs = [data(r, (rows, 3), name, seed=5) for r in range(n)]
    total = sum(x.astype(np.float64) for x in inputs)
    shares = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(shares[:me])
    mine = total[start:start + shares[me]]
    out = hvd.reducescatter(on_device(cp, inputs[me]), op=hvd.Sum, name=f"rs.{name}")
    check(to_host(out, name), mine, f"reducescatter {name}")
    avg = hvd.reducescatter(on_device(cp, inputs[me]), op=hvd.Average, name=f"rsa.{name}")
    want = mine / n
    check(to_host(avg, name), np.trunc(want) if np.dtype(np_dtype(name)).kind in "iu" else want,
          f"reducescatter average {name}")


def test_send_and_recv(hvd, cp):
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    if hvd.rank() == 0:
        hvd.send(cp.arange(10, dtype=cp.float16), 1, name="p2p")
    elif hvd.rank() == 1:
        got = hvd.recv(0, name="p2p")
        assert isinstance(got, cp.ndarray)
        check(got.get(), np.arange(10), "recv")


def test_byte_calls_in_pieces_cut_through_elements(hvd, cp, monkeypatch):
    """Broadcast, allgather, alltoall and send/recv move bytes in pieces of
    at most nccl_ops.PIECE_BYTES (1 GiB; some CuPy releases take broadcast's
    count as a C int): with 12-byte pieces, which cut through 8-byte
    elements, the results are still exact."""
    from coordinator.ops import nccl_ops

    monkeypatch.setattr(nccl_ops, "PIECE_BYTES", 12)
    n, me = hvd.size(), hvd.rank()
    inputs = [data(r, (r + 2, 3), "float64", seed=7) for r in range(n)]
    out = hvd.allgather(on_device(cp, inputs[me]), name="pieces.ag")
    check(out.get(), np.concatenate(inputs), "allgather in pieces")
    b = hvd.broadcast(on_device(cp, inputs[me][:2]), root_rank=n - 1, name="pieces.bc")
    check(b.get(), inputs[n - 1][:2], "broadcast in pieces")
    splits = [2] * n
    x = np.arange(2 * n * 3, dtype=np.float64).reshape(2 * n, 3) + 100 * me
    got, _ = hvd.alltoall(on_device(cp, x), splits=splits, name="pieces.a2a")
    check(got.get(), np.concatenate([np.arange(2 * n * 3, dtype=np.float64).reshape(2 * n, 3)
                                     [2 * me:2 * me + 2] + 100 * r for r in range(n)]),
          "alltoall in pieces")
    if n > 1 and me < 2:
        if me == 0:
            hvd.send(cp.arange(7, dtype=cp.float64), 1, name="pieces.p2p")
        else:
            check(hvd.recv(0, name="pieces.p2p").get(), np.arange(7), "recv in pieces")


def test_send_recv_and_allreduces_submitted_in_opposite_orders(hvd, cp):
    """A send/recv runs on its pair's own NCCL communicator and stream,
    allreduces on the set's: each rank queues its NCCL calls in the order
    the negotiation gave (executor.py), whatever order they were submitted
    in, so no rank waits on the device for a call its peer queued later."""
    if hvd.size() < 2:
        pytest.skip("needs 2 ranks")
    me = hvd.rank()
    for step in range(3):
        x = cp.full(1 << 20, me + step, cp.float32)
        handles = {"ar": lambda: hvd.allreduce_async(x, op=hvd.Sum, name=f"opp.ar.{step}")}
        if me == 0:
            handles["p2p"] = lambda: hvd.send_async(cp.arange(7, dtype=cp.int32) + step, 1,
                                                    name=f"opp.p2p.{step}")
        elif me == 1:
            handles["p2p"] = lambda: hvd.recv_async(0, name=f"opp.p2p.{step}")
        order = sorted(handles, reverse=bool(me % 2))  # the other order on odd ranks
        handles = {key: handles[key]() for key in order}
        results = {key: hvd.synchronize(h) for key, h in handles.items()}
        want = sum(r + step for r in range(hvd.size()))
        check(results["ar"].get()[:4], np.full(4, want), "allreduce beside send/recv")
        if me == 1:
            check(results["p2p"].get(), np.arange(7) + step, "recv beside allreduce")


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def test_submit_returns_while_the_gpu_is_still_busy(hvd, cp):
    """The submitting thread never waits for the GPU: the ready event is
    queued behind the caller's work, and only the coordinator's stream waits
    for it."""
    spin = cp.RawKernel(_SPIN, "spin")
    x = cp.ones(1 << 20, cp.float32)
    # Load every kernel first: loading a CUDA module can wait for the device
    # (measured on the H100: the spin had ended by the time `x *= 2` came back).
    spin((1,), (1,), (np.int64(1000),))
    x *= 2
    x /= 2
    cp.cuda.Event().record()
    cp.cuda.get_current_stream().synchronize()
    spin((1,), (1,), (np.int64(3_000_000_000),))  # about a second and more
    x *= 2  # queued behind the spin: the allreduce must read this
    behind = cp.cuda.Event()
    behind.record()  # on the current stream, after the doubling
    busy = not behind.done
    start = time.perf_counter()
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="busy")
    submitted = time.perf_counter() - start
    assert busy, "the spin finished before the test could look"
    assert submitted < 0.2, f"allreduce_async took {submitted:.3f} s: it waited for the GPU"
    out = hvd.synchronize(handle)
    assert float(out[0]) == 2 * hvd.size()


_SPIN_THEN_SUM = r"""
extern "C" __global__ void spin_then_sum(const float* x, long long n, double* out,
                                         long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    double s = 0;
    for (long long i = 0; i < n; ++i) s += x[i];
    out[0] = s;
}
"""


def test_a_dropped_result_still_being_read_is_not_written_over(hvd, cp):
    """gpu.fence_events on the GPU: a result the caller drops while its
    kernels still read it goes back to CuPy's pool, which may hand its
    memory to the next collective's result, whose ready event was recorded
    at submission (its lane was idle), before those kernels. The collective
    must write its result only after they are done."""
    n, me = hvd.size(), hvd.rank()
    count = 1 << 16
    kernel = cp.RawKernel(_SPIN_THEN_SUM, "spin_then_sum")
    total = cp.zeros(1, cp.float64)
    kernel((1,), (1,), (cp.zeros(1, cp.float32), np.int64(1), total, np.int64(1000)))  # load
    a = hvd.allgather(cp.full(count, me + 1, cp.float32), name="fence.a")
    cp.cuda.get_current_stream().synchronize()
    a_ptr = a.data.ptr
    handle = hvd.allgather_async(cp.full(count, -100.0 * (me + 1), cp.float32), name="fence.b")
    # Reads `a` after spinning for about a third of a second, then it is dropped.
    kernel((1,), (1,), (a, np.int64(a.size), total, np.int64(500_000_000)))
    del a
    b = hvd.synchronize(handle)
    cp.cuda.get_current_stream().synchronize()
    assert float(total[0]) == count * sum(r + 1 for r in range(n)), \
        "the dropped result was written over while still read"
    check(b.get(), np.concatenate([np.full(count, -100.0 * (r + 1)) for r in range(n)]), "b")
    if b.data.ptr != a_ptr:
        pytest.skip("passed, but not exercised: the pool did not hand a's memory to b")


def test_staged_ops_hand_mpi_host_memory_only(hvd, cp):
    """Where NCCL cannot run (or for Adasum) device tensors are staged through
    pinned host memory: every MPI call sees host buffers only."""
    from mpi4py import MPI

    from coordinator.fusion import FusionBuffers
    from coordinator.ops import OperationManager
    from coordinator.ops.adasum import AdasumOps
    from coordinator.ops.mpi_ops import Communicators, MPIOps, mpi_cuda_aware
    from coordinator.ops.staging import HostStaging, StagedDeviceOps
    from coordinator.tensor_queue import Entry
    from coordinator.timeline import Timeline
    from coordinator.wire import pb
    from gpu_fakes import CheckedComm

    print(f"MPI CUDA-aware: {mpi_cuda_aware()}")
    n, me = hvd.size(), hvd.rank()
    comm = CheckedComm(MPI.COMM_WORLD.Dup())
    comms = Communicators(comm, lambda pid: list(range(n)))
    host = OperationManager([AdasumOps(comms, Timeline()),
                             MPIOps(comms, FusionBuffers(), Timeline(), me)])
    ops = StagedDeviceOps(host, HostStaging())

    def run(op, wire, method, arrays, **kwargs):
        response = pb.Response(op=op, process_set_id=0, dtype=wire, prescale=1.0,
                               postscale=1.0, device=cp.cuda.Device().id,
                               reduce_op=kwargs.pop("reduce_op", 0),
                               sizes=kwargs.pop("sizes", []))
        entries = []
        for i, a in enumerate(arrays):
            arr, info, device = gpu.as_device_array(a, "staged")
            entries.append(Entry(f"t{i}", op, tensor=arr, dtype_info=info, shape=arr.shape,
                                 device=device))
        gpu.record_ready(entries)
        gen = getattr(ops, method)(response, entries, [e.name for e in entries], **kwargs)
        try:
            waiting = next(gen)
            while True:
                while not waiting.ready():
                    pass
                waiting = gen.send(None)
        except StopIteration as stop:
            return stop.value

    inputs = [data(r, (4, 3), "float32", seed=6) for r in range(n)]
    (out,) = run(pb.ALLREDUCE, pb.FLOAT32, "allreduce", [cp.asarray(inputs[me])],
                 reduce_op=pb.SUM)
    check(out.get(), sum(inputs), "staged allreduce")
    if BF16 is not None:
        bf = [x.astype(BF16) for x in inputs]
        (out,) = run(pb.ALLREDUCE, pb.BFLOAT16, "allreduce", [on_device(cp, bf[me])],
                     reduce_op=pb.SUM)
        check(to_host(out, "bfloat16"), sum(x.astype(np.float64) for x in bf), "staged bf16")
    (out,) = run(pb.ALLGATHER, pb.FLOAT32, "allgather", [cp.asarray(inputs[me])],
                 sizes=[4] * n)
    check(out.get(), np.concatenate(inputs), "staged allgather")
    (out,) = run(pb.BROADCAST, pb.FLOAT32, "broadcast", [cp.asarray(inputs[me])], root=0)
    check(out.get(), inputs[0], "staged broadcast")
    (out,) = run(pb.ALLREDUCE, pb.FLOAT32, "allreduce", [cp.asarray(inputs[me])],
                 reduce_op=pb.ADASUM)
    assert out.shape == (4, 3)
    assert comm.calls > 0


def _native_bfloat16(cp):
    """Whether this CuPy has a bfloat16 dtype (v14 on, through ml_dtypes)."""
    if BF16 is None:
        return False
    try:
        cp.zeros(1, BF16)
    except Exception:
        return False
    return True


def test_native_bfloat16_arrays_get_bfloat16_results(hvd, cp):
    """CuPy 14's own bfloat16 arrays go in as they are and their results are
    bfloat16 arrays (not int16 arrays of the bits)."""
    if not _native_bfloat16(cp):
        pytest.skip("this CuPy has no bfloat16 dtype (CuPy 14 has)")
    n, me = hvd.size(), hvd.rank()
    inputs = [data(r, (n * 2, 3), "bfloat16", seed=9) for r in range(n)]
    x = cp.asarray(inputs[me].view(np.int16)).view(BF16)
    assert x.dtype == BF16
    wide = [a.astype(np.float64) for a in inputs]
    results = {
        "allreduce": (hvd.allreduce(x, op=hvd.Sum, name="nbf.ar"), sum(wide)),
        "allgather": (hvd.allgather(x, name="nbf.ag"), np.concatenate(wide)),
        "broadcast": (hvd.broadcast(x, root_rank=n - 1, name="nbf.bc"), wide[n - 1]),
        "alltoall": (hvd.alltoall(x, name="nbf.a2a"),
                     np.concatenate([w[2 * me:2 * me + 2] for w in wide])),
        "reducescatter": (hvd.reducescatter(x, op=hvd.Sum, name="nbf.rs"),
                          sum(wide)[2 * me:2 * me + 2]),
    }
    for what, (out, want) in results.items():
        assert out.dtype == BF16, f"{what}: {out.dtype}"
        check(out.view(np.int16).get().view(BF16), want, f"native bfloat16 {what}")
