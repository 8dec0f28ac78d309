"""The GPU path's decisions and host-side machinery, on a machine without a
GPU: a fake CuPy (tests/gpu_fakes.py) whose "device" memory is host memory
stands in for CuPy.

- The core recognises CUDA arrays without importing CuPy for NumPy input,
  and says clearly when CuPy is missing.
- Which backends run device tensors (NCCL, or staging through host memory)
  and whether MPI is CUDA-aware.
- A device array never reaches MPI: the staging backend hands it host
  memory only, in process and end to end at np=2 under mpirun (`case_*`
  below, run by mpi_harness), where every MPI call of the data
  communicators is checked.
- The NCCL backend's bookkeeping (lanes, tables, fusion, ragged shares)
  against NumPy at np=2, with NCCL calls run as MPI calls on host memory.
- The device-fusion kernels, compiled as C for the host, against fusion.py.

Real streams, events, CUDA and NCCL are tested on a GPU only (tests/gpu/).
"""

import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import types

import numpy as np
import pytest

if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
    import mpi4py

    mpi4py.rc.initialize = False  # in process nothing starts MPI (as coordinator/run.py)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_fakes  # noqa: E402
from gpu_fakes import FakeDeviceArray  # noqa: E402

from coordinator import collectives, dtypes, fusion, gpu  # noqa: E402
from coordinator.ops.mpi_ops import Making  # noqa: E402
from coordinator.tensor_queue import Entry  # noqa: E402
from coordinator.wire import pb  # noqa: E402

BF16 = dtypes.BFLOAT16
NEEDS_GCC = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for host kernels")


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = gpu_fakes.fake_cupy()
    monkeypatch.setitem(gpu._modules, "cupy", cp)
    return cp


@pytest.fixture(scope="module")
def host_kernels():
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the kernels for the host")
    with tempfile.TemporaryDirectory() as scratch:
        yield gpu_fakes.HostKernels(scratch)


def drive(gen):
    """Runs a backend generator to its result (every fake step is ready, but
    for a communicator made in a helper thread, which takes a moment)."""
    try:
        waiting = next(gen)
        while True:
            deadline = time.monotonic() + 30
            while not waiting.ready():
                assert isinstance(waiting, Making) and time.monotonic() < deadline
                time.sleep(1e-3)
            waiting = gen.send(None)
    except StopIteration as stop:
        return stop.value


# --------------------------------------------------------- the core's input
def test_numpy_input_never_imports_cupy():
    before = "cupy" in sys.modules
    arr, info, device = collectives._array(np.ones(3, np.float32), "x", True)
    assert device == -1 and info.name == "float32"
    assert not gpu.is_device_array([1, 2]) and not gpu.is_device_array(np.ones(2))
    assert ("cupy" in sys.modules) == before


