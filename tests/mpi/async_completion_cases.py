"""HOROVOD_ENABLE_ASYNC_COMPLETION on device arrays, under mpirun at np=2 on
a machine without a GPU: the fake CuPy of tests/gpu_fakes.py with a timed
FakeNccl whose calls keep their stream busy for an hour, so no operation's
completion event fires unless a case fires it (`_fire`). Run by
tests/test_gpu_fallback.py with and without the setting."""

import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_fakes  # noqa: E402
from gpu_fakes import FakeDeviceArray  # noqa: E402

HOUR = 3600.0
FAKE = {}


def setup(hvd):
    from mpi4py import MPI

    from coordinator import gpu

    scratch = tempfile.mkdtemp(prefix=f"host-kernels-{MPI.COMM_WORLD.rank}-")
    FAKE["nccl"] = gpu_fakes.FakeNccl(MPI.COMM_WORLD.Dup(), latency=HOUR, bandwidth=1e12)
    FAKE["cupy"] = gpu._modules["cupy"] = gpu_fakes.fake_cupy(FAKE["nccl"],
                                                              gpu_fakes.HostKernels(scratch))
    hvd.init()


def _done_wait(hvd, handle):
    """The DeviceWait of the operation behind `handle`, once it has one."""
    from coordinator import runtime

    (entry,) = runtime.current().handles.entries(handle)
    deadline = time.monotonic() + 30
    while entry.done_event is None:
        assert time.monotonic() < deadline, "the operation was never queued"
        time.sleep(0.001)
    return entry.done_event


def _fire(wait):
    """As if the hour had passed: the operation's work is done."""
    for event in wait.events:
        event.done_at = 0.0
        event.stream.busy_until = 0.0


def _lane_idle(hvd):
    from coordinator import runtime

    deadline = time.monotonic() + 30
    while runtime.current().background.executor:
        assert time.monotonic() < deadline, "the operation never finished"
        time.sleep(0.001)


def case_with_it_a_handle_completes_once_queued_and_the_stream_waits(hvd):
    me, n = hvd.rank(), hvd.size()
    x = FakeDeviceArray.of(np.arange(6, dtype=np.float32) + me)
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="early")
    wait = _done_wait(hvd, handle)
    stream = FAKE["cupy"].cuda.get_current_stream()
    got = hvd.synchronize(handle)  # returns although the device work has an hour to go
    assert not wait.ready(), "the completion event fired: the case cannot tell"
    expected = sum(np.arange(6, dtype=np.float32) + r for r in range(n))
    np.testing.assert_array_equal(got.get(), expected)  # the fake moved the data at once
    # The caller's stream was made to wait for the operation's completion event.
    assert wait.events[0] in stream.waited
    assert stream.busy_until >= wait.events[0].done_at > time.perf_counter() + HOUR / 2
    _fire(wait)
    stream.busy_until = 0.0
    _lane_idle(hvd)


def case_a_grouped_allreduce_and_a_broadcast_complete_early_too(hvd):
    me = hvd.rank()
    xs = [FakeDeviceArray.of(np.full(k + 1, me + k, np.float64)) for k in range(3)]
    group = hvd.grouped_allreduce_async(xs, op=hvd.Average, name="early.group")
    got = hvd.synchronize(group)
    for k, out in enumerate(got):
        np.testing.assert_allclose(out.get(), np.full(k + 1, k + 0.5))
    _finish_all(hvd)  # the lane runs one operation at a time: let the next start
    bcast = hvd.broadcast_async(FakeDeviceArray.of(np.full(4, me, np.int32)), root_rank=1,
                                name="early.bcast")
    np.testing.assert_array_equal(hvd.synchronize(bcast).get(), np.full(4, 1, np.int32))
    _finish_all(hvd)


def _finish_all(hvd):
    """Fires every operation in flight (each completed early) and waits for
    the lane to be idle."""
    from coordinator import runtime

    for op in runtime.current().background.executor.in_flight():
        assert op.completed_early
        _fire(op._waiting)
    FAKE["cupy"].cuda.get_current_stream().busy_until = 0.0
    _lane_idle(hvd)


def case_without_it_a_handle_waits_for_the_device(hvd):
    me = hvd.rank()
    handle = hvd.allreduce_async(FakeDeviceArray.of(np.full(3, me, np.float32)), op=hvd.Sum,
                                 name="late")
    wait = _done_wait(hvd, handle)
    for _ in range(20):  # the event cannot fire by itself: the handle stays open
        assert not hvd.poll(handle)
        time.sleep(0.005)
    _fire(wait)
    np.testing.assert_array_equal(hvd.synchronize(handle).get(), np.full(3, 1, np.float32))
    _lane_idle(hvd)


def case_a_failure_after_early_completion_stops_the_job_naming_the_setting(hvd):
    from coordinator.errors import HorovodInternalError

    handle = hvd.allreduce_async(FakeDeviceArray.of(np.ones(2, np.float32)), name="doomed")
    wait = _done_wait(hvd, handle)
    hvd.synchronize(handle)

    def broken():
        raise RuntimeError("NCCL error: unhandled system error (a peer died)")
    wait.check = broken  # the communicator's asynchronous error, as NCCL reports it
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            hvd.allreduce(np.ones(1), name=f"after.{time.monotonic()}")
            time.sleep(0.01)
    except HorovodInternalError as exc:
        text = str(exc)
        assert "HOROVOD_ENABLE_ASYNC_COMPLETION" in text and "doomed" in text, text
        assert "NCCL error" in text, text
    else:
        raise AssertionError("the job went on after a failed operation")
