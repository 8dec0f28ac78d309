"""The one background thread of a process.

Each turn of its loop it
1. takes what the frontends submitted: in the global set, a tensor the
   response cache knows waits for the next negotiation cycle and any other
   for the next round; a tensor of another process set is described to rank
   0 at once; a tensor whose operation already failed before this rank
   submitted it (it owes it) fails at once;
2. drives the negotiation (negotiation.py): posts and tests the cycle, runs
   what it says is ready everywhere, and takes part in rounds (rank 0 runs
   the `Controller` over every rank's requests and answers each); other
   sets' requests and answers stream between the ranks and rank 0 as they
   come, since their ranks alone take part;
3. drives the operations in flight (executor.py) and completes the
   frontends' handles as they finish: a collective in flight never blocks
   the loop, so stall checks, the watchdog and liveness keep running.

It is event-driven: a submission wakes it at once. While this rank has work
in flight it polls with a short back-off; with nothing in flight it sleeps,
waking only every `idle_poll_interval` for control messages, stalls and dead
peers. It is handed its collaborators (`Collaborators`), not the runtime.
"""

import collections
import ctypes
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

from coordinator import dtypes, gpu
from coordinator.control_channel import (TAG_REQUEST, TAG_RESPONSE, TAG_ROUND,
                                         TAG_ROUND_RESPONSE, peer_failure)
from coordinator.controller import CACHEABLE, Controller
from coordinator.errors import (FINISHED_MARK, DeadlockError, HorovodInternalError,
                                InvalidOperationError, RankFailedError, ShutdownError,
                                StallError, TensorMismatchError)
from coordinator.executor import Executor, Operation
from coordinator.fusion import copy_scaled
from coordinator.liveness import describe_dead
from coordinator.negotiation import (FLAG_CLASSIC, FLAG_FRESH, FLAG_PENDING, FLAG_REPORT,
                                     SlotTable, complete_groups, plan_ready)
from coordinator.ops_names import describe, display_name, format_ranks, op_name
from coordinator.owed import Owed, due_now
from coordinator.pacing import DeviceHold, SwitchInterval
from coordinator.response_cache import WorkerCache
from coordinator.stall_inspector import StallInspector
from coordinator.tensor_queue import Entry
from coordinator.watchdog import CoordinatorWatch, Heartbeat, Watchdog, watch_times
from coordinator.wire import pb

log = logging.getLogger("coordinator")

ERROR_TYPES = {
    pb.MISMATCH: TensorMismatchError,
    pb.STALL: StallError,
    pb.DEADLOCK: DeadlockError,
    pb.INVALID: InvalidOperationError,
    pb.INTERNAL: HorovodInternalError,
    pb.BROKEN: HorovodInternalError,
    pb.SILENT: StallError,
}
# Shutdowns that fail every rank at once with the reason as the error.
FATAL_KINDS = (pb.STALL, pb.BROKEN, pb.SILENT)
# Rank 0's heartbeat to a worker, and its answer (watchdog.Heartbeat).
HEARTBEAT = pb.ResponseList(heartbeat=True).SerializeToString()
ALIVE = pb.RequestList(alive=True).SerializeToString()

# Seconds shutdown() waits for every rank to confirm.
SHUTDOWN_TIMEOUT = 30.0

# While work is in flight: poll without sleeping for SPIN_TIME seconds after
# the last progress, plus SPIN_PER_TENSOR for each tensor in flight, then
# sleep, doubling from BACKOFF_MIN up to BACKOFF_MAX seconds. While a
# frontend thread is blocked waiting for a result, the process has nothing
# else to run: poll for up to SPIN_WAITED seconds instead, yielding the CPU
# between polls, because a sleeping thread answers a peer only when its
# sleep ends. Only where every rank on this machine has a CPU of its own:
# oversubscribed, the polling would take the CPU from a rank still computing.
SPIN_TIME = 200e-6
SPIN_PER_TENSOR = 10e-6
SPIN_WAITED = 10e-3
BACKOFF_MIN = 20e-6
BACKOFF_MAX = 500e-6
LIVENESS_PERIOD = 0.1
# How often the control channel is probed while nothing streamed is expected.
CONTROL_POLL = 500e-6
# A worker rank 0 asked to post a cycle for another set's GPU plans
# (ResponseList.cycle) looks for the next such request at least this often
# while idle, for WAKE_HOLD seconds after it: each waits for every rank, and
# an idle rank's 50 ms poll (COORDINATOR_IDLE_POLL_SECONDS) made every such
# operation take 52 ms (median, fake GPU, np=3: tests/scripts/set_latency.py).
WAKE_POLL = 1e-3
WAKE_HOLD = 2.0
# Once every rank is shutting down, how long operations in flight get.
FINAL_GRACE = 1.0
# How a negotiation cycle or round in flight is named to the watchdog.
NEGOTIATION = "(a negotiation cycle)"
# A cycle that moved nothing, with nothing new anywhere, is followed by the
# next after CYCLE_BACKOFF_MIN seconds, doubling up to CYCLE_BACKOFF_MAX: the
# ranks wait for each other without a busy loop of collectives.
CYCLE_BACKOFF_MIN = 20e-6
CYCLE_BACKOFF_MAX = 500e-6
# How long a rank polls nothing but the cycle it has just posted (see
# _await_cycle).
CYCLE_AWAIT = 20e-6
# While rank 0 holds in a round a cached tensor that other ranks may hold in
# the cycle, it asks for a report at most this often (see _post).
CYCLE_REPORT_GAP = 5e-3
# Cycle plans kept (Background._plan): a step's few sets of ready tensors.
PLANS_KEPT = 64


# How riders (tensors carried in the cycle) show on a timeline.
_RIDERS = pb.Response(op=pb.ALLREDUCE)


def _plans_of(planned):
    """Plans for the autotuner, which measures bytes per second by plan."""
    from coordinator.controller import Plan

    return [Plan(resp, (), sum(e.tensor.nbytes for e in group), list(resp.names))
            for resp, group in planned]


def _cpus():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def waited_spin_budget(colocated, cpus):
    """How long (seconds) to poll while a frontend thread waits: SPIN_WAITED
    when the `colocated` ranks of this machine each have one of its `cpus`,
    else 0 (back off at once, as without a waiter)."""
    return SPIN_WAITED if colocated <= cpus else 0.0


def _tighten_timer_slack():
    """Let short sleeps of this thread be short (Linux rounds them up by the
    thread's timer slack, 50 us by default)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass


@dataclasses.dataclass
class Collaborators:
    """What the background thread works with (runtime.py builds them)."""

    config: Any
    rank: int
    size: int
    queue: Any  # TensorQueue
    handles: Any  # HandleTable: how many frontend threads wait
    ops: Any  # OperationManager
    channel: Any  # ControlChannel: the control plane's messages
    cycle: Any  # control_channel.Cycle: the negotiation cycle
    timeline: Any
    colocated: int  # ranks sharing this machine's CPUs
    local_rank: int  # this rank's place on its host (HOROVOD_THREAD_AFFINITY)
    initial_process_sets: Mapping[int, tuple]
    members: Callable[[int], Any]  # process set id -> its global ranks
    set_rank_of: Callable[[int, int], int]  # (set, global rank) -> rank in the set
    apply_process_set_change: Callable[[Any], Any]  # runs an add/remove response
    # A removed set's communicators are freed (once its operations are done).
    release_process_set: Callable[[int], None]
    fatal: Callable[[BaseException], None]  # the job cannot go on
    check_dead: Callable[[], list]  # peers found dead since the last call
    # A rank stopped answering: releases the program's own MPI calls
    # waiting on it (Runtime._release_program_comms).
    release: Callable[[], None]


def _address(plans, resends, outgoing):
    """Puts each plan's response in the ResponseList of each rank it goes to
    (`outgoing[rank]`), and the cache ids rank 0 wants described again in
    their rank's; returns `outgoing`."""
    for plan in plans:
        for rank in plan.recipients:
            outgoing[rank].responses.append(plan.response)
    for rank, ids in resends.items():
        outgoing[rank].resend.extend(ids)
    return outgoing


def _whole_groups(taken):
    """(entry, cycle slot or None) for entries taken together, but no slot
    for any member of a group one of whose members has none: a group waits
    in the cycle whole or not at all. (Split, the cycle would run none of
    its members, as they never all set their bits, and the round none
    either, as it never hears of the others: a group of more tensors than
    the cache holds, or whose members' ids a round both handed out and
    evicted.) A group's members are always taken together (TensorQueue)."""
    split = {(e.key[0], e.group) for e, slot in taken if e.group and slot is None}
    if not split:
        return taken
    return [(e, None if e.group and (e.key[0], e.group) in split else slot)
            for e, slot in taken]


def _copy_of(e, keys):
    """Whether entry `e` is a copy of a tensor, or a member of a group, whose
    key ((set, name) or (set, group)) is in `keys`."""
    return e.key in keys or bool(e.group) and (e.key[0], e.group) in keys


def _pair(resp):
    """A send/recv's two ranks (global, in order), else ()."""
    return tuple(sorted(resp.ranks)) if resp.op == pb.P2P else ()