def test_a_cuda_array_is_viewed_in_place_with_its_device(fake_cupy):
    x = FakeDeviceArray.of(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert gpu.is_device_array(x)
    arr, info, device = collectives._array(x, "allreduce of tensor 'x'", True)
    assert arr is x and info.name == "float32" and device == 0


def test_a_cuda_array_without_cupy_is_a_value_error_that_says_so(monkeypatch):
    monkeypatch.setitem(gpu._modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails
    with pytest.raises(ValueError, match="CUDA arrays need CuPy"):
        collectives._array(FakeDeviceArray.of([1.0]), "allreduce of tensor 'x'", True)


def test_bfloat16_goes_in_as_a_marked_16_bit_view(fake_cupy):
    if BF16 is None:
        pytest.skip("needs ml_dtypes")
    bits = FakeDeviceArray.of(np.array([1.0, 2.5], np.float32).astype(BF16).view(np.int16))
    arr, info, _ = collectives._array(gpu.bfloat16(bits), "x", True)
    assert info.dtype == BF16 and arr.dtype == np.int16
    with pytest.raises(ValueError, match="16-bit integer view"):
        collectives._array(gpu.bfloat16(FakeDeviceArray.of([1.0], np.float32)), "x", True)


def test_a_device_output_must_match_the_tensor(fake_cupy):
    x = FakeDeviceArray.of(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="must be a CUDA array"):
        collectives._output(np.zeros(4, np.float32), x, 0, "x")
    with pytest.raises(ValueError, match="shape"):
        collectives._output(FakeDeviceArray.of(np.zeros(5, np.float32)), x, 0, "x")
    out = FakeDeviceArray.of(np.zeros(4, np.float32))
    assert collectives._output(out, x, 0, "x") is out


@pytest.fixture
def made(fake_cupy, monkeypatch):
    """Every event the fake CuPy makes, in order."""
    events = []

    class Event(gpu_fakes._Event):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            events.append(self)

    monkeypatch.setattr(fake_cupy.cuda, "Event", Event)
    return events


def test_a_submission_makes_no_event_and_marks_the_callers_stream(made):
    """record_ready notes where the caller's stream was (one ready point per
    device, shared by a grouped submission); the event is recorded on that
    stream only when a backend asks for it, on whatever stream is current
    then, and only once."""
    caller, launcher = gpu_fakes._Stream(), gpu_fakes._Stream()
    entries = [Entry(f"t{i}", pb.ALLREDUCE, device=0) for i in range(3)]
    entries.append(Entry("cpu", pb.ALLREDUCE, device=-1))
    with caller:
        gpu.record_ready(entries)
    assert made == []
    assert len({id(e.ready_point) for e in entries[:3]}) == 1
    assert entries[3].ready_point is None
    with launcher:
        events = gpu.ready_events(entries + [None])
    assert events == made and len(events) == 1 and events[0].stream is caller
    assert gpu.ready_events(entries) == events and len(made) == 1


def test_a_frontend_names_the_callers_stream(fake_cupy):
    """caller_stream stands for CuPy's current stream on its device, for
    submissions and for synchronize, without entering it; nested, it
    restores the outer one."""
    named, inner = gpu_fakes._Stream(), gpu_fakes._Stream()
    e = Entry("t", pb.ALLREDUCE, device=0)
    with gpu.caller_stream(0, named):
        assert gpu.current_stream(0) is named
        assert gpu_fakes._Stream.current_stream() is not named  # not entered
        assert gpu.current_stream(1) is not named  # another device: CuPy's current one
        with gpu.caller_stream(0, inner):
            assert gpu.current_stream(0) is inner
        assert gpu.current_stream(0) is named
        gpu.record_ready([e])
    assert gpu.current_stream(0) is not named
    (event,) = gpu.ready_events([e])
    assert event.stream is named

    pending = gpu_fakes._Event()
    pending.done_at = float("inf")  # not fired
    with gpu.caller_stream(0, named):
        gpu.DeviceWait(0, [pending]).order_current_stream()
    assert named.waited == [pending]


def test_a_callers_stream_waits_on_the_results_device_whatever_device_is_current(made):
    """A stream handle of 0 means the current device's default stream: the
    wait is made with the results' device current, not the caller's (a
    model moved with .to("cuda:1") and no set_device)."""
    stream = gpu_fakes._Stream()
    pending = gpu_fakes._Event()
    pending.done_at = float("inf")
    with gpu.caller_stream(1, stream):
        with gpu_fakes._DeviceContext(0):
            gpu.DeviceWait(1, [pending]).order_current_stream()
    assert stream.waited == [pending] and stream.waited_on == [1]


def test_before_a_callers_stream_waits_every_pending_ready_point_is_recorded(made):
    """A synchronize that makes the caller's stream wait for an operation
    (asynchronous completion) first records the events of every ready point
    still pending, on their own streams: none of them may come to cover the
    wait (with two lanes synchronized in opposite orders on two ranks, that
    would make each rank's collective wait for the other's)."""
    caller, side = gpu_fakes._Stream(), gpu_fakes._Stream()
    pending = [Entry("a", pb.ALLREDUCE, device=0), Entry("b", pb.ALLREDUCE, device=0)]
    with gpu.caller_stream(0, caller):
        gpu.record_ready(pending[:1])
    with gpu.caller_stream(0, side):
        gpu.record_ready(pending[1:])
    assert made == []
    running = gpu_fakes._Event()
    running.done_at = float("inf")  # an operation in flight, its handles completed early
    with gpu.caller_stream(0, caller):
        gpu.DeviceWait(0, [running]).order_current_stream()
    assert len(made) == 2 and {e.stream for e in made} == {caller, side}
    assert caller.waited == [running]
    # At launch the backend gets the events recorded before the wait.
    assert set(gpu.ready_events(pending)) == set(made) and len(made) == 2


def test_a_submission_that_finds_its_lane_idle_records_its_event_at_once(made):
    """Its collective launches after one negotiation cycle: recorded at
    launch, the event would also cover what the caller queued meanwhile
    (the rest of a backward pass). A submission whose lane is busy makes no
    CUDA call; the lane is (process set, device)."""
    caller = gpu_fakes._Stream()
    asked = []

    def idle(process_set_id, device):
        asked.append((process_set_id, device))
        return process_set_id == 0

    first = [Entry("a", pb.ALLREDUCE, device=0), Entry("b", pb.ALLREDUCE, device=0)]
    with gpu.caller_stream(0, caller):
        gpu.record_ready(first, idle=idle)
    assert len(made) == 1 and made[0].stream is caller  # one per device, for both
    assert gpu.ready_events(first) == made
    busy = Entry("c", pb.ALLREDUCE, device=0, process_set_id=1)
    with gpu.caller_stream(0, caller):
        gpu.record_ready([busy], idle=idle)
    assert len(made) == 1  # its lane is busy: at launch
    assert asked == [(0, 0), (1, 0)]


def test_the_per_thread_default_stream_is_recorded_at_submission(made):
    """cudaStreamPerThread names another stream on the background thread: an
    event for it is recorded by the submitting thread."""
    per_thread = gpu_fakes._Stream()
    per_thread.ptr = 2  # cudaStreamPerThread
    e = Entry("t", pb.ALLREDUCE, device=0)
    with gpu.caller_stream(0, per_thread):
        gpu.record_ready([e])
    assert len(made) == 1 and made[0].stream is per_thread
    with gpu_fakes._Stream():
        assert gpu.ready_events([e]) == made


# ------------------------------------------------------------ the decision
def test_device_plan_prefers_nccl_and_never_hands_mpi_device_memory():
    from coordinator.ops import device_plan

    assert device_plan(False, True, True)[0] == []
    names, why = device_plan(True, True, False)
    assert names == ["nccl", "mpi-staged"] and "not CUDA-aware" in why
    names, why = device_plan(True, False, False)
    assert names == ["mpi-staged"] and "NCCL is unavailable" in why
    names, why = device_plan(True, False, True)
    assert names == ["mpi-staged"] and "only host memory" in why


def _backends(monkeypatch, cp):
    from coordinator.config import Config
    from coordinator.fusion import FusionBuffers
    from coordinator.ops import create_backends
    from coordinator.timeline import Timeline
    from coordinator.topology import Topology

    monkeypatch.setitem(gpu._modules, "cupy", cp)
    if cp is None:
        monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: None)
    manager = create_backends(Config(), gpu_fakes.SoloComm(), lambda pid: [0], FusionBuffers(),
                              Timeline(), 0, Topology(0, ["host"]))
    return [b.name for b in manager.backends]


def test_without_cupy_no_device_backend_is_built(monkeypatch):
    assert _backends(monkeypatch, None) == ["adasum", "mpi"]


def test_without_nccl_device_tensors_are_staged_and_that_is_logged(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="coordinator"):
        assert _backends(monkeypatch, gpu_fakes.fake_cupy()) == ["mpi-staged", "adasum", "mpi"]
    assert "staged through pinned host memory" in caplog.text
    assert "NCCL is unavailable" in caplog.text


def test_with_nccl_it_is_asked_first(monkeypatch):
    cp = gpu_fakes.fake_cupy(nccl=gpu_fakes.FakeNccl(gpu_fakes.SoloComm()))
    assert _backends(monkeypatch, cp) == ["nccl", "mpi-staged", "adasum", "mpi"]


def test_mpi_without_the_cuda_query_is_not_cuda_aware(tmp_path):
    from coordinator.ops.mpi_ops import mpi_cuda_aware

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n")
    assert mpi_cuda_aware(str(maps)) is False  # no libmpi loaded
    libc = next((p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/libc.so.6")
                 if os.path.exists(p)), None)
    if libc is not None:  # a library without MPIX_Query_cuda_support
        target = tmp_path / "libmpi.so.40"
        target.symlink_to(libc)
        maps.write_text(f"7f00-7f01 r-xp 00000000 00:00 0 {target}\n")
        assert mpi_cuda_aware(str(maps)) is False


# ------------------------------------------------------ staging, one rank
def _response(op, wire, **fields):
    fields = {"prescale": 1.0, "postscale": 1.0, **fields}
    return pb.Response(op=op, process_set_id=0, dtype=wire, device=0, **fields)


def _entry(op, values, **fields):
    x = FakeDeviceArray.of(values)
    info = dtypes.info_for(x.dtype)
    e = Entry("t", op, tensor=x, dtype_info=info, shape=x.shape, device=0, **fields)
    e.ready_point = gpu.ReadyPoint(0, gpu_fakes._Stream.current_stream())
    return e


def _staged(cp):
    from coordinator.fusion import FusionBuffers
    from coordinator.ops import OperationManager
    from coordinator.ops.adasum import AdasumOps
    from coordinator.ops.mpi_ops import Communicators, MPIOps
    from coordinator.ops.staging import HostStaging, StagedDeviceOps
    from coordinator.timeline import Timeline

    comm = gpu_fakes.SoloComm()
    comms = Communicators(comm, lambda pid: [0])
    host = OperationManager([AdasumOps(comms, Timeline()),
                             MPIOps(comms, FusionBuffers(), Timeline(), 0)])
    return StagedDeviceOps(host, HostStaging()), comm


def test_staging_hands_mpi_host_copies_and_returns_device_arrays(fake_cupy):
    ops, comm = _staged(fake_cupy)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    cases = [
        (ops.allreduce, _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.AVERAGE), {}),
        (ops.allreduce, _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.ADASUM), {}),
        (ops.allgather, _response(pb.ALLGATHER, pb.FLOAT32, sizes=[3]), {}),
        (ops.broadcast, _response(pb.BROADCAST, pb.FLOAT32), {"root": 0}),
        (ops.reducescatter, _response(pb.REDUCESCATTER, pb.FLOAT32, reduce_op=pb.SUM), {}),
    ]
    for run, response, kwargs in cases:
        (out,) = drive(run(response, [_entry(response.op, x)], ["t"], **kwargs))
        assert isinstance(out, FakeDeviceArray), run.__name__
        np.testing.assert_array_equal(out.get(), x, err_msg=run.__name__)
    response = _response(pb.ALLTOALL, pb.FLOAT32, sizes=[3])
    ((out, received),) = drive(ops.alltoall(response, [_entry(pb.ALLTOALL, x)], ["t"]))
    np.testing.assert_array_equal(out.get(), x)
    assert list(received) == [3]
    assert comm.calls >= 5  # every op but Adasum (alone at one rank) reached "MPI"


def test_staging_writes_into_the_given_device_output(fake_cupy):
    ops, _ = _staged(fake_cupy)
    e = _entry(pb.ALLREDUCE, np.ones(5, np.int32))
    e.output = e.tensor  # in place, as torch's allreduce_
    (out,) = drive(ops.allreduce(_response(pb.ALLREDUCE, pb.INT32, reduce_op=pb.SUM),
                                 [e], ["t"]))
    assert out is e.tensor and e.done_event is not None


def test_staging_allocates_its_pinned_buffer_with_the_tensors_device_current(fake_cupy,
                                                                            monkeypatch):
    """cudaHostAlloc from the background thread, whose current device is 0,
    would open a context on GPU 0 for every rank of a machine: the pinned
    buffer is allocated with the tensors' device current."""
    ops, _ = _staged(fake_cupy)
    current = []
    monkeypatch.setattr(fake_cupy.cuda, "alloc_pinned_memory",
                        lambda n: current.append(gpu_fakes._DeviceContext.current_id())
                        or bytearray(n))
    x = FakeDeviceArray.of(np.ones(4, np.float32))
    e = Entry("t", pb.ALLREDUCE, tensor=x, dtype_info=dtypes.info_for(x.dtype),
              shape=x.shape, device=1)
    e.ready_point = gpu.ReadyPoint(1, gpu_fakes._Stream.current_stream())
    (out,) = drive(ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM),
                                 [e], ["t"]))
    np.testing.assert_array_equal(out.get(), np.ones(4))
    assert current == [1], current


# ------------------------------------------------------ NCCL, one rank
class _SoloComms:
    """The device lanes' Communicators at one rank."""

    def __init__(self):
        self.comm = gpu_fakes.SoloComm()

    def __getitem__(self, pid):
        return self.comm

    def when_ready(self, pid):
        return self.comm
        yield  # a generator, like Communicators.when_ready

    @staticmethod
    def share_on(comm, payload, nbytes):
        from coordinator.ops.mpi_ops import Requests

        return bytearray(payload), Requests([gpu_fakes._Done()])


def _nccl_ops(host_kernels, monkeypatch, **timing):
    from coordinator.ops.nccl_ops import NCCLOps
    from coordinator.timeline import Timeline

    nccl = gpu_fakes.FakeNccl(gpu_fakes.SoloComm(), **timing)
    monkeypatch.setitem(gpu._modules, "cupy", gpu_fakes.fake_cupy(nccl, host_kernels))
    return NCCLOps(_SoloComms(), Timeline(), nccl), nccl


