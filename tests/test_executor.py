"""The executor drives operations without blocking (coordinator/executor.py):
each progress call tests the operations in flight again and again for up to
Executor.BURST, whether they wait for MPI or for a device, and returns as
soon as one has finished or has all its work queued on a device."""

import math
import time
import types

import pytest

from coordinator import gpu
from coordinator.executor import Executor, Operation


class Waitable:
    """Counts how often it is tested; ready once tested `after` times."""

    def __init__(self, after=None, results=None, lets_next_start=False):
        self.after = after
        self.tests = 0
        self.results = results  # as gpu.DeviceWait carries them
        self.lets_next_start = lets_next_start

    def ready(self):
        self.tests += 1
        return self.after is not None and self.tests >= self.after


class Event:
    """A CUDA event's stand-in: fired once read `after` times."""

    def __init__(self, after=None):
        self.after = after
        self.reads = 0

    @property
    def done(self):
        self.reads += 1
        return self.after is not None and self.reads >= self.after


def _op(lane, *waits, result="done", started=None, device=None):
    def gen():
        if started is not None:
            started.append(result)
        for w in waits:
            yield w
        return [result]
    return Operation(response=None, entries=[None], names=["t"], lane=lane, gen=gen(),
                     device=device)


def test_an_operation_in_flight_is_tested_for_the_whole_burst():
    mpi, event = Waitable(), Event()
    for lane, waiting, tests in (((0, -1), mpi, lambda: mpi.tests),
                                 ((0, 0), gpu.DeviceWait(0, [event]), lambda: event.reads)):
        ex = Executor()
        assert ex.start(_op(lane, waiting)) == []
        polls = []
        for _ in range(5):  # (a busy machine may take the CPU away for a whole burst)
            before = tests()
            assert ex.progress() == []
            polls.append(tests() - before)
        assert max(polls) > 1, polls  # polled again and again for Executor.BURST


def test_an_operation_that_finishes_during_the_burst_is_returned_by_that_call():
    """Its completion is seen within microseconds, not at the next call: on
    the GPU the next NCCL call can start only after it."""
    ex = Executor()
    ex.start(_op((0, 0), gpu.DeviceWait(0, [Event(after=5)])))
    (done,) = ex.progress()
    assert done.results == ["done"] and not ex


def test_a_queued_operation_is_handed_out_at_once():
    waiting = Waitable(results=["queued"])  # never fires during the test
    ex = Executor()
    ex.start(_op((0, 0), waiting))
    (queued,) = ex.take_queued()
    assert queued.queued_results == ["queued"] and ex  # still in flight
    assert ex.progress() == [] and ex.take_queued() == []  # handed out once


def test_progress_returns_once_an_operation_is_queued():
    """A GPU lane's first operation sends its NCCL id over MPI, then queues
    its work: the call that sees it queued returns so its handles complete."""
    id_sent, device = Waitable(after=3), Waitable(results=["queued"])
    ex = Executor()
    ex.start(_op((0, 0), id_sent, device))
    assert ex.progress() == []
    assert device.tests <= 1  # not polled on for the rest of the burst
    assert [op.queued_results for op in ex.take_queued()] == [["queued"]]


def test_the_next_operation_queues_behind_one_whose_device_work_is_all_queued():
    """A GPU operation whose work is all queued (and that lets the next start)
    does not keep the lane's next operation from queuing its own behind it;
    a third waits until the first has finished; they finish in lane order."""
    started = []
    first = Waitable(results=["a"], lets_next_start=True)
    second = Waitable(results=["b"], lets_next_start=True)
    ex = Executor()
    ex.start(_op((0, 0), first, result="a", started=started))
    ex.start(_op((0, 0), second, result="b", started=started))
    ex.start(_op((0, 0), Waitable(after=1), result="c", started=started))
    assert started == ["a", "b"]
    second.after = second.tests + 1  # the second is done before the first
    assert ex.progress() == [] and started == ["a", "b"]
    first.after = first.tests + 1
    done = ex.progress()
    assert [op.results for op in done[:2]] == [["a"], ["b"]]
    assert started == ["a", "b", "c"]


def test_an_operation_that_does_not_let_the_next_start_keeps_it_waiting():
    """Host (MPI) operations, and GPU ones still between their calls, run one
    after the other in their lane."""
    for waiting in (Waitable(), Waitable(results=["a"])):
        started = []
        ex = Executor()
        ex.start(_op((0, 0), waiting, result="a", started=started))
        ex.start(_op((0, 0), Waitable(), result="b", started=started))
        assert ex.progress() == [] and started == ["a"]
        waiting.after = waiting.tests + 1
        assert [op.results for op in ex.progress()] == [["a"]]
        assert started == ["a", "b"]


