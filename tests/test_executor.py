"""The executor drives operations without blocking (coordinator/executor.py);
one whose lanes all wait for a device is tested once per call, not in a
tight loop."""

from coordinator.executor import Executor, Operation


class Waitable:
    """Counts how often it is tested; ready once `fire()` was called."""

    def __init__(self, on_device):
        if on_device:
            self.on_device = True
        self.tests = 0
        self.fired = False

    def ready(self):
        self.tests += 1
        return self.fired

    def fire(self):
        self.fired = True


def _op(lane, *waits, result="done"):
    def gen():
        for w in waits:
            yield w
        return [result]
    return Operation(response=None, entries=[None], names=["t"], lane=lane, gen=gen())


def test_an_operation_waiting_for_its_device_is_tested_once_per_progress_call():
    device = Waitable(on_device=True)
    ex = Executor()
    assert ex.start(_op((0, 0), device)) == []
    assert ex.device_bound()
    before = device.tests
    assert ex.progress() == []
    assert device.tests == before + 1
    device.fire()
    (done,) = ex.progress()
    assert done.results == ["done"] and not ex


def test_an_operation_waiting_for_mpi_is_tested_for_the_whole_burst():
    host = Waitable(on_device=False)
    ex = Executor()
    ex.start(_op((0, -1), host))
    assert not ex.device_bound()
    before = host.tests
    assert ex.progress() == []
    assert host.tests > before + 1  # polled again and again for Executor.BURST


def test_a_device_operation_is_device_bound_only_once_its_mpi_part_is_done():
    """A GPU lane's first operation sends its NCCL id over MPI first."""
    id_sent, device = Waitable(on_device=False), Waitable(on_device=True)
    ex = Executor()
    ex.start(_op((0, 0), id_sent, device))
    assert not ex.device_bound()
    id_sent.fire()
    ex.progress()
    assert ex.device_bound()


def test_one_lane_waiting_for_mpi_keeps_the_executor_polling():
    device, host = Waitable(on_device=True), Waitable(on_device=False)
    ex = Executor()
    ex.start(_op((0, 0), device))
    ex.start(_op((1, -1), host))
    assert not ex.device_bound()
    host.fire()
    ex.progress()
    assert ex.device_bound()