def _until_waiting(gen):
    """Runs a backend generator up to its first wait that is not ready yet
    (a communicator made in a helper thread aside), and returns that; None
    if it finished without one."""
    try:
        waiting = next(gen)
        while True:
            while isinstance(waiting, Making) and not waiting.ready():
                time.sleep(1e-3)
            if not waiting.ready():
                return waiting
            waiting = gen.send(None)
    except StopIteration:
        return None


@pytest.mark.parametrize("op", ["allreduce", "allgather", "in place"])
def test_a_result_from_the_pool_is_written_only_after_what_its_caller_queued_since(
        host_kernels, monkeypatch, op):
    """A ready event recorded before launch (the lane was idle at submission)
    does not cover the kernels the caller queued afterwards, which may still
    read an earlier result whose memory went back to CuPy's pool and is
    handed out again for this operation's result: the lane's stream then
    also waits for an event recorded at launch on the caller's stream
    (gpu.fence_events), so the operation ends no sooner than those kernels.
    Not for an output the caller gave (in place): nothing is taken from the
    pool, and the collective starts as soon as its inputs are ready."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    caller = gpu_fakes._Stream(non_blocking=True)
    kind = pb.ALLGATHER if op == "allgather" else pb.ALLREDUCE
    e = _entry(kind, np.arange(4, dtype=np.float32))
    if op == "in place":
        e.output = e.tensor
    e.ready_point = gpu.ReadyPoint(0, caller)
    e.ready_point.event()  # at submission
    caller.spend(60.0)  # then: kernels that read an earlier result, still running
    fields = {"sizes": [4]} if kind == pb.ALLGATHER else {"reduce_op": pb.SUM}
    response = _response(kind, pb.FLOAT32, **fields)
    run = getattr(ops, "allgather" if kind == pb.ALLGATHER else "allreduce")
    done = _until_waiting(run(response, [e], ["t"]))
    if op == "in place":
        assert done is None  # done at once: its input was ready
    else:
        assert done.events[-1].done_at >= caller.busy_until


def test_staging_writes_a_result_from_the_pool_after_what_its_caller_queued_since(
        fake_cupy):
    """The same fence for the staging backend's device results (copied from
    the host into memory from CuPy's pool)."""
    ops, _ = _staged(fake_cupy)
    caller = gpu_fakes._Stream(non_blocking=True)
    e = _entry(pb.ALLGATHER, np.arange(4, dtype=np.float32))
    e.ready_point = gpu.ReadyPoint(0, caller)
    e.ready_point.event()  # at submission
    caller.spend(60.0)
    done = _until_waiting(ops.allgather(_response(pb.ALLGATHER, pb.FLOAT32, sizes=[4]), [e],
                                        ["t"]))
    assert done.events[-1].done_at >= caller.busy_until


def test_staging_fences_what_its_caller_queued_during_the_host_round_trip(fake_cupy):
    """The staging backend takes its results' memory from the pool only
    after the host round trip, long after the ready events were recorded
    (at launch, for the copy to the host): kernels the caller queued
    meanwhile may still read an earlier result whose memory the pool hands
    out again. The copy back waits for an event recorded then."""
    ops, _ = _staged(fake_cupy)
    caller = gpu_fakes._Stream(non_blocking=True)
    e = _entry(pb.ALLGATHER, np.arange(4, dtype=np.float32))
    e.ready_point = gpu.ReadyPoint(0, caller)
    run = ops.allgather(_response(pb.ALLGATHER, pb.FLOAT32, sizes=[4]), [e], ["t"])
    copied = next(run)  # the copy to the host, behind the event recorded at launch
    assert not e.ready_point.early
    caller.spend(60.0)  # then, during the round trip: reads of an earlier result
    done = _until_waiting(_resumed(run, copied))
    assert done is not None, "the copy back did not wait for the caller's kernels"
    assert done.events[-1].done_at >= caller.busy_until


def _resumed(gen, first):
    """`gen`, already advanced to `first`, as a generator from `first` on."""
    sent = yield first
    while True:
        try:
            sent = yield gen.send(sent)
        except StopIteration as stop:
            return stop.value


def test_no_fence_where_the_ready_event_was_recorded_at_launch(fake_cupy):
    stream = gpu_fakes._Stream(non_blocking=True)
    e = types.SimpleNamespace(ready_point=gpu.ReadyPoint(0, stream))
    assert len(gpu.ready_events([e])) == 1  # recorded at launch
    assert gpu.fence_events([e]) == []
    early = types.SimpleNamespace(ready_point=gpu.ReadyPoint(0, stream))
    early.ready_point.event()
    assert len(gpu.fence_events([early, early, e])) == 1  # once per stream


def test_no_fence_that_would_cover_a_wait_for_an_operation(fake_cupy):
    """Once a synchronize (asynchronous completion) made the stream wait for
    an operation after the ready point was recorded, a fence there would
    make this collective wait for that one: on two lanes, synchronized in
    opposite orders on two ranks, each would wait for the other's. So there
    is none."""
    stream = gpu_fakes._Stream(non_blocking=True)
    early = types.SimpleNamespace(ready_point=gpu.ReadyPoint(0, stream))
    early.ready_point.event()
    running = gpu_fakes._Event()
    running.done_at = float("inf")  # another operation, still running
    with stream:
        gpu.DeviceWait(0, [running]).order_current_stream()
    assert running in stream.waited
    assert gpu.fence_events([early]) == []
    later = types.SimpleNamespace(ready_point=gpu.ReadyPoint(0, stream))
    later.ready_point.event()  # after the wait: a fence covers nothing it should not
    assert len(gpu.fence_events([later])) == 1


def test_nccl_fused_allreduce_is_one_call_between_one_pack_and_one_unpack(host_kernels,
                                                                          monkeypatch):
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    shapes = [(3, 2), (0,), (5,), (1, 1, 4)]
    entries = [_entry(pb.ALLREDUCE, np.arange(np.prod(s), dtype=np.float32).reshape(s) + i)
               for i, s in enumerate(shapes)]
    response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM, prescale=2.0,
                         postscale=0.25)
    outs = drive(ops.allreduce(response, entries, ["t"] * len(entries)))
    assert [c[0] for c in nccl.calls] == ["allReduce"]
    for e, out in zip(entries, outs):
        np.testing.assert_allclose(out.get(), e.tensor.get() * 0.5)
        assert e.done_event is not None


@pytest.mark.parametrize("major,unsigned", [(13, False), (13, True), (14, False)])
def test_the_nccl_unique_id_reaches_cupy_in_the_form_its_version_takes(host_kernels,
                                                                        monkeypatch, major,
                                                                        unsigned):
    """CuPy 14 takes NCCL's unique id as bytes; CuPy 13 as a tuple of C chars,
    signed on x86 and unsigned on ARM (out of range: OverflowError). The id,
    which has bytes above 127, goes from get_unique_id over MPI as bytes and
    back into NcclCommunicator in the form this CuPy takes, as the fake
    checks it; the other signedness is refused."""
    from coordinator.ops import nccl_ops
    from coordinator.timeline import Timeline

    nccl = gpu_fakes.FakeNccl(gpu_fakes.SoloComm(), cupy_major=major, unsigned_char=unsigned)
    monkeypatch.setitem(gpu._modules, "cupy", gpu_fakes.fake_cupy(nccl, host_kernels))

    def allreduce():
        ops = nccl_ops.NCCLOps(_SoloComms(), Timeline(), nccl)
        e = _entry(pb.ALLREDUCE, np.arange(4, dtype=np.float32))
        return drive(ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM),
                                   [e], ["t"]))

    monkeypatch.setattr(nccl_ops, "UNSIGNED_CHAR", unsigned)
    (out,) = allreduce()
    np.testing.assert_array_equal(out.get(), np.arange(4, dtype=np.float32))
    assert nccl.calls == [("allReduce", 4)]
    if major < 14:
        monkeypatch.setattr(nccl_ops, "UNSIGNED_CHAR", not unsigned)
        with pytest.raises(OverflowError):
            allreduce()