def test_lanes_of_one_device_start_their_operations_in_the_order_they_were_started():
    """Two sets' GPU lanes: the second set's operation waits until the first
    set's has queued all its work, though its own lane is free, and a third
    set's waits for both; a host lane (device -1) and another device's do
    not wait. So every rank queues its NCCL calls in the order the
    negotiation gave it, and two ranks never wait on each other's calls."""
    started = []
    first = Waitable(results=["a"])  # between its calls: not yet all queued
    second = Waitable(results=["b"], lets_next_start=False)
    ex = Executor()
    ex.start(_op((1, 0), first, result="a", started=started))
    ex.start(_op((2, 0), second, result="b", started=started))
    ex.start(_op((3, 0), Waitable(), result="c", started=started))
    ex.start(_op((2, -1), Waitable(), result="host", started=started))
    ex.start(_op((2, 1), Waitable(), result="other device", started=started))
    assert ex.progress() == [] and started == ["a", "host", "other device"]
    first.lets_next_start = True  # its work is all queued on the device
    assert ex.progress() == [] and started == ["a", "host", "other device", "b"]
    second.after = second.tests + 1  # finished: the third may start
    assert [op.results for op in ex.progress()] == [["b"]]
    ex.progress()
    assert started == ["a", "host", "other device", "b", "c"]


def test_lanes_named_by_other_ranks_gpus_keep_this_ranks_gpu_in_order():
    """A lane is named by the response's device (rank 0's ordinal, the same
    on every rank); on a machine of several GPUs this rank runs both sets'
    operations on its own GPU 3: they are ordered on it, and asked about
    GPU 3 the executor says so."""
    started = []
    first = Waitable(results=["a"])
    ex = Executor()
    ex.start(_op((1, 0), first, result="a", started=started, device=3))
    ex.start(_op((2, 2), Waitable(), result="b", started=started, device=3))
    assert ex.progress() == [] and started == ["a"]
    assert ex.busy((1, 3)) and ex.busy((2, 3)) and not ex.busy((1, 0))
    first.lets_next_start = True
    ex.progress()
    assert started == ["a", "b"]


def test_a_gpu_operation_that_fails_lets_the_next_on_its_device_start():
    def failing():
        yield Waitable(after=1)
        raise RuntimeError("NCCL error")
    started = []
    ex = Executor()
    done = ex.start(Operation(response=None, entries=[None], names=["t"], lane=(1, 0),
                              gen=failing()))
    done += ex.start(_op((2, 0), Waitable(after=2), result="b", started=started))
    for _ in range(100):
        if len(done) == 2:
            break
        done += ex.progress()
    assert isinstance(done[0].error, RuntimeError) and done[1].results == ["b"]
    assert not ex._device_order  # nothing kept once done


class _Timed:
    """A CUDA event's stand-in for timing: `at` is when it fired on the
    device's clock (None: not yet)."""

    def __init__(self, at=None):
        self.at = at

    @property
    def done(self):
        return self.at is not None


@pytest.fixture
def device_clock(monkeypatch):
    """cupy.cuda.get_elapsed_time over _Timed events (milliseconds)."""
    cuda = types.SimpleNamespace(get_elapsed_time=lambda a, b: (b.at - a.at) * 1e3)
    monkeypatch.setitem(gpu._modules, "cupy", types.SimpleNamespace(cuda=cuda))


def _timed_wait(times, nbytes, start=None, end=None):
    return gpu.DeviceWait(0, [end or _Timed()], timing=(start or _Timed(), nbytes, times),
                          lets_next_start=True)


def test_call_times_fit_latency_and_bandwidth_to_what_ran():
    times = gpu.CallTimes()
    assert times.predict(100) is None  # nothing learned yet
    for nbytes in (1e3, 1e6, 1e7, 6e7):
        times.observe(nbytes, 4.5e-3 + nbytes / 1.8e9)
    assert times.predict(5e6) == pytest.approx(4.5e-3 + 5e6 / 1.8e9)
    one_size = gpu.CallTimes()
    one_size.observe(64, 1.0)
    one_size.observe(64, 3.0)
    assert one_size.predict(64) == one_size.predict(1 << 30) == 2.0  # their mean
    shrinking = gpu.CallTimes()  # larger ran shorter: no bandwidth to tell, the mean
    shrinking.observe(10, 2.0)
    shrinking.observe(1000, 1.0)
    assert shrinking.predict(10) == shrinking.predict(1000) == 1.5
    no_latency = gpu.CallTimes()  # a fitted negative latency: through the origin
    no_latency.observe(100, 0.1)
    no_latency.observe(200, 0.3)
    assert no_latency.predict(0) == 0.0 and no_latency.predict(100) > 0
    window = gpu.CallTimes()
    for _ in range(gpu.CallTimes.WINDOW):
        window.observe(64, 100.0)
    for _ in range(gpu.CallTimes.WINDOW):
        window.observe(64, 1.0)
    assert window.predict(64) == 1.0  # only the last WINDOW count


def test_a_device_wait_teaches_how_long_its_work_ran_once_done(device_clock):
    times = gpu.CallTimes()
    start, end = _Timed(at=5.0), _Timed()
    wait = _timed_wait(times, 1000, start, end)
    assert not wait.ready() and times.predict(1000) is None
    end.at = 7.5
    assert wait.ready() and times.predict(1000) == 2.5
    assert wait.ready() and times.predict(1000) == 2.5  # learned once


