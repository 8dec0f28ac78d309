"""While a frontend thread is blocked on a result, the background thread keeps
polling instead of sleeping (coordinator/background.py): the handle table
counts the blocked threads, and the loop's timeout follows that count."""

import _thread
import math
import sys
import threading
import time
import types

import pytest

from coordinator import background, pacing
from coordinator.background import Background, waited_spin_budget
from coordinator.handles import HandleTable
from coordinator.pacing import DeviceHold
from coordinator.tensor_queue import Entry, Signal, TensorQueue


def _wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_handle_table_counts_the_threads_blocked_in_wait():
    table = HandleTable()
    entries = [Entry("a", 1), Entry("b", 1)]
    handle = table.add(entries)
    results = []
    waiter = threading.Thread(target=lambda: results.append(table.wait(handle)), daemon=True)
    waiter.start()
    _wait_until(lambda: table.waiting == 1)
    entries[0].finish("x")
    assert table.waiting == 1  # still waiting for the second entry
    entries[1].finish("y")
    waiter.join(10)
    assert results == [["x", "y"]]
    assert table.waiting == 0


def test_waiting_for_a_completed_handle_does_not_count():
    table = HandleTable()
    entry = Entry("a", 1)
    entry.finish(3)
    seen = []
    table.wait(table.add(entry), health_check=lambda: seen.append(table.waiting))
    assert table.waiting == 0 and not seen


def test_a_failed_wait_still_uncounts_itself():
    table = HandleTable()
    entry = Entry("a", 1)
    entry.fail(RuntimeError("boom"))
    try:
        table.wait(table.add(entry))
    except RuntimeError:
        pass
    assert table.waiting == 0


def _submit_and_wait(table, name):
    """A thread that submits `name` to `table` and waits for it; returns
    (its entry, the thread), once it waits."""
    entry = Entry(name, 1)
    waiting = table.waiting
    thread = threading.Thread(target=lambda: table.wait(table.add(entry)), daemon=True)
    thread.start()
    _wait_until(lambda: table.waiting == waiting + 1)
    return entry, thread


def test_blocked_seconds_counts_only_while_every_live_submitter_waits():
    """The deadlock check's view of a process: blocked while every live
    thread that has submitted is waiting in wait(), since the last of them
    began; not while one of them is not (it may still submit), nor before
    any thread has submitted; a thread that has ended no longer counts."""
    table = HandleTable()
    assert table.blocked_seconds() == 0.0  # nobody submitted yet
    main_entry = Entry("main", 1)
    main_handle = table.add(main_entry)  # this thread submits...
    assert table.blocked_seconds() == 0.0  # ...and is not waiting
    other_entry, go = Entry("other", 1), threading.Event()
    handles = {}

    def other():
        handles["other"] = table.add(other_entry)
        go.wait(10)
        table.wait(handles["other"])

    helper = threading.Thread(target=other, daemon=True)
    helper.start()
    _wait_until(lambda: "other" in handles)
    waiter = threading.Thread(target=lambda: table.wait(main_handle), daemon=True)
    waiter.start()  # waits on this thread's handle; this thread still runs
    _wait_until(lambda: table.waiting == 1)
    assert table.blocked_seconds() == 0.0
    go.set()
    _wait_until(lambda: table.waiting == 2)
    assert table.blocked_seconds() == 0.0  # this thread has submitted, and runs
    main_entry.finish(1)
    other_entry.finish(2)
    waiter.join(10)
    helper.join(10)
    # A thread that submitted and ended does not count; one that waits does.
    solo = HandleTable()
    ender = threading.Thread(target=lambda: solo.add(Entry("short", 1)), daemon=True)
    ender.start()
    ender.join(10)
    before = time.monotonic()
    entry, lonely = _submit_and_wait(solo, "solo")
    now = time.monotonic()
    # Blocked since it began to wait, not before (however slowly that went).
    assert 0.0 <= solo.blocked_seconds(now) <= now - before
    assert solo.blocked_seconds(now + 30) >= 30.0
    entry.finish(1)
    lonely.join(10)
    assert solo.blocked_seconds() == 0.0  # it ended: no live submitter