def test_an_nccl_operation_waits_on_its_device_until_its_time_has_passed(host_kernels,
                                                                       monkeypatch):
    """With a timed fake NCCL the operation's completion event fires only
    once the call would have run; until then the operation waits for its
    device (which the executor tests once per pass, not in a loop)."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch, latency=30.0, bandwidth=1e9)
    entries = [_entry(pb.ALLREDUCE, np.full(4, 2.0, np.float32)) for _ in range(2)]
    gen = ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM), entries,
                        ["a", "b"])
    waiting = next(gen)
    while not isinstance(waiting, gpu.DeviceWait):  # the lane opens over "MPI" first
        assert waiting.ready()
        waiting = gen.send(None)
    assert not waiting.ready()  # 30 s of simulated NCCL
    stream = waiting.events[0].stream
    assert stream.busy_until > time.perf_counter() + 20
    stream.busy_until = 0.0  # as if the time had passed
    waiting.events[0].done_at = 0.0
    assert waiting.ready()
    outs = drive(gen)
    for out in outs:
        np.testing.assert_array_equal(out.get(), np.full(4, 2.0, np.float32))


def test_an_nccl_allreduce_teaches_its_lane_how_long_it_ran_on_the_device(host_kernels,
                                                                         monkeypatch):
    """Its DeviceWait carries an event recorded once its inputs are ready and
    its bytes: once done, the lane's CallTimes knows how long such a call
    runs, and the next one's end can be expected (Executor.busy_for)."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch, latency=30.0, bandwidth=1e9)
    waits = []
    for count in (4, 1000):
        entries = [_entry(pb.ALLREDUCE, np.ones(count, np.float32)) for _ in range(2)]
        gen = ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM), entries,
                            ["a", "b"])
        waiting = next(gen)
        while getattr(waiting, "timing", None) is None:  # the lane opens over "MPI" first
            assert waiting.ready()
            waiting = gen.send(None)
        start, nbytes, times = waiting.timing
        assert nbytes == 2 * count * 4 and start.done  # its inputs were ready
        assert not waiting.ready()  # 30 s of simulated NCCL
        end = waiting.events[-1]
        assert end.done_at - start.done_at >= 30.0
        start.done_at, end.done_at = 0.0, 0.5 + nbytes / 1e6  # as if it had run that long
        end.stream.busy_until = 0.0
        assert waiting.ready()
        drive(gen)
        waits.append(waiting)
    assert waits[0].timing[2] is waits[1].timing[2]  # one lane, one CallTimes
    assert times.predict(8000) == pytest.approx(0.5 + 8000 / 1e6)
    # Empty tensors: no NCCL call, nothing to learn from.
    empty = [_entry(pb.ALLREDUCE, np.ones(0, np.float32)) for _ in range(2)]
    drive(ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM), empty,
                        ["a", "b"]))
    assert all(e.done_event.timing is None for e in empty)
    assert times.predict(8000) == pytest.approx(0.5 + 8000 / 1e6)


def test_an_allreduce_is_timed_from_after_its_fence(host_kernels, monkeypatch):
    """The fence on the caller's stream (gpu.fence_events) is a wait for the
    caller's kernels, not the call's own time: the timed start event is
    recorded behind it, so a lane does not learn that its calls run as long
    as the caller's backward pass (Executor.busy_for)."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    caller = gpu_fakes._Stream(non_blocking=True)
    e = _entry(pb.ALLREDUCE, np.ones(4, np.float32))
    e.ready_point = gpu.ReadyPoint(0, caller)
    e.ready_point.event()  # early: the lane was idle at submission
    caller.spend(60.0)
    gen = ops.allreduce(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM), [e], ["t"])
    waiting = next(gen)
    while getattr(waiting, "timing", None) is None:  # the lane opens over "MPI" first
        assert waiting.ready()
        waiting = gen.send(None)
    start = waiting.timing[0]
    assert start.done_at >= caller.busy_until


def _blocking_destroy(comm, order):
    """Makes `comm.destroy()` wait for the returned event (as NCCL's waits for
    a stopped peer on the same machine); `order` lists what was destroyed."""
    release = threading.Event()

    def destroy():
        assert release.wait(30)
        order.append(comm)

    comm.destroy = destroy
    return release


def test_removing_a_set_does_not_wait_for_its_nccl_communicators_destroy(host_kernels,
                                                                         monkeypatch):
    """ncclCommDestroy waits for the communicator's queued work and, in
    recent NCCL releases, for its other ranks on this machine: a member
    stopped there would stop the background thread (every lane, the
    watchdog). The set's lanes are forgotten at once and destroyed in a
    helper thread, in the order the sets were removed."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    comms, releases, order = [], [], []
    for pid in (0, 1):
        response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
        response.process_set_id = pid
        drive(ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(4, np.float32))], ["t"]))
        comm = ops._lanes[(pid, 0)].comm
        comms.append(comm)
        releases.append(_blocking_destroy(comm, order))
    ops.remove_process_set(1)
    ops.remove_process_set(0)  # returns while set 1's destroy still waits
    assert not ops._lanes
    assert order == []
    for release in releases:
        release.set()
    assert ops._destroyer.wait(30)
    assert order == [comms[1], comms[0]]


def test_a_removed_sets_communicator_outlives_its_operations_in_flight(host_kernels,
                                                                        monkeypatch):
    """A set may be removed while an operation of it is in flight (its handle
    not waited for): the background thread still polls the communicator for
    errors until it ends, and a destroy beside that poll would free it under
    the call. The destroy waits for the operation."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch, latency=30.0, bandwidth=1e9)
    destroyed = []
    response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
    response.process_set_id = 1
    gen = ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(4, np.float32))], ["t"])
    waiting = next(gen)
    while getattr(waiting, "timing", None) is None:  # the lane opens over "MPI" first
        assert waiting.ready()
        waiting = gen.send(None)
    comm = ops._lanes[(1, 0)].comm
    comm.destroy = lambda: destroyed.append(comm)
    assert not waiting.ready()  # 30 s of simulated NCCL
    ops.remove_process_set(1)
    assert not ops._lanes
    assert ops._destroyer.wait(0.2) and destroyed == []  # not handed over yet
    end = waiting.events[-1]
    end.done_at, end.stream.busy_until = 0.0, 0.0
    assert waiting.ready()
    drive(_resumed(gen, waiting))
    assert ops._destroyer.wait(30) and destroyed == [comm]
    # Shut down before such an operation ends: the communicator is aborted,
    # and not destroyed as well when the operation is dropped.
    gen = ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(4, np.float32))], ["t"])
    waiting = next(gen)
    while getattr(waiting, "timing", None) is None:
        assert waiting.ready()
        waiting = gen.send(None)
    comm = ops._lanes[(1, 0)].comm
    comm.destroy = lambda: destroyed.append(comm)
    aborted = []
    comm.abort = lambda: aborted.append(comm)
    ops.remove_process_set(1)
    assert ops.abort_communicators(wait=5) and aborted == [comm]
    gen.close()
    assert ops._destroyer.wait(30) and len(destroyed) == 1  # the first lane's only


def test_shutdown_aborts_removed_communicators_not_destroyed_yet(host_kernels, monkeypatch):
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    comms, order = [], []
    for pid in (0, 1):
        response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
        response.process_set_id = pid
        drive(ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(4, np.float32))], ["t"]))
        comms.append(ops._lanes[(pid, 0)].comm)
    release = _blocking_destroy(comms[0], order)
    aborted = []
    comms[1].abort = lambda: aborted.append(comms[1])
    ops.remove_process_set(0)
    ops.remove_process_set(1)  # queued behind set 0's destroy, which waits
    assert not ops.abort_communicators(wait=0.2)  # set 0's destroy is still under way
    assert aborted == [comms[1]] and order == []
    release.set()
    assert ops._destroyer.wait(30) and order == [comms[0]]


def test_the_simulated_gpu_spends_stream_time_and_moves_nothing():
    import gpu_sim

    # A 30 s latency, as the timed fakes' above: with 1 s, a loaded machine
    # could let the call's time pass before the event is looked at.
    cp, nccl = gpu_sim.sim_cupy(2, 0, latency=30.0, bandwidth=1e6)
    stream = cp.cuda.Stream(non_blocking=True)
    data = gpu_sim.device_array((1000,))
    before = time.perf_counter()
    with stream:
        nccl.NcclCommunicator(2, bytes(128), 0).allReduce(
            data.data.ptr, data.data.ptr, 1000, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
        event = cp.cuda.Event()
        event.record(stream)
    assert stream.busy_until >= before + 30.0 + 4000 / 1e6  # latency + bytes / bandwidth
    assert not event.done
    other = cp.cuda.Stream(non_blocking=True)
    other.wait_event(event)  # a stream that waits starts after it
    assert other.busy_until == event.done_at
    assert nccl.calls == [("allReduce", 1000)]


def test_a_timed_nccl_call_spends_the_time_of_the_stream_it_was_given():
    """As NCCL's calls do: their stream argument, not the current stream."""
    cp = gpu_fakes.fake_cupy()
    lane, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    nccl = gpu_fakes.FakeNccl(gpu_fakes.SoloComm(), latency=30.0, bandwidth=1e9)
    with other:
        nccl.called("allReduce", 4, gpu_fakes.FakeNccl.NCCL_FLOAT32, lane.ptr)
    assert lane.busy_until > time.perf_counter() + 20
    assert other.busy_until < time.perf_counter()
    with pytest.raises(ValueError, match="no fake stream"):
        nccl.called("allReduce", 4, gpu_fakes.FakeNccl.NCCL_FLOAT32, 0xdead)


