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


def _fire(wait, took=HOUR):
    """As if the hour had passed: the operation's work is done, and (for
    the lane's CallTimes) it ran for `took` seconds on the device."""
    for event in wait.events:
        event.done_at = 0.0
        event.stream.busy_until = 0.0
    if wait.timing is not None:
        wait.timing[0].done_at = -took


def _submit(hvd, name, value, count):
    """A Sum allreduce of `count` floats `value` + rank: (handle, entry)."""
    from coordinator import runtime

    x = FakeDeviceArray.of(np.full(count, value + hvd.rank(), np.float32))
    handle = hvd.allreduce_async(x, op=hvd.Sum, name=name)
    (entry,) = runtime.current().handles.entries(handle)
    return handle, entry


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


def _switch_interval_becomes(seconds):
    deadline = time.monotonic() + 30
    while abs(sys.getswitchinterval() - seconds) > 1e-7:
        assert time.monotonic() < deadline, (
            f"the switch interval stayed {sys.getswitchinterval()}, not {seconds}")
        time.sleep(0.001)


def case_the_switch_interval_is_short_only_while_gpu_work_is_in_flight(hvd):
    """COORDINATOR_SWITCH_INTERVAL (100 us) while an NCCL call runs, so that
    a thread that needs the interpreter lock (a gradient hook) gets it soon
    from the polling background thread; the program's own otherwise."""
    me = hvd.rank()
    assert sys.getswitchinterval() == 5e-3  # Python's default: nothing in flight
    hvd.allreduce(np.full(2, me, np.float32), name="switch.host")  # a host operation
    assert sys.getswitchinterval() == 5e-3
    handle = hvd.allreduce_async(FakeDeviceArray.of(np.full(3, me, np.float32)), op=hvd.Sum,
                                 name="switch.device")
    wait = _done_wait(hvd, handle)
    _switch_interval_becomes(100e-6)
    _fire(wait)
    hvd.synchronize(handle)
    _lane_idle(hvd)
    _switch_interval_becomes(5e-3)


def case_in_stream_order_a_handle_completes_once_queued_the_others_later(hvd):
    """Without the setting, a device tensor submitted inside
    collectives.in_stream_order (as DistributedOptimizer submits its
    gradients) completes once its operation is queued, and synchronize
    makes the caller's stream wait for it; another tensor fused into the
    same operation waits for the device."""
    import threading

    from coordinator import collectives

    me, n = hvd.rank(), hvd.size()
    stream = FAKE["cupy"].cuda.get_current_stream()
    with collectives.in_stream_order():
        ordered = hvd.allreduce_async(FakeDeviceArray.of(np.full(3, me, np.float32)),
                                      op=hvd.Sum, name="ordered")
    after = hvd.allreduce_async(FakeDeviceArray.of(np.full(2, 10.0 * me, np.float32)),
                                op=hvd.Sum, name="after")  # (outside: not in stream order)
    wait = _done_wait(hvd, ordered)
    got = hvd.synchronize(ordered)  # though the device work has an hour to go
    assert not wait.ready(), "the completion event fired: the case cannot tell"
    np.testing.assert_array_equal(got.get(), np.full(3, sum(range(n)), np.float32))
    assert wait.events[0] in stream.waited
    later = []
    waiter = threading.Thread(target=lambda: later.append(hvd.synchronize(after)))
    waiter.start()
    waiter.join(0.3)
    assert not later, "completed before its operation's work was done"
    later_wait = _done_wait(hvd, after)
    for w in {id(wait): wait, id(later_wait): later_wait}.values():
        _fire(w)
    waiter.join(30)
    np.testing.assert_array_equal(later[0].get(), np.full(2, 10.0 * sum(range(n)), np.float32))
    stream.busy_until = 0.0
    _lane_idle(hvd)


def _learn(hvd, names, took=HOUR, steps=2):
    """Reduces each named tensor `steps` times, so the names are known (only
    known names are held) and the lane has learned that a call runs `took`
    seconds."""
    for _ in range(steps):
        for name in names:
            handle, _ = _submit(hvd, name, 0.0, 2)
            _fire(_done_wait(hvd, handle), took=took)
            hvd.synchronize(handle)


def _second_held(hvd, prefix, look_after):
    """Submits `prefix`.first, queued at once on the idle lane (its call would
    run for an hour), then `prefix`.second, and checks `look_after` seconds
    later that the second is held: (NCCL calls before, first's handle and
    DeviceWait, second's handle and entry)."""
    calls = len(FAKE["nccl"].calls)
    first, _ = _submit(hvd, prefix + ".first", 1.0, 2)
    first_wait = _done_wait(hvd, first)
    second, entry = _submit(hvd, prefix + ".second", 10.0, 2)
    time.sleep(look_after)
    assert len(FAKE["nccl"].calls) == calls + 1 and entry.done_event is None, "not held"
    return calls, first, first_wait, second, entry