def test_a_pool_thread_quiet_since_its_last_submission_counts_as_blocked():
    """A thread Python did not start (a framework's pool thread, as
    PyTorch's autograd threads for CUDA submit gradients from) that is not
    waiting counts as quiet since its last submission; a Python thread that
    is not waiting never does."""
    table = HandleTable()
    submitted = threading.Event()
    finish = threading.Event()

    def pool_thread():  # threading.current_thread() is a _DummyThread here
        table.add(Entry("grad", 1))
        submitted.set()
        finish.wait(10)

    _thread.start_new_thread(pool_thread, ())
    assert submitted.wait(10)
    pool_submit = time.monotonic()
    entry, t = _submit_and_wait(table, "sync")
    now = time.monotonic()
    assert 0.0 < table.blocked_seconds(now + 60) <= 60.0 + (now - pool_submit)
    table.add(Entry("python thread", 1))  # this thread submits and runs on
    assert table.blocked_seconds(now + 60) == 0.0
    entry.finish(1)
    t.join(10)
    finish.set()


def test_a_thread_inside_a_framework_runtime_counts_as_quiet_since_its_last_submission(
        monkeypatch):
    """A Python thread whose innermost frame is in a framework's runtime
    entry (a frontend names it: Keras's fit() inside TensorFlow's executor)
    counts as a pool thread does; the same thread elsewhere does not."""
    from coordinator import handles

    monkeypatch.setattr(handles, "_RUNTIME_FILES", [])
    namespace = {}
    # A C call straight from the runtime's frame, as TensorFlow's execute()
    # makes (Event.wait would put threading.py's frame innermost).
    exec(compile("def run(lock):\n    lock.acquire(timeout=10)\n",
                 "/fake/framework/runtime.py", "exec"), namespace)
    table = HandleTable()
    started, release = threading.Event(), _thread.allocate_lock()
    release.acquire()

    def caller():  # submits, then runs the framework's work
        table.add(Entry("grad", 1))
        started.set()
        namespace["run"](release)

    runner = threading.Thread(target=caller, daemon=True)
    runner.start()
    assert started.wait(10)
    submitted = time.monotonic()  # after the caller's submission, before the wait's
    entry, waiter = _submit_and_wait(table, "sync")
    # The caller is in run() now: looked at, not slept on (a loaded machine
    # may not have run it yet).
    _wait_until(lambda: sys._current_frames()[runner.ident].f_code.co_filename
                == "/fake/framework/runtime.py")
    now = time.monotonic()
    later = now + 60
    assert table.blocked_seconds(later) == 0.0  # an unknown frame: it may compute
    handles.note_framework_runtime("/fake/framework/")
    # Blocked since the later of the two (the wait), whenever that was.
    assert 60.0 <= table.blocked_seconds(later) <= later - submitted
    release.release()
    runner.join(10)
    entry.finish(1)
    waiter.join(10)


def test_threads_that_submitted_and_ended_are_forgotten():
    """A thread per step that submits once must not make the table of
    submitting threads grow without bound."""
    from coordinator import handles

    table = HandleTable()
    for i in range(5 * handles.PRUNE_SUBMITTERS):
        t = threading.Thread(target=lambda: table.add(Entry("once", 1)), daemon=True)
        t.start()
        t.join(10)
    assert len(table._submitters) <= handles.PRUNE_SUBMITTERS + 1


def test_waited_spin_only_when_every_rank_has_a_cpu():
    assert waited_spin_budget(2, 2) == background.SPIN_WAITED > 0
    assert waited_spin_budget(1, 8) == background.SPIN_WAITED
    assert waited_spin_budget(4, 2) == 0.0


class InFlight:
    """Operations in flight (GPU or MPI: the loop waits for both alike)."""

    def __bool__(self):
        return True

    def busy(self, lane):
        return True


def _loop_state(inflight, waiting, spin_waited, executor=()):
    """A Background with just what `_timeout` reads."""
    bg = Background.__new__(Background)
    bg.queue = types.SimpleNamespace(inflight_count=lambda: inflight, flushed=0)
    bg.handles = types.SimpleNamespace(waiting=waiting)
    bg.executor = executor
    bg.cycle = types.SimpleNamespace(in_flight=False)
    bg.round = None
    bg.flags = 0
    bg._more = False
    bg._next_post = 0.0
    bg._gap_until = 0.0
    bg.channel = types.SimpleNamespace(progress=lambda: False)
    bg.config = types.SimpleNamespace(idle_poll_interval=0.05)
    bg.controller = None
    bg._final = None
    bg._shutdown_wanted = False
    bg.spin_waited = spin_waited
    # What _post_due reads: no cycle due.
    bg._woken = False
    bg._woken_until = 0.0
    bg.classic = []
    bg.resend = []
    bg.is_coordinator = False
    bg._fresh = False
    bg.fast = {}
    bg.sent = []
    bg.hold = DeviceHold(bg.queue, executor)
    return bg