@pytest.mark.mpi
def test_bench_gpu_runs_on_the_simulated_gpu_and_breaks_b_down():
    """`python -m coordinator.bench --gpu` itself, on the simulated GPU: (A),
    (B) and where (B)'s time goes (submission, first handle, all done)."""
    from mpi_harness import mpirun

    proc = mpirun(["tests/scripts/gpu_bench_on_sim.py", "--repeats", "2"], np_=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    number = r"\s+[\d.]+\s+[\d.]+\s+ms\s+"
    assert re.search(r"\(A\) 64 MiB CUDA allreduce vs bare NCCL" + number + r"[\d.]+", out), out
    assert re.search(r"\(B\) ResNet-50 161 CUDA grads \(bare: fused\)" + number + r"[\d.]+",
                     out), out
    assert re.search(r"\(B\) ours: all 161 submitted" + number + r"-\s+[\d.]+ us a tensor",
                     out), out
    assert re.search(r"\(B\) ours: first handle done" + number
                     + r"-\s+[-+][\d.]+ ms past submitted \+ bare fused", out), out
    assert re.search(r"\(B\) ours: all 161 synchronized" + number, out), out


@pytest.mark.mpi
def test_the_simulated_bench_b_reports_ours_against_one_fused_call():
    from mpi_harness import mpirun

    proc = mpirun(["tests/scripts/gpu_sim_bench.py", "--repeats", "2"], np_=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\(B\) simulated, 2 ranks, 161 grads, 97 MiB: ours [\d.]+ ms, one fused "
                     r"bare call [\d.]+ ms, ratio [\d.]+; NCCL calls per run \[\d+, \d+\]", out), out
    assert re.search(r"all submitted [\d.]+, first NCCL call queued [\d.]+, last [\d.]+, "
                     r"device done [\d.]+, all synchronized [\d.]+", out), out


@pytest.mark.mpi
def test_the_simulated_training_step_compares_ours_with_ddp_and_local():
    from mpi_harness import mpirun

    proc = mpirun(["tests/scripts/gpu_sim_step.py", "--rounds", "1"], np_=1, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for name in ("ddp", "local", "ours", "ours-async"):
        assert re.search(rf"  {name}\s+median step\s+[\d.]+ ms, ratio to ddp [\d.]+", out), out


def test_nccl_runs_the_torus_only_where_the_mpi_torus_would(host_kernels, monkeypatch):
    import types

    ops, _ = _nccl_ops(host_kernels, monkeypatch)
    response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
    assert not ops._two_level(response)  # not asked for
    layout = dict(local_size=2, cross_size=2, homogeneous=True)
    ops.topology = types.SimpleNamespace(**layout)
    assert ops._two_level(response)
    # hosts of different sizes: a row's shares would not line up with the columns
    ops.topology = types.SimpleNamespace(**dict(layout, homogeneous=False))
    assert not ops._two_level(response)
    ops.topology = types.SimpleNamespace(**dict(layout, cross_size=1))  # one host
    assert not ops._two_level(response)
    ops.topology = types.SimpleNamespace(**layout)
    assert not ops._two_level(_response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.ADASUM))


def test_a_revoke_aborts_nccl_and_the_next_operation_joins_with_a_new_id(host_kernels,
                                                                        monkeypatch):
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
    drive(ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(3, np.float32))], ["t"]))
    ids = nccl._ids
    ops.revoke()  # a peer died (ULFM): elastic training re-forms the job next
    assert ("abort", 0) in nccl.calls
    (out,) = drive(ops.allreduce(response, [_entry(pb.ALLREDUCE, np.ones(3, np.float32))],
                                 ["t"]))
    np.testing.assert_array_equal(out.get(), np.ones(3))
    assert nccl._ids == ids + 1  # a new communicator, from a new unique id


def test_a_revoke_reaches_the_staging_backends_host_communicators():
    from coordinator.ops import OperationManager
    from coordinator.ops.staging import StagedDeviceOps

    class HostBackend:
        revoked = 0

        def revoke(self):
            self.revoked += 1

    host = HostBackend()
    OperationManager([StagedDeviceOps(OperationManager([host]), staging=None)]).revoke()
    assert host.revoked == 1


def test_nccl_allreduce_widens_int16_and_reduces_bfloat16_bits(host_kernels, monkeypatch):
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    e = _entry(pb.ALLREDUCE, np.array([-7, 0, 7, 32000], np.int16))
    (out,) = drive(ops.allreduce(_response(pb.ALLREDUCE, pb.INT16, reduce_op=pb.AVERAGE),
                                 [e], ["t"]))
    assert out.dtype == np.int16 and list(out.get()) == [-7, 0, 7, 32000]
    if BF16 is not None:
        values = np.array([1.5, -2.25, 3.0], np.float32).astype(BF16)
        e = _entry(pb.ALLREDUCE, values.view(np.int16))
        e.dtype_info = dtypes.BY_DTYPE[BF16]
        response = _response(pb.ALLREDUCE, pb.BFLOAT16, reduce_op=pb.SUM, postscale=2.0)
        (out,) = drive(ops.allreduce(response, [e], ["t"]))
        np.testing.assert_array_equal(out.get().view(BF16).astype(np.float32),
                                      values.astype(np.float32) * 2)


def _bfloat16_results(run_op, reductions=True):
    """{op: result dtype} of each op run by `run_op(op, response, entries)` on
    a native bfloat16 device array (CuPy 14 has the dtype)."""
    values = np.array([[1.5, -2.25], [3.0, 0.5]], np.float32).astype(BF16)
    cases = {
        "allreduce": (pb.ALLREDUCE, {"reduce_op": pb.SUM}),
        "allgather": (pb.ALLGATHER, {"sizes": [2]}),
        "broadcast": (pb.BROADCAST, {}),
        "alltoall": (pb.ALLTOALL, {"sizes": [2]}),
        "reducescatter": (pb.REDUCESCATTER, {"reduce_op": pb.SUM}),
    }
    dtypes_out = {}
    for name, (op, fields) in cases.items():
        if not reductions and fields.get("reduce_op") is not None:
            continue
        e = _entry(op, values)
        assert e.dtype_info.dtype == BF16
        (out,) = run_op(name, _response(op, pb.BFLOAT16, **fields), [e])
        if isinstance(out, tuple):
            out = out[0]
        np.testing.assert_array_equal(out.get().view(BF16), values)
        dtypes_out[name] = out.dtype
    return dtypes_out


def test_a_native_bfloat16_array_gets_bfloat16_results(host_kernels, monkeypatch):
    """CuPy 14 has a bfloat16 dtype: the results of such an array are
    bfloat16 arrays too, not the int16 the backends hold bfloat16 in (a
    frontend's bfloat16(<int16 view>) still gets int16 views back)."""
    if BF16 is None:
        pytest.skip("needs ml_dtypes")
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)

    def run_nccl(name, response, entries):
        kwargs = {"root": 0} if name == "broadcast" else {}
        return drive(getattr(ops, name)(response, entries, ["t"], **kwargs))

    assert set(_bfloat16_results(run_nccl).values()) == {np.dtype(BF16)}
    staged, _ = _staged(gpu_fakes.fake_cupy(None, host_kernels))

    def run_staged(name, response, entries):
        kwargs = {"root": 0} if name == "broadcast" else {}
        return drive(getattr(staged, name)(response, entries, ["t"], **kwargs))

    # (The host's bfloat16 reductions need MPI, which this process has not started.)
    assert set(_bfloat16_results(run_staged, reductions=False).values()) == {np.dtype(BF16)}
    bits = _entry(pb.ALLGATHER, np.array([1.5], np.float32).astype(BF16).view(np.int16))
    bits.dtype_info = dtypes.BY_DTYPE[BF16]
    (out,) = drive(ops.allgather(_response(pb.ALLGATHER, pb.BFLOAT16, sizes=[1]), [bits],
                                 ["t"]))
    assert out.dtype == np.int16


def test_nccl_reducescatter_allgather_broadcast_alltoall_at_one_rank(host_kernels, monkeypatch):
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    x = np.arange(10, dtype=np.float64).reshape(5, 2)
    response = _response(pb.REDUCESCATTER, pb.FLOAT64, reduce_op=pb.AVERAGE, prescale=3.0)
    (out,) = drive(ops.reducescatter(response, [_entry(pb.REDUCESCATTER, x)], ["t"]))
    np.testing.assert_allclose(out.get(), x * 3)
    (out,) = drive(ops.allgather(_response(pb.ALLGATHER, pb.FLOAT64, sizes=[5]),
                                 [_entry(pb.ALLGATHER, x)], ["t"]))
    np.testing.assert_array_equal(out.get(), x)
    (out,) = drive(ops.broadcast(_response(pb.BROADCAST, pb.FLOAT64),
                                 [_entry(pb.BROADCAST, x)], ["t"], root=0))
    np.testing.assert_array_equal(out.get(), x)
    ((out, received),) = drive(ops.alltoall(_response(pb.ALLTOALL, pb.FLOAT64, sizes=[5]),
                                            [_entry(pb.ALLTOALL, x)], ["t"]))
    np.testing.assert_array_equal(out.get(), x)


