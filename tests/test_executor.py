"""The executor drives operations without blocking (coordinator/executor.py):
each progress call tests the operations in flight again and again for up to
Executor.BURST, whether they wait for MPI or for a device, and returns as
soon as one has finished or (with early completion) has all its work queued."""

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


def _op(lane, *waits, result="done", started=None):
    def gen():
        if started is not None:
            started.append(result)
        for w in waits:
            yield w
        return [result]
    return Operation(response=None, entries=[None], names=["t"], lane=lane, gen=gen())


def test_an_operation_in_flight_is_tested_for_the_whole_burst():
    mpi, event = Waitable(), Event()
    for lane, waiting, tests in (((0, -1), mpi, lambda: mpi.tests),
                                 ((0, 0), gpu.DeviceWait(0, [event]), lambda: event.reads)):
        ex = Executor()
        assert ex.start(_op(lane, waiting)) == []
        before = tests()
        assert ex.progress() == []
        assert tests() > before + 1  # polled again and again for Executor.BURST


def test_an_operation_that_finishes_during_the_burst_is_returned_by_that_call():
    """Its completion is seen within microseconds, not at the next call: on
    the GPU the next NCCL call can start only after it."""
    ex = Executor()
    ex.start(_op((0, 0), gpu.DeviceWait(0, [Event(after=5)])))
    (done,) = ex.progress()
    assert done.results == ["done"] and not ex


def test_with_early_completion_a_queued_operation_is_handed_out_at_once():
    waiting = Waitable(results=["queued"])  # never fires during the test
    ex = Executor(early=True)
    ex.start(_op((0, 0), waiting))
    (queued,) = ex.take_queued()
    assert queued.queued_results == ["queued"] and ex  # still in flight
    assert ex.progress() == [] and ex.take_queued() == []  # handed out once


def test_with_early_completion_progress_returns_once_an_operation_is_queued():
    """A GPU lane's first operation sends its NCCL id over MPI, then queues
    its work: the call that sees it queued returns so its handles complete."""
    id_sent, device = Waitable(after=3), Waitable(results=["queued"])
    ex = Executor(early=True)
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