def _until_queued(entry, calls, first_wait, why):
    """Waits until the held `entry`'s call is queued, while the first call
    (`first_wait`) still runs; `why`: what it means if it never is."""
    deadline = time.monotonic() + 30
    while entry.done_event is None:
        assert time.monotonic() < deadline, why
        time.sleep(0.001)
    assert len(FAKE["nccl"].calls) == calls + 2
    assert not first_wait.ready(), "the first call ended: the case cannot tell"


def case_a_held_tensor_goes_shortly_before_the_running_call_should_end(hvd):
    """A GPU tensor submitted while its lane runs an operation is held for a
    fuller fusion, but not until the host sees that operation end: once the
    lane should be free within DEVICE_HOLD_LEAD seconds (by how long its
    earlier operations ran on the device), its operation is negotiated and
    queued behind the running one, with nobody waiting for it yet. (Runs
    before the case below, whose hour-long calls would teach the lane that
    its calls run for an hour.)"""
    from coordinator import pacing

    took, held = 600.0, 2.0  # a call runs `took` s; the next is held `held` s
    _learn(hvd, ("lead.first", "lead.second"), took=took, steps=3)
    saved = pacing.DEVICE_HOLD_LEAD, pacing.DEVICE_HOLD_MAX
    # Looked at with no lead first, so that it is held for all of the
    # running call's `took` s: with the lead, only `held` s, which a loaded
    # machine could pass before the look.
    pacing.DEVICE_HOLD_LEAD, pacing.DEVICE_HOLD_MAX = 0.0, HOUR
    try:
        calls, first, first_wait, second, entry = _second_held(hvd, "lead", 0.2)
        pacing.DEVICE_HOLD_LEAD = took - held
        _until_queued(entry, calls, first_wait, "held until the running call ended")
        _fire(first_wait, took=took)
        _fire(entry.done_event, took=took)
        np.testing.assert_array_equal(hvd.synchronize(second).get(),
                                      np.full(2, 21.0, np.float32))
        np.testing.assert_array_equal(hvd.synchronize(first).get(), np.full(2, 3.0, np.float32))
        _lane_idle(hvd)
    finally:
        pacing.DEVICE_HOLD_LEAD, pacing.DEVICE_HOLD_MAX = saved


def case_waiting_for_a_held_tensor_queues_it_behind_the_running_call(hvd):
    """A GPU tensor submitted while its lane runs an operation is held for a
    fuller fusion; a thread that then waits for it releases the hold, and
    its operation is queued on the device behind the running one, not
    after the host has seen that one end."""
    import threading

    from coordinator import pacing

    _learn(hvd, ("held.first", "held.second"))
    # Only the wait may end the hold, not its time limit (nor the stall
    # checks' messages, which make every rank post a cycle: they are off).
    hold_max, pacing.DEVICE_HOLD_MAX = pacing.DEVICE_HOLD_MAX, HOUR
    try:
        calls, first, first_wait, second, entry = _second_held(hvd, "held", 0.2)
        got = []
        waiter = threading.Thread(target=lambda: got.append(hvd.synchronize(second)))
        waiter.start()
        _until_queued(entry, calls, first_wait, "the wait did not release the held tensor")
        _fire(first_wait)
        _fire(entry.done_event)
        waiter.join(30)
        np.testing.assert_array_equal(got[0].get(), np.full(2, 21.0, np.float32))
        np.testing.assert_array_equal(hvd.synchronize(first).get(), np.full(2, 3.0, np.float32))
        _lane_idle(hvd)
    finally:
        pacing.DEVICE_HOLD_MAX = hold_max


def case_a_failure_after_early_completion_stops_the_job_naming_the_setting(hvd):
    """With the setting, or (without it) for a tensor taken in stream order."""
    from coordinator import collectives
    from coordinator.errors import HorovodInternalError

    setting = os.environ.get("HOROVOD_ENABLE_ASYNC_COMPLETION") == "1"
    with collectives.in_stream_order():
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
        why = "HOROVOD_ENABLE_ASYNC_COMPLETION" if setting else "in stream order"
        assert why in text and "doomed" in text, text
        assert "NCCL error" in text, text
    else:
        raise AssertionError("the job went on after a failed operation")


def case_after_a_failure_shutdown_aborts_the_nccl_communicators(hvd):
    """Run after the case above, whose job failed: the GPU may still hold
    collectives no peer will finish, so shutdown() aborts this rank's NCCL
    communicators (before, only after a peer died), and elastic training
    re-forms with new ones."""
    from coordinator import runtime

    assert runtime.current().fatal_error is not None, "the job did not fail"
    calls = FAKE["nccl"].calls
    assert ("abort", 0) not in calls, calls
    hvd.shutdown()
    assert ("abort", 0) in calls, calls