def test_loop_polls_while_a_thread_waits_and_sleeps_otherwise(monkeypatch):
    # 1 ms after the last progress: past the plain spin window, inside the
    # waited one (10 ms), which a loaded machine could otherwise leave
    # between two calls: the loop's clocks stand still.
    now = _freeze_loop_clock(monkeypatch)[1]
    last = now - 1e-3
    budget = background.SPIN_WAITED
    assert _loop_state(1, 1, budget)._timeout(3, last) is None
    assert _loop_state(1, 0, budget)._timeout(3, last) > 0  # nobody waits: back off
    assert _loop_state(1, 1, 0.0)._timeout(3, last) > 0  # oversubscribed: back off
    assert _loop_state(0, 1, budget)._timeout(3, last) == 0.05  # nothing in flight: idle
    # Past the waited window the loop backs off again, waiter or not.
    long_ago = now - 2 * budget
    assert _loop_state(1, 1, budget)._timeout(3, long_ago) > 0


def test_an_idle_worker_asked_into_a_cycle_polls_faster_for_a_while(monkeypatch):
    """Rank 0 asked it to post a cycle for another set's GPU plans (each
    waits for a round of every rank): for WAKE_HOLD seconds after, it looks
    for the next request every WAKE_POLL, not every idle poll (50 ms: each
    such operation took 52 ms)."""
    # The loop's clocks stand still: a loaded machine could otherwise pass
    # the end of the WAKE_HOLD (2 s) between two calls.
    frozen, now = _freeze_loop_clock(monkeypatch)
    last = now - 1.0
    state = _loop_state(0, 0, 0.0)
    state._woken_until = frozen + background.WAKE_HOLD
    assert state._timeout(3, last) == background.WAKE_POLL
    state._woken_until = frozen - 0.1  # the hold is over
    assert state._timeout(3, last) == 0.05


def test_gpu_work_in_flight_is_waited_for_as_mpi_work_is(monkeypatch):
    """Right after progress the loop spins, then backs off, whatever is in
    flight. Sleeping 100 us between looks while only GPU work was in flight
    (tried on 2026-11-26) made the ResNet-50 step on the H100 1.46-1.60x
    DDP's, against 1.06-1.25x this way, so the loop does not tell them apart."""
    now = _freeze_loop_clock(monkeypatch)[1]  # no time passes inside _timeout
    assert _loop_state(4, 0, 0.0, InFlight())._timeout(0, now) is None
    long_ago = now - 1.0
    assert _loop_state(4, 0, 0.0, InFlight())._timeout(3, long_ago) == background.BACKOFF_MIN * 8
    assert _loop_state(4, 0, 0.0, InFlight())._timeout(20, long_ago) == background.BACKOFF_MAX


def test_a_cycle_waits_while_the_gpu_lane_is_busy_and_only_then():
    """A rank holds its next cycle back while every tensor waiting for one is
    a GPU tensor of the global set whose lane still runs an operation (they
    join one larger NCCL call), never for host tensors, other sets or an
    idle lane, and not longer than DEVICE_HOLD_MAX."""
    hold = Background._holding_for_device
    state = _loop([_entry(0), _entry(0)], busy={(0, 0): math.inf})
    assert hold(state, 10.0) and hold(state, 10.5)
    assert not hold(state, 10.0 + pacing.DEVICE_HOLD_MAX)  # bounded
    assert not hold(_loop([_entry(0), _entry(-1)], busy={(0, 0): math.inf}), 1.0)  # host tensor
    assert not hold(_loop([_entry(0)], busy={}), 1.0)  # the lane is free
    assert not hold(_loop([_entry(0, pset=1)], busy={(1, 0): math.inf}), 1.0)  # another set
    assert not hold(_loop([], busy={(0, 0): math.inf}), 1.0)  # nothing waits
    rounds = _loop([_entry(0)], busy={(0, 0): math.inf})
    rounds.flags = background.FLAG_CLASSIC  # a round was asked for: never held
    assert not hold(rounds, 1.0)