def test_a_device_wait_expects_its_end_from_when_its_work_began(device_clock):
    times = gpu.CallTimes()
    times.observe(1000, 2.0)
    assert gpu.DeviceWait(0, [_Timed()]).expected_end(10.0) is None  # no timing
    assert _timed_wait(gpu.CallTimes(), 1000).expected_end(10.0) is None  # nothing learned
    start = _Timed()
    wait = _timed_wait(times, 1000, start)
    assert wait.expected_end(10.0) is None  # not begun, nothing before it
    assert wait.expected_end(10.0, after=11.0) == 13.0  # begins when the work before ends
    start.at = 0.0
    assert wait.expected_end(12.0, after=11.0) == 14.0  # seen begun at 12.0
    assert wait.expected_end(13.0) == 14.0  # (from then on)
    done = _timed_wait(times, 1000, _Timed(at=0.0), _Timed(at=1.0))
    assert done.ready() and done.expected_end(20.0) == 20.0


def test_busy_for_says_how_long_a_lane_should_stay_busy(device_clock):
    """Executor.busy_for: 0 for an idle lane; from what each operation's
    DeviceWait expects, the lane's queue in turn; inf where any cannot tell."""
    times = gpu.CallTimes()
    times.observe(1000, 2.0)
    ex = Executor()
    assert ex.busy_for((0, 0), 1.0) == 0.0
    ex.start(_op((0, 1), Waitable()))  # a host operation: no telling
    assert ex.busy_for((0, 1), 1.0) == math.inf
    first_start = _Timed()
    ex.start(_op((0, 0), _timed_wait(times, 1000, first_start)))
    assert ex.busy_for((0, 0), 1.0) == math.inf  # waits for its inputs: not begun
    ex.start(_op((0, 0), _timed_wait(times, 1000)))  # queued behind it
    first_start.at = 0.0
    now = time.monotonic() + 100.0
    assert ex.busy_for((0, 0), now) == 4.0  # the first seen begun now, then the second
    assert ex.busy_for((0, 0), now + 1.5) == 2.5
    assert ex.busy_for((0, 0), now + 10.0) == 0.0  # overdue: expected no longer busy
    ex.start(_op((0, 0), Waitable()))  # a third, not started
    assert ex.busy_for((0, 0), now) == math.inf


def test_on_device_says_whether_any_operation_in_flight_runs_on_a_gpu():
    """Executor.on_device (the background thread keeps the interpreter's
    switch interval short while it is true): lanes are (process set,
    device), a host lane's device -1."""
    ex = Executor()
    assert not ex.on_device()
    host = Waitable(after=2)
    ex.start(_op((0, -1), host))
    assert not ex.on_device()
    gpu_wait = Waitable(after=2)
    ex.start(_op((1, 0), gpu_wait))
    assert ex.on_device()
    ex.progress()  # both ready now
    assert not ex and not ex.on_device()


def test_shutdown_waits_for_communicators_still_being_made():
    """A helper thread still inside MPI_Comm_create_group when the process
    finalizes MPI crashed it (SIGSEGV, a set added just before the end):
    the runtime's shutdown first waits, bounded, until every communicator
    being made is made (OperationManager.settle)."""
    import threading

    from coordinator.ops import OperationManager
    from coordinator.ops.mpi_ops import Making

    release = threading.Event()
    making = Making(lambda: release.wait(30) and "comm")
    ops = OperationManager([])
    start = time.monotonic()
    # Still being made: gave up after the bound (the make itself would end
    # only after 30 s), having waited for it meanwhile. No upper bound on
    # the time: a loaded machine may take any time to get back here.
    assert ops.settle(0.2) is False
    assert time.monotonic() - start >= 0.15
    release.set()
    assert ops.settle(5) is True and making.outcome() == "comm"
    queued = Making(lambda: "later", start=False)  # InOrder's, not run yet
    assert ops.settle(0.05) is False
    queued.run()
    assert ops.settle(0) is True


def test_a_submitting_thread_reads_busy_while_this_thread_changes_the_lanes():
    """Background.lane_idle asks busy() from the thread that submits, while
    the background thread starts and finishes operations: a loop over the
    lanes themselves raised 'deque mutated during iteration' (or the
    OrderedDict's) there, out of a gradient's allreduce_async."""
    import sys
    import threading

    ex = Executor()
    errors, stop = [], threading.Event()

    def reader():
        try:
            while not stop.is_set():
                for device in (-1, 0, 1):
                    ex.busy((0, device))
                    ex.busy((1, device))
        except Exception as exc:  # noqa: BLE001 (what the test looks for)
            errors.append(exc)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not errors:
            waits = [Waitable(after=2) for _ in range(40)]
            for i, w in enumerate(waits):
                ex.start(_op((i % 2, i % 3 - 1), w, device=i % 3 - 1))
            while ex:
                ex.progress()
    finally:
        stop.set()
        thread.join(10)
        sys.setswitchinterval(before)
    assert not errors, errors