class Background:
    def __init__(self, parts: Collaborators):
        self.parts = parts
        self.config = cfg = parts.config
        self.rank = parts.rank
        self.size = parts.size
        self.queue = parts.queue
        self.handles = parts.handles
        self.ops = parts.ops
        self.timeline = parts.timeline
        self.channel = parts.channel
        self.cycle = parts.cycle
        # (its GPU operations are handed out once queued, for the entries
        # that take their results in stream order: _complete_queued)
        self.executor = Executor()
        # Removed process sets whose operations were still in flight on this
        # rank: id -> the set's members, until those finish and the set's
        # communicators are freed (_release_drained).
        self._draining = {}
        # Operations started per lane, on every member alike (the watchdog
        # compares them: watchdog.py).
        self.lane_counts = {}
        self.is_coordinator = self.rank == 0
        self.cache = WorkerCache()
        self.cache_enabled = cfg.cache_capacity > 0
        self.slots = SlotTable(cfg.cache_capacity, cfg.cycle_payload_bytes // 8)
        self.spin_waited = waited_spin_budget(parts.colocated, _cpus())
        # Negotiation state (negotiation.py).
        self.fast = {}  # slot -> entry waiting for a cycle
        self._riding = {}  # slot -> entry whose data the cycle in flight carries
        self.hold = DeviceHold(self.queue, self.executor)  # pacing.py
        # (public: compare_ddp.py runs ours at other intervals through it)
        self.switch_interval = SwitchInterval(cfg.switch_interval)
        self.classic = []  # global-set entries to describe in the next round
        self.stream = []  # other sets' entries to describe to rank 0 now
        self.sent = {}  # key -> entry described in a round, not answered yet
        self.sent_by_id = {}  # cache id -> entry sent as that id
        self.owed = Owed()  # failed before this rank submitted its copy (owed.py)
        self._gpu = None  # the GPU this rank's device operations last ran on
        self.round = None  # the round under way: (number, {rank: RequestList} on rank 0)
        self.rounds = 0
        self.cycles = 0  # cycles posted (every rank posts the same ones)
        self._woken_cycle = 0  # rank 0: the last cycle it asked everyone to post
        self._woken_until = 0.0  # a worker: when to poll at the idle pace again (WAKE_HOLD)
        self.flags = 0  # what the last cycle said
        self._more = False  # whether it said that someone still waits
        self._completed = False  # whether this turn completed an entry
        # Held by whichever thread runs a turn: this one, or a frontend
        # thread driving the loop (drive).
        self._driver = threading.Lock()
        self._driver_error = None  # raised by this thread: a driven turn's
        # Set when a driver left work to this thread: when its turns last
        # moved anything (0.0: never).
        self._handover = None
        self._fresh = False  # submitted since the last cycle was posted
        self._woken = False  # asked to post a cycle (a ping, a report)
        self._join_to_post = False  # a join waits for its first cycle
        # So does an add_process_set by the new set's own ranks (the others
        # take no part in it, and may not post: _wake_everyone).
        self._add_to_post = False
        self._next_post = 0.0
        # HOROVOD_CYCLE_TIME: cycles start at least this far apart, so more
        # tensors gather for each (0: as soon as there is work).
        self._cycle_gap = self.config.cycle_time_ms / 1000.0
        self._gap_until = 0.0
        self._cycle_backoff = 0.0
        self._next_cycle_report = 0.0
        # A tensor waiting in a cycle's slots for this long is described to
        # rank 0 in full (a report), where the stall inspector sees it: in
        # time for the stall warning, and for the deadlock check, which
        # must see every open submission of a rank blocked for the deadlock
        # time (one missing could be what frees that rank).
        self._report_after = min(
            cfg.stall_check_time / 2 if cfg.stall_check_time > 0 and not cfg.stall_check_disable
            else float("inf"),
            cfg.deadlock_time / 2 if cfg.deadlock_time > 0 else float("inf"))
        # What every rank plans cycles with; rank 0 sets them, rounds carry them.
        self.params = {"fast": self.cache_enabled, "fusion_threshold": cfg.fusion_threshold,
                       "pack_limit": cfg.pack_limit}
        self._plans = {}  # cache ids ready (and devices), params -> [(response, members)]
        self.resend = []  # entries rank 0 asked to have in full
        # This rank's refusals in the global set that rank 0 has not answered
        # yet: key (a tensor's, or a group's) -> the first round that can
        # carry it (see _behind_refusal).
        self._refusing = {}
        self._round_started = None
        self._next_control = 0.0
        self._streamed = 0  # this rank's streamed entries not answered yet
        self._streams_sent = 0  # stream lists this rank sent (RequestList.streamed)
        self._streams_heard = [0] * self.size  # rank 0: stream lists each rank's reached it
        self._answered = 0  # rank 0: rounds answered; a worker: what rank 0 said it answered
        self.controller = None
        self.watchdog = None
        self.watch = None
        if self.is_coordinator:
            inspector = StallInspector(cfg.stall_check_time, cfg.stall_shutdown_time,
                                       cfg.stall_check_disable, cfg.deadlock_time)
            self.controller = Controller(
                self.size, fusion_threshold=cfg.fusion_threshold,
                cache_capacity=cfg.cache_capacity, stall_inspector=inspector,
                timeline=self.timeline,
                cycle_time=cfg.cycle_time_ms / 1000.0, pack_limit=cfg.pack_limit)
            for pid, ranks in parts.initial_process_sets.items():
                self.controller.register_process_set(pid, ranks)
            self._evict_seq = [0] * self.size
            self.watchdog = Watchdog(0, cfg.stall_check_time, cfg.stall_shutdown_time,
                                     cfg.stall_check_disable, silence=cfg.silent_rank_time,
                                     deadlock=cfg.deadlock_time)
        else:
            self.watch = CoordinatorWatch(cfg.stall_check_time, cfg.stall_shutdown_time,
                                          cfg.stall_check_disable, silence=cfg.silent_rank_time,
                                          deadlock=cfg.deadlock_time)
        self.heartbeat = Heartbeat(
            self.rank, self.size, cfg.silent_rank_time,
            watch_times(cfg.stall_check_time, 0.0, cfg.stall_check_disable)[0])
        self.autotuner = None
        if self.is_coordinator and self.config.autotune:
            from coordinator.autotune import Autotuner

            self.autotuner = Autotuner(self.controller, self.config.autotune_log,
                                       steps_per_sample=self.config.autotune_steps_per_sample,
                                       warmup_samples=self.config.autotune_warmup_samples,
                                       fixed=self.config.autotune_fixed)
        self._shutdown_wanted = False
        self._shutdown_why = ""
        self._shutdown_finished = False
        self._shutdown_sent = False
        self._shutdown_asked_at = None
        self._final = None  # (Ibarrier request, deadline, reason) once shutting down
        self.final_reason = None  # why the coordinator shut down, once it does
        self._final_finished = False  # ... asked by a rank whose program is done
        self._final_grace = None  # once every rank is shutting down: when to give up
        # Whether the shutdown ended without every rank confirming it: MPI_Finalize
        # will wait for those that did not (runtime._finalize_mpi).
        self.unconfirmed_shutdown = False
        self.stopping = False  # shutting down: no new work is taken
        self.finished = False
        self._next_liveness = 0.0
        self._next_stall_check = 0.0
        self._next_watch = 0.0
        self._pinged = False  # rank 0 asked for a report
        self.stats = {"cached_requests": 0, "full_requests": 0, "responses": 0,
                      "cycle_runs": 0, "riders": 0}
        self.thread = threading.Thread(target=self._main, name="coordinator-background",
                                       daemon=True)

    # ------------------------------------------------------------ control
    def start(self):
        self.thread.start()

    def request_shutdown(self, why="", finished=False):
        """`finished`: this rank's program is done (runtime.stop)."""
        self._shutdown_why = why
        self._shutdown_finished = finished
        self._shutdown_wanted = True
        self.queue.wakeup.set()

    # --------------------------------------------------------------- loop
    def _main(self):
        _tighten_timer_slack()
        self._pin()
        try:
            self._loop()
        except BaseException as exc:  # the thread must never die silently
            lost = self._lost_peers(exc)
            if lost is not None:  # ULFM: a peer failed; no traceback needed
                self.executor.abandon()
                self.parts.fatal(RankFailedError(
                    f"rank {self.rank}: {lost}; collective operations that involve it can "
                    "never complete"))
                return
            log.exception("coordinator background thread failed")
            text = f"rank {self.rank}: the coordinator's background thread failed: {exc!r}"
            self._tell_as_thread_dies(text)
            self.parts.fatal(HorovodInternalError(text))
        finally:
            self.finished = True
            self.switch_interval.shorten(False)
            # Nothing may wait for a thread that is gone.
            self.queue.fail_remaining(lambda e: ShutdownError(
                f"{e.describe()}: the coordinator stopped before it completed"))

    def _lost_peers(self, exc):
        """Where `exc` is MPI saying that a peer failed (ULFM), a sentence
        naming the ranks that did (control_channel.peer_failure), else None."""
        return peer_failure(exc, self.channel.comm,
                            lambda: [dead.rank for dead in self.parts.check_dead()])

    def _pin(self):
        """HOROVOD_THREAD_AFFINITY: this thread runs on the core listed for
        its local rank (the list wraps around), as Horovod's background
        thread does. A core this process may not use is a warning, not an
        error: the thread then runs where it would have."""
        cores = self.config.thread_affinity
        if not cores:
            return
        core = cores[self.parts.local_rank % len(cores)]
        try:
            os.sched_setaffinity(0, {core})  # 0: the calling thread (Linux)
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("HOROVOD_THREAD_AFFINITY: cannot pin the background thread of local "
                        "rank %d to core %d (%s); it stays unpinned",
                        self.parts.local_rank, core, exc)

    def _loop(self):
        sleeps = 0
        last_progress = time.perf_counter()
        wakeup = self.queue.wakeup
        driver = self._driver
        while not self.finished:
            with driver:
                if self._driver_error is not None:
                    raise self._driver_error
                wakeup.clear()
                worked = self._turn()
                if worked or self._handover is not None:
                    # (operations start and end only in a turn that works, or
                    # in one a frontend thread drove: an idle turn skips this)
                    self.switch_interval.shorten(self.executor.on_device())
                if self._handover is not None:
                    # A frontend thread drove the loop and left work to this
                    # one: poll as after progress of its own, not backing off.
                    sleeps = 0
                    last_progress = max(last_progress, self._handover)
                    self._handover = None
                if worked:
                    sleeps = 0
                    last_progress = time.perf_counter()
                    if not self._settled():
                        continue
                if self.finished:
                    break
                timeout = self._timeout(sleeps, last_progress)
            if timeout is None:
                continue
            sleeps += 1
            wakeup.wait(timeout)

    def drive(self, entries):
        """Runs the loop's turns on the calling thread, a frontend thread
        about to wait for `entries` (submitted without waking this thread:
        tensor_queue.quiet_pushes), while the background thread sleeps: for
        up to `drive_seconds`, or until they are done. Then, or if the
        background thread is running a turn, it wakes the background thread
        when anything is left to do. True when `entries` are done.

        Each hand-off between threads costs a wake-up and the interpreter
        lock (7 us to take a submission, 17 us to hand back a result at np=2
        on 2 cores): a one-float allreduce took 57 us with them, 31 us
        driven. An error in a driven turn is the background thread's: it
        raises it at its next turn, as if it had happened there.

        The thread is about to wait, so it submits nothing more until then:
        what it pushed is not held back for a fuller fusion (a flush)."""
        self.queue.flush(wake=False)
        if (self.finished or self._final is not None or self._shutdown_wanted
                or self._driver_error is not None):
            self.queue.wakeup.set()
            return False
        if not self._driver.acquire(blocking=False):
            self.queue.wakeup.set()  # the background thread is in a turn
            return False
        progress = 0.0
        try:
            end = time.perf_counter() + self.config.drive_seconds
            while True:
                if self._turn():
                    progress = time.perf_counter()
                if self.finished or all(e.done for e in entries):
                    break
                if time.perf_counter() >= end:
                    break
        except Exception as exc:
            self._driver_error = exc
        except BaseException as exc:  # KeyboardInterrupt: the turn stopped half way
            self._driver_error = HorovodInternalError(
                f"rank {self.rank}: the coordinator's loop was interrupted ({exc!r}) while a "
                "frontend thread ran it; its state is unknown, so the coordinator stops")
            raise
        finally:
            left = self._driver_error is not None or self.finished or not self._idle()
            if left:
                self._handover = progress
            self._driver.release()
            if left:
                self.queue.wakeup.set()
        return all(e.done for e in entries)

    def _settled(self):
        """After a turn that completed entries: whether nothing is in flight
        or due, so the thread may sleep at once instead of taking one more
        turn first. The threads it woke need this core and the interpreter
        lock, and get neither while it runs (about 3 us of the 60 us of a
        one-float allreduce at np=2)."""
        completed, self._completed = self._completed, False
        return completed and self._idle()

    def _idle(self):
        """Nothing in flight, and no cycle due."""
        return not self._busy() and not self._post_due(time.monotonic())

    def _busy(self):
        return bool(self.queue.inflight_count() or self.executor or self._negotiating())

    def _negotiating(self):
        """Busy with the control plane: a cycle or round in flight, the final
        exchange, a shutdown to send, or peers still waiting on cycles."""
        return bool(self.cycle.in_flight or self.round is not None or self._final is not None
                    or self._shutdown_wanted or self._more)

    def _timeout(self, sleeps, last_progress):
        inflight = self.queue.inflight_count()
        if self._busy() or self.channel.progress():
            spent = time.perf_counter() - last_progress
            if spent < SPIN_TIME + SPIN_PER_TENSOR * inflight:
                return None
            if inflight and spent < self.spin_waited and self.handles.waiting:
                os.sched_yield()
                return None
            timeout = min(BACKOFF_MIN * (1 << min(sleeps, 16)), BACKOFF_MAX)
        else:
            timeout = self.config.idle_poll_interval
            if self._woken_until and time.monotonic() < self._woken_until:
                timeout = min(timeout, WAKE_POLL)
        if not self.cycle.in_flight and self.round is None:
            now = time.monotonic()
            # (hold.until is set where _post_due asked _holding_for_device,
            # which it does not ask once nothing waits: then it is stale)
            hold = (self.hold.until or 0.0) if self.fast else 0.0
            for until in (self._next_post, self._gap_until, hold):
                if until > now:  # the next cycle waits out its back-off, gap or hold
                    timeout = min(timeout, until - now)
        return timeout

    def _turn(self):
        worked = False
        entries = self.queue.drain()
        if entries:
            self._take(entries)
            worked = True
            if self.timeline.enabled:
                self.timeline.mark_cycle()
        if self._final is not None:
            return self._final_turn() or worked
        worked |= self._control()
        if not self.finished:
            worked |= self._negotiate()
        if self.executor and not self.finished:
            worked |= self._progress()
        self.channel.progress()
        now = time.monotonic()
        if now >= self._next_liveness and not self.finished:
            self._next_liveness = now + LIVENESS_PERIOD
            self._check_liveness()
        if now >= self._next_watch and not self.finished:
            worked |= self._watch(now)
        return worked

    # ------------------------------------------------------------- intake
    def _take(self, entries):
        """Sorts submitted entries: owed ones fail, cached ones wait for the
        cycle, the rest for the next round."""
        now = time.monotonic()
        paid_groups = {}
        owing = bool(self.owed)
        taken = []
        for e in entries:
            notice = self.owed.pay(e, paid_groups) if owing else None
            if notice is not None:  # its operation failed before it was submitted
                self._fail_owed(e, notice)
                continue
            if not e.in_rounds:
                self.stream.append(e)
                continue
            if e.rejected:
                self._refusing[e.key] = self.rounds
            elif e.op == pb.JOIN:
                self._join_to_post = True
            elif e.op == pb.ADD_PROCESS_SET and e.among_members:
                self._add_to_post = True
            taken.append((e, self._slot_for(e)))
        if self._join_to_post:  # (what comes with a join goes to its round: _before_join)
            taken = [(e, None) for e, _ in taken]
        for e, slot in _whole_groups(taken):
            if slot is not None:
                self.fast[slot] = e
                self.cycle.set(slot)
                e.since = now
            else:
                self.classic.append(e)
            self._fresh = True

    def _behind_refusal(self, e):
        """Whether `e` follows a refusal of its tensor (or group) by this
        rank that rank 0 has not answered yet. The refusal goes to a round;
        the caller had its error at once and may submit the next step of
        the same name, which must follow it there. Set in the cycle, it
        could meet the other ranks' copies of the refused step, which wait
        in the cycle until that round fails them, and every rank's Nth
        submission would run with another's (N+1)th."""
        return _copy_of(e, self._refusing)

    def _fail_owed(self, e, resp):
        kind = ERROR_TYPES.get(resp.error_kind, HorovodInternalError)
        self.queue.complete(e, error=kind(resp.error))

    def _slot_for(self, e):
        """The cycle slot of a cached global-set entry, whose cache id it
        records, or None (it waits for a round)."""
        if not self.params["fast"] or e.rejected or e.op not in CACHEABLE or e.key[0] != 0:
            return None
        if self._refusing and self._behind_refusal(e):
            return None
        cache_id = self.cache.lookup(e.key, e.signature())
        slot = self.slots.slot(cache_id) if cache_id else None
        if slot is not None:
            e.cache_id = cache_id
        return slot

    # --------------------------------------------------------- negotiation
    def _negotiate(self):
        if self.round is not None:
            return self._round_turn()
        if self.cycle.in_flight:
            result = self.cycle.test()
            if result is None:
                return self.cycle.moved  # the bits are in; the payload follows
            return self._cycle_done(*result)
        now = time.monotonic()
        if self._post_due(now):
            self._post(now)
            self._await_cycle()
            return True
        return False

    def _await_cycle(self):
        """Polls only the cycle just posted, for up to CYCLE_AWAIT seconds:
        the other ranks usually post at about the same time, and a whole
        turn between two polls (about 3 us of Python) would come between
        their arrival and this rank noticing it."""
        end = time.perf_counter() + CYCLE_AWAIT
        while time.perf_counter() < end:
            result = self.cycle.test()
            if result is not None:
                self._cycle_done(*result)
                return

    def _pending(self):
        """Waiting on something the global set's negotiation will decide."""
        if self.fast or self.classic or self.sent:
            return True
        return self.is_coordinator and self.controller.has_global_pending()

    def _pending_beyond_cycle(self):
        """Waiting on something a cycle's slots do not show: a round's
        answer, or (rank 0) requests the controller holds."""
        if self.classic or self.sent:
            return True
        return self.is_coordinator and self.controller.has_global_pending()

    def _post_due(self, now):
        if self._woken or self.classic or self.resend:
            return True
        if self.is_coordinator and (self.controller.has_global_output()
                                    or self._params_changed()):
            return True
        if self._fresh:
            return now >= self._gap_until and not self._holding_for_device(now)
        if self.flags & (FLAG_CLASSIC | FLAG_REPORT) or self._more or self._pending():
            return (now >= max(self._next_post, self._gap_until)
                    and not self._holding_for_device(now))
        return False

    def lane_idle(self, process_set_id, device):
        """Whether a submission to the lane of (process set, device) now would
        start its next operation: nothing submitted on this rank waits for a
        result, and the lane has nothing in flight (read by submitting
        threads, before they push: a hint, not a promise)."""
        return (self.queue.inflight_count() == 0
                and not self.executor.busy((process_set_id, device)))

    def _holding_for_device(self, now):
        """Whether to hold the next cycle back for the GPU lane
        (DeviceHold.holding), never once a round was asked for. Only when
        this rank posts depends on it; what the cycle decides is the same on
        every rank."""
        asked = self.flags & (FLAG_CLASSIC | FLAG_REPORT)
        return self.hold.holding(() if asked else self.fast.values(), now)

    def _post(self, now):
        flags = 0
        if self._fresh:
            flags |= FLAG_FRESH
        if self.classic or any(e.in_rounds for e in self.resend) or (
                self.is_coordinator and (self.controller.has_global_output()
                                         or self._params_changed())):
            flags |= FLAG_CLASSIC
        if self._pending_beyond_cycle():
            flags |= FLAG_PENDING
        if self.fast and any(now - e.since >= self._report_after and not e.reported
                             for e in self.fast.values()):
            flags |= FLAG_REPORT
        if (self.is_coordinator and self.params["fast"] and now >= self._next_cycle_report
                and self.controller.waits_on_cycles()):
            # Some ranks may hold in the cycle what the others described in
            # a round (Controller.waits_on_cycles): a report brings them
            # together, at most every CYCLE_REPORT_GAP seconds.
            flags |= FLAG_REPORT
            self._next_cycle_report = now + CYCLE_REPORT_GAP
        self._fresh = False
        self._woken = False
        self._gap_until = now + self._cycle_gap
        self._load_riders()
        self.cycle.post(flags, now, self.slots.digest)
        self.cycles += 1
        if (self._join_to_post or self._add_to_post) and flags & FLAG_CLASSIC:
            self._join_to_post = self._add_to_post = False
            self._wake_everyone()
        if self.is_coordinator:
            self._wake_for_device_plans()

    def _wake_everyone(self):
        """Every rank into the cycle just posted, which carries this rank's
        join, or its add of a set of its own ranks, to its round. The others
        post only for global-set work of their own, and they may be waiting
        on other sets' operations alone, which need no cycle, while one of
        those needs this join (a joined member takes part with zeros), or
        wait for nothing: without it they would post only at a watchdog
        ping (never, with stall checks off). Rank 0 asks them itself; a
        worker asks rank 0."""
        if self.is_coordinator:
            self._ask_everyone_into(self.cycles)
        else:
            self.channel.send(0, TAG_REQUEST,
                              pb.RequestList(cycle=self.cycles).SerializeToString())

    def _ask_everyone_into(self, cycle):
        """Rank 0: every worker (and this rank) posts `cycle`, once."""
        if cycle <= self._woken_cycle:
            return
        self._woken_cycle = cycle
        if cycle > self.cycles:
            self._woken = True
        payload = pb.ResponseList(cycle=cycle).SerializeToString()
        for rank in range(1, self.size):
            self.channel.send(rank, TAG_RESPONSE, payload)

    def _wake_for_device_plans(self):
        """Rank 0, holding another set's GPU plans for a round (or a cycle
        away from them): every rank takes part in the cycle in flight, and
        so in the round it leads to, those outside the set (idle, they
        would not post) as well as its members (their requests streamed,
        they wait for no round). Once per cycle; asked as a cycle is posted
        and as streamed requests arrive, the only ways such plans meet a
        cycle in flight."""
        if (not self.cycle.in_flight or self._woken_cycle >= self.cycles
                or not self.controller.has_device_stream_output()):
            return
        self._ask_everyone_into(self.cycles)

    def _load_riders(self):
        """Copies the data of the riders waiting here into the cycle's
        payload (negotiation.py): those set everywhere complete with the
        cycle, without a collective of their own."""
        layout = self.slots.layout
        payload = self.cycle.payload_out(self.slots.payload_size)
        riding = {}
        if layout:
            for slot, e in self.fast.items():
                where = layout.get(slot)
                if where is not None and not e.done:  # (a failed one is skipped)
                    payload[where[0]:where[0] + where[1]] = e.tensor.reshape(-1)
                    riding[slot] = e
        self._riding = riding

    def _cycle_done(self, ready, flags, agree, partial):
        """Runs what the cycle found ready on every rank; starts a round if
        anyone asked for one. Every rank posts the next cycle while someone
        waits: for a round's answer (PENDING), or for a slot the others have
        not set (`partial`). A cycle that ran everything anyone had submitted
        is the last one, so a step costs one cycle, not two."""
        riding, self._riding = self._riding, {}
        if not agree:
            self._die(HorovodInternalError(
                f"rank {self.rank}: the ranks' negotiation cycle slots disagree (slot digest "
                f"{self.slots.digest:#x}); running the cycle would combine different tensors, "
                "so the coordinator stops (COORDINATOR_CYCLE_PAYLOAD_BYTES differs between "
                "ranks, or a bug: please report it)"))
            return True
        self.flags = flags
        self._more = bool(flags & FLAG_PENDING) or partial
        moved = self._run_ready(ready, riding) if ready else False
        if flags & (FLAG_CLASSIC | FLAG_REPORT):
            self._start_round(bool(flags & FLAG_REPORT))
            moved = True
        if moved or flags & FLAG_FRESH:
            self._cycle_backoff = 0.0
        else:
            self._cycle_backoff = min(max(2 * self._cycle_backoff, CYCLE_BACKOFF_MIN),
                                      CYCLE_BACKOFF_MAX)
        self._next_post = time.monotonic() + self._cycle_backoff
        return True

    def _ready_entries(self, ready, riding):
        """(riders, others): this rank's waiting entries in the slots a
        cycle found ready, split by whether that cycle carried their data."""
        riders, others = [], []
        for slot in ready:
            e = self.fast.get(slot)
            if e is not None and not e.done:
                (riders if riding.get(slot) is e else others).append(e)
        return riders, others

    def _run_ready(self, ready, riding):
        riders, waiting = self._ready_entries(ready, riding)
        entries = complete_groups(waiting)
        if not entries and not riders:
            return False
        planned = self._plan(entries)
        self._unwait(riders + entries)
        self.stats["cycle_runs"] += len(planned)
        if self.is_coordinator and self.timeline.enabled:
            # What rank 0 saw of these negotiations: its own arrival, and the
            # cycle that found them everywhere (rounds record every rank's).
            for e in riders + entries:
                shown = display_name(e.key[0], e.name)
                self.timeline.negotiate_start(shown, e.op, None, e.submit_time)
                self.timeline.negotiate_rank_ready(shown, 0, e.submit_time)
                self.timeline.negotiate_end(shown)
        if riders:
            self._land(riders)
        if self.autotuner is not None and planned:
            self.autotuner.observe(_plans_of(planned))
        for resp, group in planned:
            # This rank's own entries, in flight: what _collect would find.
            self._execute(resp, group)
        return True

    def _plan(self, entries):
        """plan_ready's plan for `entries`, made once for each list of cache
        ids (and devices): ids are never reused, so the same ids are the same
        names and descriptions, and a training step's plan is the last
        step's (161 tensors: 0.1 ms a step)."""
        params = self.params
        key = (tuple([e.cache_id if e.device < 0 else (e.cache_id, e.device) for e in entries]),
               params["fusion_threshold"], params["pack_limit"])
        plan = self._plans.get(key)
        if plan is not None:
            return [(resp, [entries[i] for i in members]) for resp, members in plan]
        planned = plan_ready(entries, params["fusion_threshold"], params["pack_limit"])
        at = {id(e): i for i, e in enumerate(entries)}
        if len(self._plans) >= PLANS_KEPT:
            self._plans.clear()
        self._plans[key] = [(resp, [at[id(e)] for e in group]) for resp, group in planned]
        return planned

    def _unwait(self, entries):
        """Entries a cycle runs leave their slots. Rank 0 forgets any
        negotiation of theirs: some ranks reported their copies in a round
        (waiting long in the cycle), which the others' may have joined in
        the cycle after it. Forgotten only where rank 0 had reported its own
        copy too, a worker's report outlived the step, and that rank's next
        copy of the name was 'submitted twice' once it was reported in turn
        (a rank 30 s late to a cached tensor, with the default stall time).
        Rounds and cycles take turns, so a negotiation open here can only
        be of this copy."""
        coordinator = self.is_coordinator
        for e in entries:
            slot = self.slots.slot(e.cache_id)
            del self.fast[slot]
            self.cycle.clear(slot)
            if coordinator:
                self.controller.forget(e.key, e.group)

    def _land(self, riders):
        """Completes riders from the cycle's payload: the sum of every rank's
        data, in float64, scaled as an allreduce scales it. Integers come
        back through int64, so an overflow wraps as MPI's sum would; a
        float32 sum is rounded once (for two ranks exactly MPI's result, for
        more at most as far from the exact sum)."""
        sums = self.cycle.payload
        layout = self.slots.layout
        traced = self.timeline.enabled  # on some ranks only: cycles run where it is off
        if traced:
            shown = [display_name(0, e.name) for e in riders]
            self.timeline.op_start(shown, _RIDERS, riders)
        results = []
        for e in riders:
            offset, count = layout[self.slots.slot(e.cache_id)]
            part = sums[offset:offset + count]
            out = e.output if e.output is not None else np.empty(e.shape, e.dtype_info.dtype)
            if out.dtype.kind in "iu":
                part = part.astype(np.int64)
            divisor = self.size if e.reduce_op == pb.AVERAGE else 1
            copy_scaled(part, out.reshape(-1), e.postscale, divisor)
            results.append(out)
        self.stats["riders"] += len(riders)
        if traced:
            self.timeline.op_end(shown)
        self._complete(riders, results)

    # -------------------------------------------------------------- rounds
    def _start_round(self, report):
        """Every rank sends rank 0 what the cycle could not carry (possibly
        nothing); with `report`, its cycle entries too, in full, once."""
        number = self.rounds
        self.rounds += 1
        self._round_started = time.monotonic()
        self._before_join()
        self._flush_stream()
        todo = [e for e in self.resend + self.classic if e.in_rounds and not e.done]
        self.resend = [e for e in self.resend if not e.in_rounds]
        self.classic = []
        rl = self._request_list(todo, number)
        rl.streamed = self._streams_sent
        if report:
            for e in self.fast.values():
                if not e.reported:
                    e.reported = True
                    self._describe(rl, e, cached=False)
        if self._shutdown_wanted and not self._shutdown_sent:
            self._ask_shutdown()
        if self.is_coordinator:
            self.round = (number, {0: rl})
        else:
            self.channel.send(0, TAG_ROUND, rl.SerializeToString())
            self.round = (number, None)

    def _before_join(self):
        """A join goes to a round, and what this rank submitted before it
        goes there too, ahead of it: the join completes once every rank has
        joined, and an operation left waiting in the cycle would then wait
        for ranks that have gone on (their part is zeros, and only a round
        gives them those); rank 0 reads a round's requests in order, and one
        read after its rank's join would meet the other ranks' next step.
        Between cycles only: a bit in a cycle in flight stays set, as the
        other ranks saw it."""
        at = next((i for i, e in enumerate(self.classic) if e.op == pb.JOIN), None)
        if at is None or not self.fast:
            return
        after = self.classic[at:]
        del self.classic[at:]
        while self.fast:
            self._unslot(next(iter(self.fast)))
        self.classic.extend(after)

    def _round_turn(self):
        number, lists = self.round
        if lists is None:  # a worker waits for rank 0's answer
            for _, payload in self.channel.receive(TAG_ROUND_RESPONSE):
                msg = pb.ResponseList()
                msg.ParseFromString(payload)
                self.round = None
                self._apply_round(msg)
                return True
            return False
        moved = False
        for source, payload in self.channel.receive(TAG_ROUND):
            msg = pb.RequestList()
            msg.ParseFromString(payload)
            lists[source] = msg
            self.watchdog.heard(source)
            moved = True
        if len(lists) < self.size:
            return moved
        if self._streams_behind(lists):
            self._control_coordinator()  # (a rank's earlier stream lists first)
            if self._streams_behind(lists):
                return moved
        self.round = None
        self._decide_round(lists)
        return True

    def _streams_behind(self, lists):
        """Rank 0: whether some rank's round list follows stream lists that
        have not been read here yet."""
        return any(rl.streamed > self._streams_heard[rank] for rank, rl in lists.items()
                   if rank)

    def _decide_round(self, lists):
        """Rank 0: every rank's requests, in rank order, through the
        Controller; each rank gets its plans, notices, resends, evictions and
        the parameters cycles plan with."""
        ctl = self.controller
        for rank in range(self.size):
            ctl.submit(rank, lists[rank])
        now = time.monotonic()
        self._inspect_stalls(now)
        plans = ctl.take_plans(now)
        if self.autotuner is not None:
            self.autotuner.observe(plans)
        notices = ctl.take_notices()
        resends = ctl.take_resends()
        params = self._desired_params()
        outgoing = [pb.ResponseList(round=self.rounds - 1) for _ in range(self.size)]
        self._answered = self.rounds
        _address(plans, resends, outgoing)
        for rank, owed in notices.items():
            outgoing[rank].notices.extend(owed)
        cache = ctl.cache
        for rank, msg in enumerate(outgoing):
            ids, self._evict_seq[rank] = cache.evictions_since(self._evict_seq[rank])
            msg.evicted.extend(ids)
            msg.fast = params["fast"]
            msg.fusion_threshold = params["fusion_threshold"]
            msg.pack_limit = params["pack_limit"]
            if rank:
                self.channel.send(rank, TAG_ROUND_RESPONSE, msg.SerializeToString())
        cache.trim_evictions(min(self._evict_seq))
        self._apply_round(outgoing[0])

    def _desired_params(self):
        ctl = self.controller
        fast = (self.cache_enabled and not ctl.joined() and not self.timeline.enabled)
        return {"fast": fast, "fusion_threshold": ctl.fusion_threshold,
                "pack_limit": ctl.pack_limit}

    def _params_changed(self):
        return self._desired_params() != self.params

    def _apply_round(self, msg):
        """A round's answer, applied in the same order on every rank:
        parameters, evictions, notices, plans, resends."""
        self.params = {"fast": msg.fast, "fusion_threshold": msg.fusion_threshold,
                       "pack_limit": msg.pack_limit}
        if self._refusing:  # rank 0 has read the refusals this round carried
            self._refusing = {k: n for k, n in self._refusing.items() if n > msg.round}
        if not msg.fast:
            while self.fast:  # (a group member takes its siblings along)
                self._unslot(next(iter(self.fast)))
        for cache_id in msg.evicted:
            self.cache.evict(cache_id)
            slot = self.slots.release(cache_id)
            if slot is not None and slot in self.fast:
                self._unslot(slot)
        for notice in msg.notices:
            self._owe(notice)
        # A round that brings more new tensors than the cache holds evicts
        # some of the ids it hands out: they are dead on arrival, never
        # stored (stored, they would hold their cycle slots for good, rank 0
        # never evicting them again, and describe their tensors by ids rank
        # 0 no longer knows).
        dead = frozenset(msg.evicted)
        for resp in msg.responses:
            self._execute(resp, dead=dead)
        if msg.resend:
            self._resend_ids(msg.resend)

    def _unslot(self, slot):
        """A cycle entry goes back to rounds (its slot was evicted, or cycles
        are off): described in full next time, unless rank 0 has it already.
        A group member takes the rest of its group along (_whole_groups)."""
        e = self.fast[slot]
        slots = [slot]
        if e.group:
            slots += [s for s, x in self.fast.items()
                      if s != slot and x.group == e.group and x.key[0] == e.key[0]]
        for s in slots:
            self.cycle.clear(s)
            e = self.fast.pop(s)
            if e.reported:
                self.sent[e.key] = e
            else:
                self.classic.append(e)

    def _owe(self, notice):
        """This rank owes an operation that failed before it submitted it: a
        copy already waiting here fails now, else the next submission will."""
        due = due_now(notice, list(self.fast.values()) + self.classic)
        if due is None:
            self.owed.owe(notice)
            return
        for e in due:
            self._drop_waiting(e)
            self._fail_owed(e, notice)

    def _drop_waiting(self, e):
        slot = self.slots.slot(e.cache_id) if e.cache_id else None
        if slot is not None and self.fast.get(slot) is e:
            del self.fast[slot]
            self.cycle.clear(slot)
        elif e in self.classic:
            self.classic.remove(e)

    # ------------------------------------------------------------ requests
    def _request_list(self, entries, number):
        rl = pb.RequestList(round=number)
        refused = set()  # keys this list refuses
        # With a join, every request goes in full: one sent by a cache id
        # that rank 0 has evicted meanwhile would be asked for again, and
        # come back after the join had completed in this round (the other
        # ranks gone on, it would wait for them for good).
        full = any(e.op == pb.JOIN for e in entries)
        for e in entries:
            if e.rejected:
                refused.add(e.key)
            # Behind a refusal of its tensor (or group) in the same list, in
            # full: rank 0 reads a list's cache ids before its requests, and
            # would take this next copy for the refused one (in a round, or
            # a process set's stream).
            behind = bool(refused) and not e.rejected and _copy_of(e, refused)
            try:
                self._describe(rl, e, cached=not (behind or full))
            except Exception as exc:  # one entry's description never stops the loop
                self._done(e, error=HorovodInternalError(
                    f"{e.describe()}: could not be sent to the coordinator: {exc!r}"))
        return rl

    def _describe(self, rl, e, cached=True):
        if not e.rejected and e.in_rounds:
            self.sent[e.key] = e
        if cached and self.cache_enabled and e.op in CACHEABLE and not e.rejected:
            cache_id = self.cache.lookup(e.key, e.signature())
            if cache_id:
                self.stats["cached_requests"] += 1
                e.cache_id = cache_id
                self.sent_by_id[cache_id] = e
                rl.cached.add(cache_id=cache_id, submit_time=e.submit_time)
                return
        self.stats["full_requests"] += 1
        rl.requests.append(e.request())

    def _resend_ids(self, ids):
        """Rank 0 did not know these cache ids: describe them in full."""
        for cache_id in ids:
            self.cache.evict(cache_id)
            entry = self.sent_by_id.pop(cache_id, None)
            if entry is not None and not entry.done:
                self.sent.pop(entry.key, None)
                entry.cache_id = 0
                self.resend.append(entry)
        self.queue.wakeup.set()

    # --------------------------------------------- messages outside rounds
    def _control(self):
        """Messages that do not wait for a round: streamed requests and
        answers of other sets and send/recv, watchdog reports and pings, and
        shutdown. Probing for them costs a progress pass of MPI (it was half
        of rank 0's loop in a steady-state step), so while nothing streamed
        is expected the channel is looked at every CONTROL_POLL seconds."""
        now = time.monotonic()
        if now < self._next_control and not self.stream and not self._shutdown_wanted:
            return False
        if self.is_coordinator:
            worked = self._control_coordinator()
        else:
            worked = self._control_worker()
        expecting = worked or self._streaming()
        self._next_control = now if expecting else now + CONTROL_POLL
        return worked

    def _streaming(self):
        """Streamed work under way that this rank must hear about soon."""
        if self._streamed:
            return True
        return self.is_coordinator and self.controller.has_stream_pending()

    def _control_coordinator(self):
        ctl = self.controller
        worked = False
        if self._shutdown_wanted and not self._shutdown_sent:
            self._shutdown_sent = True
            ctl.request_shutdown(0, self._shutdown_why, self._shutdown_finished)
        for source, payload in self.channel.receive(TAG_REQUEST):
            msg = pb.RequestList()
            msg.ParseFromString(payload)
            worked = True
            self.heartbeat.heard(source)
            if msg.alive:
                # Not heard by the watchdog: its pings, sent to members it
                # has not heard from while a cycle waits, are also what
                # brings an idle worker into that cycle.
                continue
            self.watchdog.heard(source)
            if msg.shutdown and msg.shutdown_kind in FATAL_KINDS:
                # A worker gave up on this rank (it was stopped: STALL), or
                # failed its part of a collective (BROKEN, whose text names
                # it): so does the job.
                reason = (msg.shutdown_reason if msg.shutdown_kind == pb.BROKEN
                          else f"rank {source}: {msg.shutdown_reason}")
                self._fail_everywhere(reason, msg.shutdown_kind)
                return True
            if msg.shutdown:
                ctl.request_shutdown(source, msg.shutdown_reason, msg.finished)
            if msg.report:
                self.watchdog.report(
                    source, [(f.process_set_id, f.name, f.op, f.seconds, f.device, f.seq,
                              tuple(f.pair)) for f in msg.in_flight],
                    positions={(p.process_set_id, p.device, *p.pair): p.started
                               for p in msg.positions}, blocked=msg.blocked)
                self.channel.send(source, TAG_RESPONSE, b"")  # an empty answer: alive
                self._woken = True  # a worker waits: take part in a cycle
            if msg.cycle:
                self._ask_everyone_into(msg.cycle)  # a worker's join or add (_wake_everyone)
            if msg.streamed:
                self._streams_heard[source] = max(self._streams_heard[source], msg.streamed)
            if msg.requests or msg.cached:
                ctl.submit(source, msg)
        worked |= self._flush_stream()
        if worked:
            self._wake_for_device_plans()
        now = time.monotonic()
        self._inspect_stalls(now)
        worked |= self._stream_out(now)
        reason = ctl.shutdown_reason
        if reason:
            # `round`: how many rounds rank 0 answered; a worker waiting on a
            # later one stops waiting.
            payload = pb.ResponseList(shutdown=True, shutdown_reason=reason,
                                      round=self._answered,
                                      shutdown_finished=ctl.shutdown_finished
                                      ).SerializeToString()
            for rank in range(1, self.size):
                self.channel.send(rank, TAG_RESPONSE, payload)
            self._begin_final(reason, ctl.shutdown_finished)
            return True
        return worked

    def _stream_requests(self):
        """This rank's other-set entries (and resends of them), described."""
        todo = [e for e in self.resend if not e.in_rounds and not e.done] + self.stream
        if not todo:
            return None
        self.resend = [e for e in self.resend if e.in_rounds]
        self.stream = []
        self._streamed += sum(1 for e in todo if not e.rejected)
        rl = self._request_list(todo, 0)
        self._streams_sent += 1
        rl.streamed = self._streams_sent
        return rl

    def _flush_stream(self):
        """Other sets' requests submitted so far go to rank 0 now: as they
        come, and ahead of a round this rank starts (a join or a set's
        removal in it must be read after them). Whether there were any."""
        own = self._stream_requests()
        if own is None:
            return False
        if self.is_coordinator:
            self.controller.submit(0, own)
        else:
            self.channel.send(0, TAG_REQUEST, own.SerializeToString())
        return True

    def _stream_out(self, now):
        """Rank 0: other sets' plans and the resends go out as decided; the
        global set's wait for the next round."""
        ctl = self.controller
        plans = ctl.take_plans(now, global_set=False)
        resends = ctl.take_resends()
        if not plans and not resends:
            return False
        if self.autotuner is not None:
            self.autotuner.observe(plans)
        outgoing = _address(plans, resends, collections.defaultdict(pb.ResponseList))
        own = outgoing.pop(0, pb.ResponseList())
        if own.resend:
            self._resend_ids(own.resend)
        for rank, msg in outgoing.items():
            self.channel.send(rank, TAG_RESPONSE, msg.SerializeToString())
        for resp in own.responses:
            self._execute(resp)
        return True

    def _inspect_stalls(self, now):
        if now < self._next_stall_check:
            return
        ctl = self.controller
        period = ctl.stall_inspector.next_check(now)
        self._next_stall_check = now + (period if period else 3600.0)
        own = self._own_ops()
        blocked = {0: self._blocked(now)}
        for rank in range(1, self.size):
            blocked[rank] = self.watchdog.blocked_for(rank, now)
        dog, members = self.watchdog, ctl.members_of
        for text in ctl.inspect_stalls(now, lambda rank: dog.inside(rank, own, now, members),
                                       {rank: t for rank, t in blocked.items() if t > 0},
                                       dog.silent_ranks(now)):
            log.warning(text)

    def _control_worker(self):
        worked = False
        for _, payload in self.channel.receive(TAG_RESPONSE):
            msg = pb.ResponseList()
            msg.ParseFromString(payload)
            worked = True
            self.heartbeat.heard(0)
            if msg.heartbeat:
                self.channel.send(0, TAG_REQUEST, ALIVE)
                continue
            self.watch.heard()
            if msg.shutdown and msg.shutdown_kind in FATAL_KINDS:
                self._die(ERROR_TYPES[msg.shutdown_kind](msg.shutdown_reason),
                          msg.shutdown_kind)
                return True
            if msg.ping:
                self._pinged = True
                self._next_watch = 0.0
                self._woken = True  # rank 0 waits on a cycle: take part
            if msg.cycle:
                self._woken_until = time.monotonic() + WAKE_HOLD
                if msg.cycle > self.cycles:
                    self._woken = True  # rank 0 posted a cycle this rank has not
            if msg.shutdown:
                self._answered = msg.round
                self._begin_final(msg.shutdown_reason, msg.shutdown_finished)
                return True
            if msg.resend:
                self._resend_ids(msg.resend)
            for resp in msg.responses:
                self._execute(resp)
        worked |= self._flush_stream()
        if self._shutdown_wanted and not self._shutdown_sent:
            self._ask_shutdown()
            worked = True
        if (self._shutdown_asked_at is not None
                and time.monotonic() - self._shutdown_asked_at > SHUTDOWN_TIMEOUT):
            log.warning("rank %d: no shutdown confirmation from rank 0 after %.0f s; "
                        "leaving without it", self.rank, SHUTDOWN_TIMEOUT)
            self._finish_final("shutdown() was not confirmed by rank 0")
        return worked

    def _ask_shutdown(self):
        self._shutdown_sent = True
        self._shutdown_asked_at = time.monotonic()
        msg = pb.RequestList(shutdown=True, shutdown_reason=self._shutdown_why,
                             finished=self._shutdown_finished)
        self.channel.send(0, TAG_REQUEST, msg.SerializeToString())

    # ----------------------------------------------------------- watchdog
    def _watch(self, now):
        """Watchdog duties (watchdog.py): rank 0 pings members of long-running
        collectives (and cycles) and names the silent ones; a worker reports
        while busy and notices rank 0 going silent."""
        beat = self._heartbeat(now)
        if self.finished:
            return True
        if self.is_coordinator:
            return self._watch_members(now) or beat
        return self._watch_coordinator(now) or beat

    def _heartbeat(self, now):
        """Liveness whatever is in flight (watchdog.Heartbeat): rank 0 sends
        its heartbeats; a rank silent for the silence limit fails the job,
        and every rank releases the program's own MPI calls waiting on it."""
        beat = self.heartbeat
        if not beat.enabled:
            return False
        sent = beat.beat_due(now)
        if sent:
            for rank in range(1, self.size):
                self.channel.send(rank, TAG_RESPONSE, HEARTBEAT)
        warnings, fatal = beat.inspect(self._busy(), now)
        for text in warnings:
            log.warning("rank %d: %s", self.rank, text)
        if fatal:
            self._fail_everywhere(fatal, pb.SILENT)
            return True
        return sent

    def _own_ops(self):
        """(set, name, op, start time, device, place in its lane, pair) of
        what is in flight here, for the watchdog (pair: a send/recv's two
        ranks, else ())."""
        ops = [(op.response.process_set_id, op.names[0] if op.names else "", op.response.op,
                op.started, op.response.device, op.seq, _pair(op.response))
               for op in self.executor.in_flight() if op.started is not None]
        if self.cycle.in_flight:
            ops.append((0, NEGOTIATION, pb.BARRIER, self.cycle.posted_at, -1, 0, ()))
        elif self.round is not None:
            ops.append((0, NEGOTIATION, pb.BARRIER, self._round_started, -1, 0, ()))
        return ops

    def _watch_members(self, now):
        dog = self.watchdog
        if not dog.enabled:
            self._next_watch = float("inf")
            return False
        self._next_watch = now + dog.period / 2
        members = self.controller.members_of
        pings, warnings, fatal = dog.inspect(self._own_ops(), members, now, self.lane_counts)
        for text in warnings:
            log.warning(text)
        if fatal:
            self._fail_everywhere(fatal, pb.SILENT if dog.silent else pb.STALL)
            return True
        for rank in pings:
            self.channel.send(rank, TAG_RESPONSE, pb.ResponseList(ping=True).SerializeToString())
        return bool(pings)

    def _watch_coordinator(self, now):
        watch = self.watch
        if not watch.enabled:
            self._next_watch = float("inf")
            return False
        self._next_watch = now + watch.period / 2
        busy = bool(self.queue.inflight_count() or self.executor or self.cycle.in_flight
                    or self.round is not None)
        sent = False
        if self._pinged or watch.report_due(busy, now):
            self._pinged = False
            items = [(pset, name, op, now - started, device, seq, pair)
                     for pset, name, op, started, device, seq, pair in self._own_ops()
                     if now - started >= watch.period]
            msg = pb.RequestList(report=True, blocked=self._blocked(now))
            for pset, name, op, seconds, device, seq, pair in items:
                msg.in_flight.add(process_set_id=pset, name=name, op=op, seconds=seconds,
                                  device=device, seq=seq, pair=pair)
            for (pset, device, *pair), started in self.lane_counts.items():
                msg.positions.add(process_set_id=pset, device=device, started=started,
                                  pair=pair)
            self.channel.send(0, TAG_REQUEST, msg.SerializeToString())
            watch.sent_report(bool(items), now)
            sent = True
        if busy:
            warning, fatal = watch.inspect(self._waiting_for(), now)
            if warning:
                log.warning("rank %d: %s", self.rank, warning)
            if fatal:
                # Rank 0 reads this when (if) it runs again, and fails too.
                self._fail_everywhere(fatal, pb.SILENT)
                return True
        return sent

    def _blocked(self, now):
        """How long every thread that submits here has been waiting for a
        result, with nothing in flight here (0 if not so): the deadlock
        check (stall_inspector.py)."""
        if self.executor:
            return 0.0
        return self.handles.blocked_seconds(now)

    def _waiting_for(self):
        op = self.executor.oldest()
        if op is not None and op.names:
            return describe(op.response.op, op.names[0])
        return "work submitted to it"

    def _fail_everywhere(self, text, kind=pb.STALL):
        """A member stopped answering (SILENT), or was not found in a
        collective (or a cycle) the others are in (STALL), or failed one
        every member had agreed to run (BROKEN): its peers can never finish
        it, so the job fails on every rank that can still hear rank 0."""
        self._tell_everyone(text, kind)
        self._die(ERROR_TYPES[kind](text), kind)

    def _tell_everyone(self, text, kind):
        """The job fails with `text` as a `kind` error: rank 0 tells every
        worker; a worker tells rank 0, which tells the others."""
        if self.is_coordinator:
            payload = pb.ResponseList(shutdown=True, shutdown_reason=text,
                                      shutdown_kind=kind).SerializeToString()
            for rank in range(1, self.size):
                self.channel.send(rank, TAG_RESPONSE, payload)
        else:
            notice = pb.RequestList(shutdown=True, shutdown_reason=text, shutdown_kind=kind)
            self.channel.send(0, TAG_REQUEST, notice.SerializeToString())

    def _break(self, resp, text):
        """This rank cannot take its part in `resp`, which every member
        agreed to run: the others may be in it already and would wait for
        this rank forever (and the communicator's order is lost), so the job
        fails on every rank with `text`. Where no other rank waits for it,
        this rank alone fails."""
        others = self._waiting_partners(resp)
        if others:
            text = (f"{text}. Every member had agreed to run it, so {format_ranks(others)} "
                    f"cannot finish it without rank {self.rank}: the job cannot go on")
            self._tell_everyone(text, pb.BROKEN)
        self._die(HorovodInternalError(text))

    def _tell_as_thread_dies(self, text):
        """Best effort, as this thread dies of `text`: the other ranks fail at
        once instead of waiting for this rank in a collective, or a cycle,
        that it will never finish."""
        if self.stopping or self.size == 1:
            return
        try:
            self._tell_everyone(text, pb.BROKEN)
            deadline = time.monotonic() + 1.0  # nothing will drive the sends after this
            while self.channel.progress() and time.monotonic() < deadline:
                time.sleep(1e-3)
        except Exception:  # the control plane may be what failed
            log.debug("rank %d could not tell the others", self.rank, exc_info=True)

    def _waiting_partners(self, resp):
        """The other ranks that take part in `resp` and would wait for this
        one (none once the job is shutting down: a final grace bounds what
        is left)."""
        if self.stopping:
            return []
        if resp.op == pb.P2P:
            ranks = resp.ranks
        else:
            pid = resp.process_set_id
            ranks = self.parts.members(pid) or self._draining.get(pid) or ()
        return sorted(set(ranks) - {self.rank})

    def _die(self, exc, kind=None):
        """Leaves at once: collectives in flight are abandoned (a peer will
        never complete them) and everything pending fails with `exc`. Where
        a rank stopped answering (`kind` SILENT), the program's own MPI
        calls waiting on it are released too."""
        self.executor.abandon()
        self.parts.fatal(exc)
        if kind == pb.SILENT:
            self.parts.release()
        self.finished = True

    # ----------------------------------------------------------- execution
    def _collect(self, resp, dead=frozenset()):
        """This rank's entries for a response, in the response's order; the
        new cache ids it gives are stored, but those in `dead` (evicted)."""
        entries = []
        new_ids = resp.new_cache_ids
        pset = resp.process_set_id
        for i, name in enumerate(resp.names):
            entry = self.queue.get((pset, name))
            if entry is None:
                entry = self._stand_in(resp, name, i)
            if entry is not None and i < len(new_ids) and new_ids[i] and new_ids[i] not in dead:
                # A joined rank's stand-in too: every rank gives the id a slot.
                self._store(entry, new_ids[i])
            entries.append(entry)
        for cache_id in resp.cache_ids:
            entry = self.sent_by_id.pop(cache_id, None)
            if entry is None:
                raise HorovodInternalError(
                    f"rank {self.rank}: response names cache id {cache_id}, which this rank "
                    "never sent")
            entries.append(entry)
        return entries

    def _stand_in(self, resp, name, index):
        """An entry for a tensor this rank did not submit: it has joined, or
        the response is an error for another rank's tensor."""
        if resp.error or resp.op in (pb.BARRIER, pb.JOIN, pb.ADD_PROCESS_SET,
                                     pb.REMOVE_PROCESS_SET):
            return None
        spec = resp.specs[index] if index < len(resp.specs) else None
        if spec is None:
            raise HorovodInternalError(
                f"rank {self.rank} was asked to run {describe(resp.op, name)}, "
                "which it never submitted")
        info = dtypes.BY_WIRE[spec.dtype]
        shape = tuple(spec.shape)
        return Entry(name, resp.op, tensor=self.ops.zeros(resp, shape, info.dtype),
                     dtype_info=info, shape=shape, process_set_id=resp.process_set_id,
                     device=resp.device, reduce_op=resp.reduce_op, prescale=resp.prescale,
                     postscale=resp.postscale, root_rank=resp.root_rank,
                     group=spec.group, group_size=spec.group_size)

    def _store(self, entry, cache_id):
        """The cache id rank 0 gave this tensor; a global-set one also gets a
        cycle slot (every rank stores the same ids in the same order)."""
        signature = entry.signature()
        self.cache.store(entry.key, signature, cache_id)
        if entry.key[0] == 0 and entry.op in CACHEABLE:
            self.slots.assign(cache_id, entry.key, signature)

    def _mine(self, entry):
        return entry is not None and self.queue.get(entry.key) is entry

    def _done(self, e, result=None, error=None):
        """Completes one of this rank's entries, wherever it waited."""
        self._settle(e)
        self.queue.complete(e, result=result, error=error)
        self._completed = True

    def _settle(self, e):
        """Forgets where one of this rank's entries waited, before it completes."""
        if not e.in_rounds and not e.done and self._streamed:
            self._streamed -= 1
        if self.sent.get(e.key) is e:
            del self.sent[e.key]
        self._leave_cycle(e)

    def _leave_cycle(self, e):
        """`e` no longer waits in a cycle slot (if it did): its bit is
        cleared before the next cycle is posted."""
        if e.cache_id:
            slot = self.slots.slot(e.cache_id)
            if slot is not None and self.fast.get(slot) is e:
                del self.fast[slot]
                self.cycle.clear(slot)

    def _execute(self, resp, entries=None, dead=frozenset()):
        """Runs a response over `entries` (by default, what _collect finds,
        storing the new cache ids it gives but those in `dead`)."""
        self.stats["responses"] += 1
        if entries is None:
            try:
                entries = self._collect(resp, dead)
            except HorovodInternalError as exc:
                self._break(resp, str(exc))
                return
            # A round may run a tensor that waits in a cycle slot (a report
            # described it): it leaves the slot now, not once it completes.
            # Else the next cycle would post its bit and data again while it
            # runs, and where the other ranks' next tensors of that name had
            # set theirs, one rank's result would mix this step's data with
            # the next (seen with a rank late past the stall shutdown time).
            for e in entries:
                if self._mine(e):
                    self._leave_cycle(e)
        if resp.error:
            kind = ERROR_TYPES.get(resp.error_kind, HorovodInternalError)
            groups = {(e.key[0], e.group) for e in entries if self._mine(e) and e.group}
            for e in entries:
                if self._mine(e):
                    self._done(e, error=kind(resp.error))
            for pset, group in groups:
                self._fail_rest_of_group(pset, group, lambda: kind(resp.error))
            return
        op = resp.op
        try:
            if op in (pb.BARRIER, pb.JOIN, pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET):
                if op == pb.BARRIER:
                    result = None
                elif op == pb.JOIN:
                    result = resp.value
                else:
                    result = self._change_process_sets(resp)
                self._complete(entries, [result] * len(entries))
                return
            names = list(resp.names) + [e.name for e in entries[len(resp.names):]]
            kwargs = {}
            if op == pb.BROADCAST:
                kwargs["root"] = self.parts.set_rank_of(resp.process_set_id, resp.root_rank)
            elif op == pb.P2P:
                kwargs["pair"] = [self.parts.set_rank_of(resp.process_set_id, r)
                                  for r in resp.ranks]
            traced = self.timeline.enabled
            if traced:
                shown = [display_name(resp.process_set_id, n) for n in names]
                self.timeline.op_start(shown, resp, entries)
            else:
                shown = names
            gen = self.ops.run(resp, entries, shown, **kwargs)
        except Exception as exc:
            self._failed(resp, entries, exc)
            return
        # A lane per communicator: the set's, on this device (a GPU's NCCL
        # communicator and the set's MPI one run side by side).
        lane = (resp.process_set_id, resp.device)
        operation = Operation(resp, entries, shown, lane, gen, traced,
                              device=self._local_device(resp, entries))
        # Every member starts these in one order per lane; a send/recv's two
        # ranks start theirs in one order per pair.
        counted = lane + _pair(resp)
        operation.seq = self.lane_counts[counted] = self.lane_counts.get(counted, 0) + 1
        done = self.executor.start(operation)
        self._complete_queued()
        for op in done:
            self._finish_op(op)

    def _change_process_sets(self, resp):
        """Adds or removes a set. A removed set's operations already started
        here (submitted earlier, not waited for) still use its
        communicators: those are freed once the last of them finishes, not
        under them (MPI_ERR_COMM, or a crash, on this rank and a hang on
        its partners)."""
        removing = resp.op == pb.REMOVE_PROCESS_SET
        members = self.parts.members(resp.value) if removing else None
        result = self.parts.apply_process_set_change(resp)
        if removing:
            self._draining[resp.value] = members or ()
            self._release_drained()
        return result

    def _release_drained(self):
        """Frees the communicators of each removed set none of whose
        operations is in flight any more."""
        for pid in [p for p in self._draining if not self.executor.runs_set(p)]:
            del self._draining[pid]
            self.parts.release_process_set(pid)

    def _local_device(self, resp, entries):
        """The device this rank runs `resp` on: -1 for the host; for a GPU,
        the one the device backends run it on (gpu.home_device: where its
        own tensors are). resp.device is the ordinal rank 0's request named,
        and on a machine of several GPUs each rank uses its own: lanes of
        one GPU keyed by other ranks' ordinals were not kept in one order."""
        if resp.device < 0:
            return -1
        self._gpu = gpu.home_device(resp, entries, self._gpu)
        return self._gpu

    def _fail_rest_of_group(self, pset, group, make_error):
        """A grouped operation fails as a unit: this rank's other members of
        the instance fail with it now. Rank 0 failed every member it knew;
        one it had asked to have in full (a resend) and not received yet is
        not among them, and, sent later, would open a negotiation of its own
        and meet the other ranks' next instance of the group."""
        running = {id(e) for op in self.executor.in_flight() for e in op.entries}
        for e in self.queue.group(pset, group):
            if id(e) not in running:
                self._done(e, error=make_error())

    def _progress(self):
        """Drives the operations in flight; True when any of them moved."""
        steps = self.executor.steps
        done = self.executor.progress()
        queued = self._complete_queued()
        for op in done:
            self._finish_op(op)
        return bool(done) or queued or self.executor.steps != steps

    def _complete_queued(self):
        """Once a GPU operation's work is all queued on its device, completes
        the handles of its entries that take results in stream order: all of
        them with HOROVOD_ENABLE_ASYNC_COMPLETION, as Horovod does, else
        those submitted in stream order (collectives.in_stream_order:
        DistributedOptimizer's gradients). Their results are valid in stream
        order, and synchronize makes the caller's current stream wait for
        the operation's completion event (DeviceWait.order_current_stream),
        so the caller queues what comes next without waiting for the GPU.
        The operation stays in flight until its event fires; its other
        entries complete then."""
        queued = self.executor.take_queued()
        every = self.config.async_completion
        for op in queued:
            early = [i for i, e in enumerate(op.entries)
                     if e is not None and (every or e.in_stream_order)]
            if early:
                op.completed_early = True
                results = op.queued_results
                self._complete([op.entries[i] for i in early], [results[i] for i in early])
        return bool(queued)

    def _finish_op(self, op):
        try:
            self._end_op(op)
        finally:
            if self._draining:
                self._release_drained()

    def _end_op(self, op):
        if op.traced:
            self.timeline.op_end(op.names)
        if op.completed_early and op.error is not None:
            # Handles have completed; it can fail only as a job fails (an
            # NCCL communicator's asynchronous error): stop, so that no rank
            # goes on with results that were never written.
            names = ", ".join(f"'{n}'" for n in op.names)
            why = ("HOROVOD_ENABLE_ASYNC_COMPLETION" if self.config.async_completion else
                   "results taken in stream order, as DistributedOptimizer takes its gradients")
            self._break(op.response,
                        f"rank {self.rank}: {op_name(op.response.op)} of tensor(s) {names} "
                        f"failed after its handles had completed ({why}): {op.error}")
            return
        if op.error is not None:
            self._failed(op.response, op.entries, op.error)
            return
        self._complete(op.entries, op.results)

    def _complete(self, entries, results):
        """Completes this rank's entries among `entries` with their results,
        together (one pass of the queue's locks for an operation's tensors)."""
        mine, done = self._mine, []
        for e, result in zip(entries, results):
            if mine(e):
                if e.cache_id and self.sent_by_id.get(e.cache_id) is e:
                    del self.sent_by_id[e.cache_id]  # answered by name this time
                self._settle(e)
                done.append((e, result))
        if done:
            self.queue.complete_all(done)
            self._completed = True

    def _failed(self, resp, entries, exc):
        """This rank's part in `resp` failed (the backend raised): where
        other ranks take part, the job cannot go on (_break); else it fails
        these tensors only."""
        names = ", ".join(f"'{e.name}'" for e in entries if e is not None)
        lost = self._lost_peers(exc)
        if lost is not None:  # ULFM: a member died; name it, not this rank
            self._die(RankFailedError(
                f"rank {self.rank}: {op_name(resp.op)} of tensor(s) {names} failed: {lost}; "
                "collective operations that involve it can never complete"))
            return
        text = (f"rank {self.rank}: {op_name(resp.op)} of tensor(s) {names} failed: "
                f"{type(exc).__name__}: {exc}")
        if self._waiting_partners(resp):
            self._break(resp, text)
            return
        err = HorovodInternalError(text)
        for e in entries:
            if self._mine(e):
                self._done(e, error=err)

    # ------------------------------------------------------------ shutdown
    def _begin_final(self, reason, finished=False):
        """Shuts down for `reason`; `finished`: the rank that asked did so
        because its program is done (ShutdownError.peer_finished)."""
        if finished:
            reason = f"{reason}; {FINISHED_MARK}"
        # Why, before `stopping` says so: a frontend thread waiting outside
        # the coordinator (Runtime.check_running) reads the reason as soon
        # as it sees `stopping`.
        self.final_reason = reason
        self._final_finished = finished
        self.stopping = True
        # A round rank 0 has answered is still run here: its answer is on
        # the way (rank 0 may have finished, say, a barrier and shut down
        # before this rank read the answer). Any other round is dropped:
        # rank 0 decides no more.
        answered = (self.round is not None and self.round[1] is None
                    and self.round[0] < self._answered)
        if self.round is not None and not answered:
            self.round = None
        # Collectives already started run to completion (every rank started
        # them), and so do those the answered round may hold; everything
        # else fails now, and what is left of those when the thread ends.
        keep = {id(e) for op in self.executor.in_flight() for e in op.entries}
        if answered:
            keep |= {id(e) for e in self.sent.values()}
        # The riders of a cycle in flight: where every rank posted it, the
        # others take their results from it (and may be done and shutting
        # down already), so they complete here too.
        keep |= {id(e) for e in self._riding.values()}
        self.queue.close_and_fail(lambda e: self._shutdown_error(
            f"{e.describe()}: the coordinator has shut down ({reason})"), keep=keep)
        request = self.channel.barrier()
        self._final = (request, time.monotonic() + SHUTDOWN_TIMEOUT, reason)
        # A cycle in flight is left as it is: nothing reads it any more, and
        # MPI_Finalize does not wait for it (measured with Open MPI 5); but
        # MPI may complete it there, so its buffers outlive the interpreter
        # (Cycle.close, leftovers.py).

    def _final_turn(self):
        request, deadline, reason = self._final
        # Keep draining so no peer blocks on a message we never take.
        tag = TAG_REQUEST if self.is_coordinator else TAG_RESPONSE
        drained = bool(self.channel.receive(tag))
        if self.round is not None:  # rank 0's answer to a round: run its operations
            drained |= self._round_turn()
        if self._riding:
            drained |= self._final_cycle()
        self.channel.progress()
        if self.executor:
            drained |= self._progress()
        now = time.monotonic()
        if self._final_grace is None and (request is None or request.Test()):
            # Every rank is shutting down: what they all started finishes at
            # once; what some never started (a round's answer they dropped)
            # never will.
            self._final_grace = now + FINAL_GRACE
        settled = not self.executor and self.round is None and not self._riding
        if self._final_grace is not None and (settled or now > self._final_grace):
            for op in self.executor.abandon():
                self._failed(op.response, op.entries, self._shutdown_error(
                    f"the coordinator shut down ({reason}) before it completed"))
            self._finish_final(reason)
        elif now > deadline:
            log.warning("rank %d: not every rank confirmed shutdown within %.0f s",
                        self.rank, SHUTDOWN_TIMEOUT)
            self.unconfirmed_shutdown = True
            for op in self.executor.abandon():
                self._failed(op.response, op.entries, self._shutdown_error(
                    f"the coordinator shut down ({reason}) before it completed"))
            self._finish_final(reason)
        return drained

    def _final_cycle(self):
        """Reads the cycle in flight at shutdown for its riders alone (what
        else it found ready is not started any more)."""
        result = self.cycle.test()
        if result is None:
            return self.cycle.moved
        ready, _flags, agree, _partial = result
        riding, self._riding = self._riding, {}
        if agree:
            riders, _ = self._ready_entries(ready, riding)
            if riders:
                self._unwait(riders)
                self._land(riders)
        return True

    def _finish_final(self, reason):
        self.channel.cancel_sends()
        self.queue.fail_remaining(lambda e: self._shutdown_error(
            f"{e.describe()}: the coordinator has shut down ({reason})"))
        self.finished = True

    def _shutdown_error(self, text):
        """A ShutdownError of this shutdown: `peer_finished` when the rank
        that asked for it did so because its program is done."""
        error = ShutdownError(text)
        error.peer_finished = self._final_finished
        return error

    # ------------------------------------------------------------ liveness
    def _check_liveness(self):
        found = self.parts.check_dead()
        if found:
            self.executor.abandon()
            self.parts.fatal(RankFailedError(
                f"{describe_dead(found)} exited while the job was running; collective "
                "operations that involve it can never complete"))
            self.finished = True