def test_the_hold_ends_as_the_lane_should_soon_be_free():
    """Not for the last DEVICE_HOLD_LEAD seconds its lane should stay busy
    (Executor.busy_for): the next operation is negotiated and queued while
    the running one ends, instead of after the host has seen it end."""
    hold = Background._holding_for_device
    lead = pacing.DEVICE_HOLD_LEAD
    assert lead > 0
    assert hold(_loop([_entry(0)], busy={(0, 0): lead * 1.5}), 1.0)
    assert not hold(_loop([_entry(0)], busy={(0, 0): lead * 0.5}), 1.0)
    # Two devices: held only while both lanes stay busy long enough.
    assert hold(_loop([_entry(0), _entry(1)], busy={(0, 0): lead * 2, (0, 1): lead * 3}), 1.0)
    assert not hold(_loop([_entry(0), _entry(1)], busy={(0, 0): lead * 2, (0, 1): lead / 2}),
                    1.0)


def test_a_held_loop_wakes_when_its_hold_should_end(monkeypatch):
    """A rank holding its cycle for a busy lane sleeps no longer than until
    the lane should be within DEVICE_HOLD_LEAD of free, where the back-off
    alone would notice that up to BACKOFF_MAX late; where the end cannot be
    told it backs off as for any work in flight."""
    lead, gap = pacing.DEVICE_HOLD_LEAD, background.BACKOFF_MAX / 5
    # The loop's clocks stand still: the hold's end is `gap` (100 us) away,
    # which a loaded machine could otherwise pass between two calls.
    frozen, now = _freeze_loop_clock(monkeypatch)
    long_ago = now - 1.0

    def held(busy_for):
        state = _loop_state(1, 0, 0.0, InFlight())
        state.executor.busy_for = lambda lane, now: busy_for
        state.flags = 0
        state.fast = {0: _entry(0)}
        assert not state._post_due(frozen)  # held
        return state

    # (== gap but for the last bit: the hold's end is the clock's reading
    # plus a sum, so `end - now` need not round back to `gap` exactly)
    assert 0 < held(lead + gap)._timeout(20, long_ago) <= gap * (1 + 1e-6)
    assert held(math.inf)._timeout(20, long_ago) == background.BACKOFF_MAX
    # Once the hold is over (nothing waits any more), its end wakes nobody.
    over = held(lead + gap)
    over.fast = {}
    over._post_due(frozen)
    assert over._timeout(20, long_ago) == background.BACKOFF_MAX


def _freeze_loop_clock(monkeypatch):
    """Stops the clocks coordinator.background reads; returns their
    (monotonic, perf_counter) readings."""
    frozen = time.monotonic(), time.perf_counter()
    monkeypatch.setattr(background, "time", types.SimpleNamespace(
        monotonic=lambda: frozen[0], perf_counter=lambda: frozen[1]))
    return frozen


def _entry(device, pset=0, seq=0):
    return types.SimpleNamespace(device=device, key=(pset, "t"), seq=seq)


def _loop(fast, busy, queue=None):
    """What Background._holding_for_device reads: the tensors waiting for a
    cycle, what the last cycle said, and the DeviceHold, which reads how
    long each lane (process set, device) should stay busy (Executor.busy_for;
    a lane not in `busy` is idle)."""
    executor = types.SimpleNamespace(busy_for=lambda lane, now: busy.get(lane, 0.0))
    return types.SimpleNamespace(fast=dict(enumerate(fast)), flags=0,
                                 hold=DeviceHold(queue or TensorQueue(), executor))


def _busy_lane_state(queue):
    """Every GPU lane busy for as long as one can tell."""
    state = _loop([], busy={}, queue=queue)
    state.hold.executor.busy_for = lambda lane, now: math.inf
    return state