# ---------------------------------------------------------- fusion kernels
_KIND_DTYPES = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
                "int32": np.int32,
                "int64": np.int64, "float16": np.float16, "float32": np.float32,
                "float64": np.float64, "bfloat16": BF16}


def _values(dtype, n, rng):
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 20, size=n).astype(dtype)  # scaled by 3, fits int8
    return (rng.standard_normal(n) * 10).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("tensor_kind,buffer_kind", gpu_fakes.KERNEL_PAIRS)
def test_fusion_kernels_match_the_host_reference(tensor_kind, buffer_kind, host_kernels):
    from coordinator.ops.device_fusion import Kernels, Tables

    t_dtype, b_dtype = _KIND_DTYPES[tensor_kind], _KIND_DTYPES[buffer_kind]
    if t_dtype is None:
        pytest.skip("needs ml_dtypes")
    cp = gpu_fakes.fake_cupy(kernels=host_kernels)
    kernels, tables, stream = Kernels(cp), Tables(cp), cp.cuda.Stream()
    rng = np.random.default_rng(0)
    sources = [_values(t_dtype, n, rng) for n in (7, 0, 300, 1)]
    segments = [(s.ctypes.data, s.size) for s in sources]
    segments.insert(2, (0, 5))  # padding
    total = sum(n for _, n in segments)
    for scale, divisor in ((1.0, 1), (0.5, 1), (3.0, 2)):
        buf = FakeDeviceArray(np.full(total, 99, b_dtype))
        kernels.pack(tables, stream, segments, buf, tensor_kind, buffer_kind, scale)
        expected = np.zeros(total, b_dtype)
        pos = 0
        for ptr, n in segments:
            if ptr:
                src = next(s for s in sources if s.ctypes.data == ptr)
                fusion.copy_scaled(src, expected[pos:pos + n], scale)
            pos += n
        np.testing.assert_array_equal(buf.get().view(np.uint8), expected.view(np.uint8))
        outs = [np.zeros(s.size, t_dtype) for s in sources]
        out_segments = [(o.ctypes.data, o.size) for o in outs]
        out_segments.insert(2, (0, 5))
        kernels.unpack(tables, stream, buf, out_segments, buffer_kind, tensor_kind, scale,
                       divisor)
        pos = 0
        for (ptr, n) in out_segments:
            if ptr:
                out = next(o for o in outs if o.ctypes.data == ptr)
                want = np.zeros(n, t_dtype)
                fusion.copy_scaled(expected[pos:pos + n], want, scale, divisor)
                np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8),
                                              err_msg=f"{tensor_kind} scale {scale}/{divisor}")
            pos += n


