"""Pacing GPU work from the host: when the background thread lets a GPU
lane's next operation go, and how soon it gets the interpreter lock back
while GPU work is in flight.

- `DeviceHold`: a rank holds its next negotiation cycle back while its GPU
  lane is still busy, so the gradients that arrive meanwhile join one
  larger NCCL call; it lets go just before the lane should be free.
- `SwitchInterval`: the interpreter's switch interval is short while GPU
  work is in flight, so the frontends' gradient hooks get the lock soon.

Both only change when this rank does something, never what the ranks
decide: the cycle decides the same on every rank.
"""

import math
import sys

# The longest a rank holds its next cycle back while its GPU lane is busy,
# and how long before the lane's work should end it stops holding
# (DeviceHold.holding).
DEVICE_HOLD_MAX = 1.0
DEVICE_HOLD_LEAD = 2e-3


class DeviceHold:
    """Whether to hold the next cycle back for this rank's GPU lanes of the
    global set (the background thread asks before it posts one)."""

    __slots__ = ("queue", "executor", "since", "until")

    def __init__(self, queue, executor):
        self.queue = queue  # TensorQueue: what a frontend flushed
        self.executor = executor  # Executor: how long each lane stays busy
        self.since = None  # when this rank began holding
        self.until = None  # when that hold should end (the loop wakes then)

    def holding(self, waiting, now):
        """Whether to hold the next cycle back: every tensor `waiting` for
        one is a GPU tensor of the global set, and this rank's GPU lane is
        still running an operation. Its next operation could not start
        before that one ends anyway, and gradients that arrive meanwhile
        join it: one larger NCCL call instead of several small ones, each of
        which pays NCCL's latency (4.5 ms over sockets). Not for the last
        DEVICE_HOLD_LEAD seconds the lane should be busy (Executor.busy_for,
        from how long its past operations took on the device): negotiating
        and queueing the next operation takes the host about that long, so
        it then starts on the device as the running one ends, instead of
        that long after. The loop sleeps no longer than until then
        (`until`), where it would otherwise notice the moment only at its
        next look, up to the back-off's longest sleep late. Not once a
        frontend said no more are coming (TensorQueue.flush: the last
        gradient of a step): then the next operation is negotiated at once
        and queues its work behind the running one (executor.py), instead of
        starting only after the host has seen that one end. Nor once a
        thread waits for a result (HandleTable.wait flushes): it submits
        nothing more until then. With nothing waiting, nothing is held."""
        flushed, devices = self.queue.flushed, set()
        for e in waiting:
            if e.seq < flushed or e.device < 0 or e.key[0] != 0:
                return self._let_go()
            devices.add(e.device)
        if not devices:
            return self._let_go()
        until = math.inf
        for device in devices:
            left = self.executor.busy_for((0, device), now)
            if left <= DEVICE_HOLD_LEAD:
                return self._let_go()
            until = min(until, now + left - DEVICE_HOLD_LEAD)
        if self.since is None:
            self.since = now
        self.until = min(until, self.since + DEVICE_HOLD_MAX)
        return now < self.until

    def _let_go(self):
        self.since = self.until = None
        return False


class SwitchInterval:
    """Keeps the interpreter's switch interval at most `seconds` while GPU
    work is in flight (0: never touches it), and puts the program's own back
    otherwise, unless the program changed it meanwhile.

    A thread that wants the interpreter lock while another runs Python gets
    it when that one blocks, or after the switch interval (5 ms by default):
    a lock let go for a moment (a CUDA call) goes back to the thread that
    let it go, before the waiting one has woken. So while this thread polls
    a GPU operation, a gradient hook, which needs the lock between
    autograd's C++ calls, waited up to the whole interval: on the simulated
    GPU (np=2) a ResNet-18 step's 62 submissions spread over 30-45 ms of host
    time where the DDP-style reducer's hooks took 4, and 100 us made the
    step 1.10-1.11x the DDP-style one instead of 1.20-1.21x (ResNet-50 1.03x
    instead of 1.19-1.26x). Only while GPU work is in flight: a loop that
    submits tensors back to back, which the CPU benchmark (b) and the GPU
    one (B) are, gets the lock taken from it mid-loop, so its tensors go in
    more, smaller operations (the CPU's (b) 1.05-1.10x to 1.21x, the
    simulated (B) 1.16x to 1.22x, with it shortened all the time)."""

    __slots__ = ("seconds", "_applied", "_before", "_ours")

    def __init__(self, seconds):
        self.seconds = seconds  # (read at each call: may be changed meanwhile)
        self._applied = None  # the setting in force, while ours is
        self._before = None  # the program's interval then
        self._ours = None  # ours, as the interpreter keeps it (whole microseconds)

    @property
    def shortened(self):
        return self._applied is not None

    def shorten(self, on):
        want = self.seconds if on and self.seconds else None
        if want == self._applied:
            return
        if self._applied is not None:
            if sys.getswitchinterval() == self._ours:
                sys.setswitchinterval(self._before)
            self._applied = None
        if want is not None:
            before = sys.getswitchinterval()
            if want < before:
                sys.setswitchinterval(want)
                self._applied, self._before, self._ours = want, before, sys.getswitchinterval()