def test_a_flush_stops_the_hold_on_the_tensors_pushed_before_it():
    """Once a frontend says no more tensors are coming (TensorQueue.flush),
    the ones pushed before it are not held for the busy lane, until they
    are done: also after a cycle that carried only some of them (another
    rank had not submitted the others yet). Tensors pushed after the flush
    are held again once no earlier one waits."""
    queue = TensorQueue()
    state = _busy_lane_state(queue)
    hold = Background._holding_for_device

    def push(name):
        e = Entry(name, 1, device=0)
        queue.push(e)
        state.fast[name] = e

    push("a")
    queue.drain()
    assert hold(state, 1.0)
    push("b")
    queue.flush()
    assert not hold(state, 1.0)  # flushed, though "b" is not drained yet
    queue.drain()
    del state.fast["a"]  # a cycle carried "a"; "b" still waits for another rank
    push("c")  # the next step's first gradient
    queue.drain()
    assert not hold(state, 1.0)  # "b" still goes at once, "c" with it
    del state.fast["b"]
    assert hold(state, 1.0)


def test_a_submission_starts_the_lanes_next_operation_only_when_nothing_waits():
    """Background.lane_idle, which decides whether a GPU submission records
    its ready event at once: only while no entry of this rank waits for a
    result and the lane of (process set, device) runs nothing."""
    queue = TensorQueue()
    busy = set()
    state = types.SimpleNamespace(queue=queue, executor=types.SimpleNamespace(
        busy=lambda lane: lane in busy))
    idle = Background.lane_idle
    assert idle(state, 0, 0)
    busy.add((0, 0))
    assert not idle(state, 0, 0) and idle(state, 1, 0) and idle(state, 0, 1)
    busy.clear()
    e = Entry("first", 1, device=0)
    queue.push(e)  # a step's first gradient, not yet done
    assert not idle(state, 0, 0) and not idle(state, 1, 0)
    queue.complete(e, result=0)
    assert idle(state, 0, 0)


def test_a_thread_about_to_block_in_wait_calls_on_block_once_and_only_then():
    calls = []
    table = HandleTable(on_block=lambda: calls.append(table.waiting))
    done = Entry("done", 1)
    done.finish(1)
    table.wait(table.add(done))
    assert calls == []  # nothing to wait for: no flush
    pending = [Entry("a", 1), Entry("b", 1)]
    handle = table.add(pending)
    waiter = threading.Thread(target=table.wait, args=(handle,), daemon=True)
    waiter.start()
    _wait_until(lambda: table.waiting == 1)
    for e in pending:
        e.finish(0)
    waiter.join(10)
    assert calls == [0]  # once, before the thread counted itself as waiting


def test_a_flush_wakes_the_background_thread_only_for_new_pushes():
    queue = TensorQueue()
    queue.wakeup.clear()
    queue.flush()
    assert queue.flushed == 0 and not queue.wakeup.wait(0)  # nothing pushed: nothing to let go
    queue.push(Entry("a", 1, device=0))
    queue.wakeup.clear()
    queue.flush(wake=False)
    assert queue.flushed == 1 and not queue.wakeup.wait(0)
    queue.flush()
    assert not queue.wakeup.wait(0)  # "a" was flushed already
    queue.push(Entry("b", 1, device=0))
    queue.wakeup.clear()
    queue.flush()
    assert queue.flushed == 2 and queue.wakeup.wait(0)


def test_a_thread_that_waits_releases_the_hold_on_what_was_pushed():
    """A thread blocked in synchronize submits nothing more until it is
    done: the runtime's handle table flushes the queue then, so the GPU
    tensors pushed so far are not held for the busy lane."""
    queue = TensorQueue()
    table = HandleTable(on_block=queue.flush)
    state = _busy_lane_state(queue)
    hold = Background._holding_for_device
    e = Entry("grad", 1, device=0)
    queue.push(e)
    queue.drain()
    state.fast["grad"] = e
    assert hold(state, 1.0)
    waiter = threading.Thread(target=table.wait, args=(table.add(e),), daemon=True)
    waiter.start()
    _wait_until(lambda: table.waiting == 1)
    assert not hold(state, 1.0)
    e.finish(0)
    waiter.join(10)