def test_an_integer_average_on_the_device_is_the_exact_quotient(host_kernels):
    """The unpack kernel divides integers in integers: past 2**53 a double
    lost int64's low bits (3 * (10**17 + 1) / 3 gave 10**17)."""
    from coordinator.ops.device_fusion import Kernels, Tables

    cp = gpu_fakes.fake_cupy(kernels=host_kernels)
    kernels, tables, stream = Kernels(cp), Tables(cp), cp.cuda.Stream()
    sums = np.array([3 * (10**17 + 1), -3 * (10**17 + 1), -7, 7, -1, 2**63 - 1, -2**63],
                    np.int64)
    buf = FakeDeviceArray(sums.copy())
    out = np.zeros_like(sums)
    kernels.unpack(tables, stream, buf, [(out.ctypes.data, out.size)], "int64", "int64",
                   1.0, 3)
    want = np.array([int(v) // 3 if v >= 0 else -(-int(v) // 3) for v in sums], np.int64)
    np.testing.assert_array_equal(out, want)
    small = FakeDeviceArray(np.array([-7, 7, -128, 127], np.int8))
    out8 = np.zeros(4, np.int8)
    kernels.unpack(tables, stream, small, [(out8.ctypes.data, 4)], "int8", "int8", 1.0, 2)
    assert out8.tolist() == [-3, 3, -64, 63]


def test_device_phases_are_counted_back_from_when_the_host_saw_them_done(fake_cupy):
    from coordinator.ops.nccl_ops import _Phases

    phases = _Phases(fake_cupy, None, enabled=True)
    for label in ("MEMCPY_IN_FUSION_BUFFER", "NCCL_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"):
        phases.mark(label)
    for event, t in zip(phases.events, (0.0, 0.001, 0.003, 0.0035)):  # seconds
        event.done_at = t  # (on the device's clock)
    assert phases.spans(10000.0, 0.0) == [("MEMCPY_IN_FUSION_BUFFER", 6500.0, 7500.0),
                                          ("NCCL_ALLREDUCE", 7500.0, 9500.0),
                                          ("MEMCPY_OUT_FUSION_BUFFER", 9500.0, 10000.0)]
    # never before the host started waiting
    assert phases.spans(10000.0, 8000.0) == [("MEMCPY_IN_FUSION_BUFFER", 8000.0, 8000.0),
                                             ("NCCL_ALLREDUCE", 8000.0, 9500.0),
                                             ("MEMCPY_OUT_FUSION_BUFFER", 9500.0, 10000.0)]
    off = _Phases(fake_cupy, None, enabled=False)
    off.mark("NCCL_ALLREDUCE")
    assert off.events == [] and off.spans(1.0, 0.0) == []


# ------------------------------------------------- end to end, under mpirun
def _mpi_env(fake_nccl):
    return {"FAKE_NCCL": "1" if fake_nccl else "0",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30", "HOROVOD_LOG_LEVEL": "info"}


_RESULTS = {}  # (case file, settings) -> CaseResults: one mpirun job each


def _check(path, case, np_, env):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the kernels for the host")
    from mpi_harness import CaseResults

    key = (path, tuple(sorted(env.items())))
    results = _RESULTS.setdefault(key, CaseResults(path, env=env))
    results.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("fake_nccl", [False, True], ids=["staged", "nccl-over-mpi"])
@pytest.mark.parametrize("case", ["every_op_on_device_arrays", "no_device_memory_reached_mpi",
                                  "timeline_shows_the_device_copies"])
def test_device_arrays_end_to_end_at_np2(case, fake_nccl):
    _check("tests/test_gpu_fallback.py", case, 2, _mpi_env(fake_nccl))


@pytest.mark.mpi
def test_nccl_byte_calls_in_pieces_at_np2():
    _check("tests/test_gpu_fallback.py", "byte_calls_split_in_pieces_give_the_same_results", 2,
           _mpi_env(True))


@pytest.mark.mpi
@pytest.mark.parametrize("fake_nccl", [False, True], ids=["staged", "nccl-over-mpi"])
def test_a_fused_broadcast_of_two_dtypes_gives_each_tensor_its_own(fake_nccl):
    """Broadcasts fuse whatever their dtypes (the response's is its first
    tensor's): the NCCL backend gave every output that dtype, so the second
    tensor came back as float16 with a quarter of its bytes. A 20 ms cycle
    makes the two ready together."""
    env = dict(_mpi_env(fake_nccl), HOROVOD_CYCLE_TIME="20",
               CASES="a_fused_broadcast_keeps_each_tensors_dtype")
    _check("tests/test_gpu_fallback.py", "a_fused_broadcast_keeps_each_tensors_dtype", 2, env)


@pytest.mark.mpi
@pytest.mark.parametrize("fake_nccl", [False, True], ids=["staged", "nccl-over-mpi"])
def test_another_sets_gpu_operations_run_while_a_rank_outside_it_is_idle(fake_nccl):
    case = "another_sets_gpu_operations_run_while_a_rank_outside_it_is_idle"
    env = dict(_mpi_env(fake_nccl), CASES=case, HOROVOD_DYNAMIC_PROCESS_SETS="1",
               HOROVOD_STALL_CHECK_DISABLE="1")
    _check("tests/test_gpu_fallback.py", case, 3, env)


@pytest.mark.mpi
@pytest.mark.parametrize("fake_nccl", [False, True], ids=["staged", "nccl-over-mpi"])
@pytest.mark.parametrize("case", ["gpu_communicators_average_device_gradients_in_place",
                                  "pure_nccl_reduces_gradients_in_allreduce_grad_dtype",
                                  "array_collectives_keep_device_arrays_on_the_device",
                                  "dummy_checks_gradients_and_leaves_them",
                                  "double_buffering_updates_with_the_previous_steps_device_mean",
                                  "extensions_take_device_arrays"])
def test_chainermn_gpu_communicators_on_device_arrays_at_np2(case, fake_nccl):
    _check("tests/mpi/chainer_gpu_cases.py", case, 2, _mpi_env(fake_nccl))


@pytest.mark.mpi
@pytest.mark.parametrize("setting", ["HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_TORUS_ALLREDUCE"])
@pytest.mark.parametrize("case", ["the_layout_is_two_hosts_of_two",
                                  "allreduce_runs_in_the_host_then_across_hosts",
                                  "fused_tensors_share_one_pass",
                                  "other_process_sets_and_host_tensors_do_not_use_it",
                                  "the_timeline_shows_each_level"])
def test_nccl_host_aware_allreduce_on_two_simulated_hosts_at_np4(case, setting):
    env = dict(_mpi_env(True), COORDINATOR_SIMULATED_LOCAL_SIZE="2")
    env[setting] = "1"
    _check("tests/mpi/nccl_host_aware_cases.py", case, 4, env)


@pytest.mark.mpi
@pytest.mark.parametrize("case,setting,job", [
    ("with_it_a_handle_completes_once_queued_and_the_stream_waits", "1", "early"),
    ("a_grouped_allreduce_and_a_broadcast_complete_early_too", "1", "early"),
    ("without_it_a_handle_waits_for_the_device", "0", "late"),
    ("in_stream_order_a_handle_completes_once_queued_the_others_later", "0", "late"),
    ("the_switch_interval_is_short_only_while_gpu_work_is_in_flight", "0", "late"),
    ("waiting_for_a_held_tensor_queues_it_behind_the_running_call", "0", "hold"),
    ("a_held_tensor_goes_shortly_before_the_running_call_should_end", "0", "hold"),
    ("a_failure_after_early_completion_stops_the_job_naming_the_setting", "1", "failing"),
    ("a_failure_after_early_completion_stops_the_job_naming_the_setting", "0", "failing"),
    ("after_a_failure_shutdown_aborts_the_nccl_communicators", "1", "failing"),
    ("after_a_failure_shutdown_aborts_the_nccl_communicators", "0", "failing"),
])
def test_async_completion_on_device_arrays_at_np2(case, setting, job):
    """HOROVOD_ENABLE_ASYNC_COMPLETION: a GPU operation's handles complete
    once it is queued, and synchronize orders the caller's stream after it;
    without it, only those of tensors submitted in stream order do
    (collectives.in_stream_order), and a failure after that stops the job
    either way (and shutdown() then aborts the NCCL communicators). Without
    it, a tensor held back for the busy lane is queued behind the running
    call once a thread waits for it, or once that call should end within
    DEVICE_HOLD_LEAD ("hold"). And the interpreter's switch interval is
    short only while GPU work is in flight."""
    cases = {"early": "with_it_a_handle_completes_once_queued_and_the_stream_waits,"
                      "a_grouped_allreduce_and_a_broadcast_complete_early_too",
             "late": "without_it_a_handle_waits_for_the_device,"
                     "in_stream_order_a_handle_completes_once_queued_the_others_later,"
                     "the_switch_interval_is_short_only_while_gpu_work_is_in_flight",
             "hold": "a_held_tensor_goes_shortly_before_the_running_call_should_end,"
                     "waiting_for_a_held_tensor_queues_it_behind_the_running_call",
             "failing": "a_failure_after_early_completion_stops_the_job_naming_the_setting,"
                        "after_a_failure_shutdown_aborts_the_nccl_communicators"}
    env = {"HOROVOD_ENABLE_ASYNC_COMPLETION": setting, "CASES": cases[job],
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}
    if job == "hold":
        # Nothing but what a case looks at may end a hold: stall checks'
        # messages about the hour-long call would, and so would the
        # watchdog's pings (a rank asked posts a cycle at once), which the
        # silence and deadlock limits keep on; within a second or so, which
        # a loaded machine could let pass before a case looks.
        env.update(HOROVOD_STALL_CHECK_DISABLE="1", COORDINATOR_SILENT_RANK_SECONDS="0",
                   COORDINATOR_DEADLOCK_SECONDS="0")
    _check("tests/mpi/async_completion_cases.py", case, 2, env)


_CHECKED = []  # the data communicators, checked (filled under mpirun)


def setup(hvd):
    """Under mpirun: CuPy is the fake (with NCCL run over MPI when FAKE_NCCL=1),
    and every data communicator checks what it is handed."""
    from mpi4py import MPI

    from coordinator.ops import mpi_ops

    scratch = tempfile.mkdtemp(prefix=f"host-kernels-{MPI.COMM_WORLD.rank}-")
    nccl = None
    if os.environ.get("FAKE_NCCL") == "1":
        nccl = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup())
    gpu._modules["cupy"] = gpu_fakes.fake_cupy(nccl, gpu_fakes.HostKernels(scratch))
    group = mpi_ops.Communicators.group

    def checked_group(self, ranks, tag=0):
        comm = gpu_fakes.CheckedComm(group(self, ranks, tag))
        _CHECKED.append(comm)
        return comm
    mpi_ops.Communicators.group = checked_group
    hvd.init()


def _backend(hvd):
    from coordinator import runtime

    return runtime.current().ops.backends[0].name


def case_every_op_on_device_arrays(hvd):
    n, me = hvd.size(), hvd.rank()
    expect = "nccl" if os.environ.get("FAKE_NCCL") == "1" else "mpi-staged"
    assert _backend(hvd) == expect, _backend(hvd)
    dtypes_ = [np.int16, np.uint16, np.int32, np.float32, np.float64]
    for dtype in dtypes_:
        x = [np.arange(6, dtype=dtype).reshape(2, 3) + r for r in range(n)]
        out = hvd.allreduce(FakeDeviceArray.of(x[me]), op=hvd.Sum, name=f"ar.{dtype.__name__}")
        assert isinstance(out, FakeDeviceArray)
        np.testing.assert_array_equal(out.get(), sum(x))
        avg = hvd.allreduce(FakeDeviceArray.of(x[me]), name=f"avg.{dtype.__name__}",
                            prescale_factor=2.0)
        want = sum(xi.astype(np.float64) * 2 for xi in x) / n
        np.testing.assert_allclose(avg.get().astype(np.float64),
                                   np.trunc(want) if np.dtype(dtype).kind == "i" else want)
    grouped = hvd.grouped_allreduce([FakeDeviceArray.of(np.full(k + 1, me + k, np.float32))
                                     for k in range(4)], op=hvd.Max, name="grouped")
    for k, out in enumerate(grouped):
        np.testing.assert_array_equal(out.get(), np.full(k + 1, n - 1 + k, np.float32))
    rows = [r + 1 for r in range(n)]  # a ragged first dimension
    mine = np.full((rows[me], 2), me, np.float32)
    gathered = hvd.allgather(FakeDeviceArray.of(mine), name="ag")
    np.testing.assert_array_equal(gathered.get(), np.concatenate(
        [np.full((rows[r], 2), r, np.float32) for r in range(n)]))
    b = hvd.broadcast(FakeDeviceArray.of(np.full(3, me, np.int64)), root_rank=n - 1, name="bc")
    np.testing.assert_array_equal(b.get(), np.full(3, n - 1))
    splits = [r + 1 for r in range(n)]
    src = np.repeat(np.arange(n, dtype=np.int32) + 10 * me, splits)
    out, received = hvd.alltoall(FakeDeviceArray.of(src), splits=splits, name="a2a")
    np.testing.assert_array_equal(out.get(), np.array(
        [10 * r + me for r in range(n) for _ in range(me + 1)], np.int32))
    total = 2 * n + 1  # uneven shares: the first rank gets one row more
    data = [np.arange(total * 2, dtype=np.float32).reshape(total, 2) * (r + 1) for r in range(n)]
    share = hvd.reducescatter(FakeDeviceArray.of(data[me]), op=hvd.Sum, name="rs")
    start = sum(collectives_rows(total, n)[:me])
    np.testing.assert_array_equal(share.get(), sum(data)[start:start + collectives_rows(
        total, n)[me]])
    if n > 1 and me < 2:
        if me == 0:
            hvd.send(FakeDeviceArray.of(np.arange(4, dtype=np.float16)), 1, name="p2p")
        else:
            got = hvd.recv(0, name="p2p")
            np.testing.assert_array_equal(got.get(), np.arange(4, dtype=np.float16))


def case_byte_calls_split_in_pieces_give_the_same_results(hvd):
    """NCCL calls that move bytes (broadcast, allgather's broadcasts,
    alltoall's and send/recv's) go in pieces of at most PIECE_BYTES (some
    CuPy releases take broadcast's count as a C int): with pieces of 12
    bytes, which cut through elements, every op still gives its results."""
    from coordinator import gpu
    from coordinator.ops import nccl_ops

    nccl_ops.PIECE_BYTES = 12
    nccl = gpu._modules["cupy"].cuda.nccl
    before = len(nccl.calls)
    case_every_op_on_device_arrays(hvd)
    moved = [(name, count) for name, count in nccl.calls[before:]
             if name in ("broadcast", "send", "recv")]
    assert moved and max(count for _, count in moved) <= 12, moved
    assert any(count < 12 for _, count in moved), moved


def case_a_fused_broadcast_keeps_each_tensors_dtype(hvd):
    me = hvd.rank()
    for trial in range(4):
        small = FakeDeviceArray.of(np.full((1, 4), me + 1.5, np.float16))
        large = FakeDeviceArray.of(np.arange(80, dtype=np.float64).reshape(5, 4, 4) + me)
        handles = [hvd.broadcast_async(small, 0, name=f"fb.small.{trial}"),
                   hvd.broadcast_async(large, 0, name=f"fb.large.{trial}")]
        got = [hvd.synchronize(h).get() for h in handles]
        assert got[0].dtype == np.float16 and got[0].shape == (1, 4), got[0]
        np.testing.assert_array_equal(got[0], np.full((1, 4), 1.5, np.float16))
        assert got[1].dtype == np.float64 and got[1].shape == (5, 4, 4), got[1]
        np.testing.assert_array_equal(got[1], np.arange(80.0).reshape(5, 4, 4))


def case_another_sets_gpu_operations_run_while_a_rank_outside_it_is_idle(hvd):
    """Another set's GPU plans go out in a round of every rank, so that
    every rank queues its NCCL calls in one order (negotiation.py): rank 2,
    outside the set and idle (waiting on plain MPI, not the coordinator,
    with the watchdog's pings off), is asked to post the cycle that leads
    to that round. Without it, ranks 0 and 1 waited for ever."""
    from mpi4py import MPI

    me = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    if me < 2:
        for step in range(3):
            x = FakeDeviceArray.of(np.full(4, me + step, np.float32))
            out = hvd.allreduce(x, op=hvd.Sum, name=f"pair.{step}", process_set=pair)
            np.testing.assert_array_equal(out.get(), np.full(4, 1 + 2 * step, np.float32))
            if me == 0:
                hvd.send(FakeDeviceArray.of(np.arange(3, dtype=np.int32) + step), 1,
                         name=f"pair.p2p.{step}")
            else:
                got = hvd.recv(0, name=f"pair.p2p.{step}")
                np.testing.assert_array_equal(got.get(), np.arange(3, dtype=np.int32) + step)
    if me == 0:
        for rank in range(2, hvd.size()):
            MPI.COMM_WORLD.send("done", dest=rank, tag=77)
    elif me >= 2:
        assert MPI.COMM_WORLD.recv(source=0, tag=77) == "done"
    hvd.remove_process_set(pair)


def collectives_rows(total, n):
    from coordinator.ops.mpi_ops import reducescatter_rows

    return reducescatter_rows(total, n)


def case_no_device_memory_reached_mpi(hvd):
    # The checks ran inside every call of the previous case; here the
    # device lanes' communicators must have been used and have seen no
    # device memory (a violation fails the call it happened in).
    assert _CHECKED, "no data communicator was created"
    if os.environ.get("FAKE_NCCL") != "1":
        assert sum(c.calls for c in _CHECKED) > 0, "the staging backend made no MPI call"


def _trace(path):
    import json

    with open(path) as f:
        return json.load(f)


def _intervals(events, pid, label):
    """(start, end) of each `label` activity (a B/E pair) of the tensor on
    track `pid`."""
    out, stack = [], []
    for e in sorted((e for e in events if e.get("pid") == pid and e["ph"] in "BE"),
                    key=lambda e: (e["ts"], e["ph"] != "E")):
        if e["ph"] == "B":
            stack.append(e)
        else:
            began = stack.pop()
            if began["name"] == label:
                out.append((began["ts"], e["ts"]))
    return out


def tensor_track(events, name):
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name" and \
                e["args"]["name"].endswith(name):
            return e["pid"]
    raise AssertionError(f"no timeline row for {name}")


def case_timeline_shows_the_device_copies(hvd):
    me = hvd.rank()
    path = os.path.join(tempfile.gettempdir(), f"device_timeline_{os.getppid()}.json")
    hvd.start_timeline(path)
    parts = [FakeDeviceArray.of(np.full(1000 * (k + 1), me + k, np.float32)) for k in range(3)]
    hvd.grouped_allreduce(parts, op=hvd.Sum, name="traced")
    hvd.stop_timeline()
    if me != 0:  # rank 0 writes the timeline
        return
    events = _trace(path)
    os.remove(path)
    track = tensor_track(events, "traced_1of3")
    if os.environ.get("FAKE_NCCL") == "1":
        (outer,) = _intervals(events, track, "NCCL_ALLREDUCE")[:1]
        phases = ["MEMCPY_IN_FUSION_BUFFER", "NCCL_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
        spans = [e for e in events if e.get("pid") == track and e["ph"] == "X"]
        assert [e["name"] for e in spans] == phases, spans
        for before, after in zip(spans, spans[1:]):  # one after another
            assert before["ts"] + before["dur"] <= after["ts"] + 0.01
        # inside the activity the host saw (the fake's "device" works at
        # enqueue time, before the host waits, so its phases are squeezed
        # into that window; on a GPU they run inside it)
        assert outer[0] - 0.01 <= spans[0]["ts"] and \
            spans[-1]["ts"] + spans[-1]["dur"] <= outer[1] + 0.01, (outer, spans)
    else:
        copies_in = _intervals(events, track, "MEMCPY_IN_HOST_BUFFER")
        copies_out = _intervals(events, track, "MEMCPY_OUT_HOST_BUFFER")
        assert len(copies_in) == 1 and len(copies_out) == 1, (copies_in, copies_out)
        assert copies_in[0][1] <= copies_out[0][0]


@pytest.mark.mpi
@pytest.mark.parametrize("fake_nccl", [False, True], ids=["staged", "nccl-over-mpi"])
@pytest.mark.parametrize("case", ["the_core_runs_them_on_its_device_backend",
                                  "allreduce_takes_and_returns_device_memory_in_every_dtype",
                                  "grouped_allreduce_synchronises_the_devices_once",
                                  "broadcast_allgather_alltoall_reducescatter_on_the_device",
                                  "broadcast_variables_assigns_the_roots_values",
                                  "distributed_gradient_tape_averages_on_the_device"])
def test_tensorflow_gpu_tensors_through_dlpack_at_np2(case, fake_nccl):
    pytest.importorskip("tensorflow")
    env = dict(_mpi_env(fake_nccl), TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    _check("tests/mpi/tf_gpu_cases.py", case, 2, env)


def test_an_nccl_error_cupy_13_cannot_name_is_said_plainly():
    """CuPy 13's NcclError knows codes 0-5; a remote error (6) came out of
    check_async_error as KeyError: 6."""
    from coordinator import gpu

    pending = gpu_fakes._Event()
    pending.done_at = float("inf")

    def remote_error():
        raise KeyError(6)

    with pytest.raises(RuntimeError, match=r"NCCL asynchronous error 6 \(ncclRemoteError"):
        gpu.DeviceWait(0, [pending], check=remote_error).ready()

    def other():
        raise KeyError("not a status")

    with pytest.raises(KeyError):
        gpu.DeviceWait(0, [pending], check=other).ready()


def test_an_nccl_call_that_fails_with_a_code_cupy_13_cannot_name_says_it(host_kernels,
                                                                         monkeypatch):
    """The same KeyError comes out of CuPy 13's synchronous NCCL calls (an
    allreduce whose peer's connection broke): the operation fails naming
    NCCL's status, not with KeyError: 6; other KeyErrors stay as they are."""
    ops, nccl = _nccl_ops(host_kernels, monkeypatch)
    for raised, expected in ((KeyError(6), r"NCCL error 6 \(ncclRemoteError: a peer failed"),
                             (KeyError("x"), r"'x'")):
        def failing(*args, raised=raised):
            raise raised

        monkeypatch.setattr(gpu_fakes._FakeNcclComm, "allReduce", failing)
        e = _entry(pb.ALLREDUCE, np.ones(4, np.float32))
        response = _response(pb.ALLREDUCE, pb.FLOAT32, reduce_op=pb.SUM)
        with pytest.raises(RuntimeError if raised.args[0] == 6 else KeyError, match=expected):
            drive(ops.allreduce(response, [e], ["t"]))


def test_an_nccl_abort_that_waits_for_a_peer_never_holds_the_rank_up():
    """NCCL's abort waits for the communicator's other ranks on the machine;
    a failed job's peer stuck elsewhere never comes: the aborts run in a
    helper thread, waited for a bounded time, in the order given."""
    import threading

    from coordinator.ops.nccl_ops import abort_all

    release, order = threading.Event(), []

    class Comm:
        def __init__(self, name, blocks=False, fails=False):
            self.name, self.blocks, self.fails = name, blocks, fails

        def abort(self):
            order.append(self.name)
            if self.fails:
                raise RuntimeError("old NCCL")
            if self.blocks:
                release.wait()

    assert abort_all([Comm("a", fails=True), Comm("b")], wait=5.0) is True
    assert order == ["a", "b"]
    order.clear()
    assert abort_all([Comm("c", blocks=True), Comm("d")], wait=0.2) is False
    assert order == ["c"]  # still waiting for its peer; the caller went on
    release.set()
    assert abort_all([], wait=0.0) is True