class _SetInBetween:
    """Signal's lock, with a set() from another thread landing right after
    wait()'s acquire, before its release: an interpreter switch there (with
    sys.setswitchinterval(1e-4) it killed a simulated training run's
    background thread within a few hundred steps: 'release unlocked
    lock')."""

    def __init__(self, signal):
        self.lock, self.signal = _thread.allocate_lock(), signal
        self.lock.acquire()  # not set

    def acquire(self, blocking=True, timeout=-1):
        got = self.lock.acquire(blocking, timeout)
        if got and blocking:  # wait(), not clear()
            self.signal.set()
        return got

    def release(self):
        self.lock.release()

    def locked(self):
        return self.lock.locked()


def test_a_wake_up_that_lands_inside_wait_is_neither_an_error_nor_lost():
    signal = Signal()
    signal._lock = _SetInBetween(signal)
    signal.set()
    assert signal.wait(1.0)  # no RuntimeError
    assert signal.wait(0)  # still set: the next wait returns at once
    signal.clear()
    assert not signal.wait(0)


def test_wake_ups_from_many_threads_never_break_the_waiter():
    """set() from several threads against wait()/clear() in a loop, with the
    interpreter switching threads every microsecond."""
    signal, stop, errors = Signal(), threading.Event(), []

    def setter():
        while not stop.is_set():
            signal.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=setter, daemon=True) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for _ in range(5000):
            try:
                signal.wait(0.001)
                signal.clear()
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(before)
    assert not errors


def test_the_switch_interval_is_short_only_while_asked_and_put_back():
    """pacing.SwitchInterval: at most the setting while shortened (GPU
    work in flight); the program's own otherwise, unless the program
    changed it meanwhile; left alone when the setting is 0 or no shorter."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(5e-3)
        switch = pacing.SwitchInterval(100e-6)
        switch.shorten(True)
        assert sys.getswitchinterval() == pytest.approx(100e-6) and switch.shortened
        switch.shorten(True)
        switch.shorten(False)
        assert sys.getswitchinterval() == pytest.approx(5e-3) and not switch.shortened
        pacing.SwitchInterval(0).shorten(True)  # 0: untouched
        assert sys.getswitchinterval() == pytest.approx(5e-3)
        sys.setswitchinterval(50e-6)
        pacing.SwitchInterval(100e-6).shorten(True)  # already shorter: untouched
        assert sys.getswitchinterval() == pytest.approx(50e-6)
        sys.setswitchinterval(5e-3)
        switch.shorten(True)
        sys.setswitchinterval(1e-3)  # the program's own choice, made meanwhile
        switch.shorten(False)
        assert sys.getswitchinterval() == pytest.approx(1e-3)
        switch.shorten(True)
        switch.seconds = 200e-6  # changed while in force: the next call applies it
        switch.shorten(True)
        assert sys.getswitchinterval() == pytest.approx(200e-6)
        switch.seconds = 0  # 0 while in force: the program's own again
        switch.shorten(True)
        assert sys.getswitchinterval() == pytest.approx(1e-3) and not switch.shortened
    finally:
        sys.setswitchinterval(before)


class _Watched(types.SimpleNamespace):
    """A stand-in for the background thread's state that records what a
    frontend thread would read (Runtime.check_running) at the moment
    `stopping` turns true."""

    def __setattr__(self, name, value):
        if name == "stopping" and value:
            self.__dict__["seen"] = (self.__dict__.get("final_reason"),
                                     self.__dict__.get("_final_finished"))
        super().__setattr__(name, value)


def test_the_reason_of_a_shutdown_is_there_as_soon_as_stopping_says_so():
    """A thread waiting outside the coordinator reads `final_reason` once it
    sees `stopping`: set in the other order, it read None, and a peer's
    exception was reported as "shutdown() was called" (ChainerMN's recv_obj,
    test_chainer_mpi.py, about 1 run in 7)."""
    state = _Watched(
        final_reason=None, _final_finished=False, stopping=False, round=None, _answered=0,
        sent={}, _riding={},
        executor=types.SimpleNamespace(in_flight=lambda: []),
        queue=types.SimpleNamespace(close_and_fail=lambda *a, **k: None),
        channel=types.SimpleNamespace(barrier=lambda: None))
    Background._begin_final(state, "rank 1 is exiting after an uncaught ValueError",
                            finished=True)
    reason, finished = state.seen
    assert reason is not None and reason.startswith("rank 1 is exiting"), reason
    assert finished is True
    assert state.final_reason == reason and state._final is not None
