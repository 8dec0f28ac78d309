"""The one background thread of a process.

Each turn of its loop it
1. takes what the frontends submitted and describes it to the coordinator
   (in full, or by response-cache id; refusals with their reason);
2. on rank 0, feeds every rank's requests to the `Controller` and sends each
   rank the responses it must run, in the one global order;
3. starts the responses it received, in order, through the backends, and
   completes the frontends' handles as their operations finish
   (executor.py): a collective in flight never blocks the loop, so stall
   checks, the watchdog and liveness keep running meanwhile.

It is event-driven: a submission wakes it at once. While this rank has work
in flight it polls the control channel and its operations with a short
back-off; with nothing in flight it sleeps, waking only every
`idle_poll_interval` for control messages, stalls and dead peers.

It is handed its collaborators (`Collaborators`), not the runtime, so it can
be built and driven without MPI beyond the control channel.
"""

import ctypes
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping

from coordinator import dtypes
from coordinator.control_channel import TAG_REQUEST, TAG_RESPONSE
from coordinator.controller import CACHEABLE, Controller
from coordinator.errors import (HorovodInternalError, RankFailedError, ShutdownError,
                                StallError, TensorMismatchError)
from coordinator.executor import Executor, Operation
from coordinator.liveness import describe_dead
from coordinator.ops_names import display_name, op_name
from coordinator.response_cache import WorkerCache
from coordinator.stall_inspector import StallInspector
from coordinator.tensor_queue import Entry
from coordinator.watchdog import CoordinatorWatch, Watchdog
from coordinator.wire import pb

log = logging.getLogger("coordinator")

ERROR_TYPES = {
    pb.MISMATCH: TensorMismatchError,
    pb.STALL: StallError,
    pb.INVALID: HorovodInternalError,
    pb.INTERNAL: HorovodInternalError,
}

# Seconds shutdown() waits for every rank to confirm.
SHUTDOWN_TIMEOUT = 30.0

# While work is in flight: poll without sleeping for SPIN_TIME seconds after
# the last progress, plus SPIN_PER_TENSOR for each tensor in flight (rank 0
# needs longer to decide on a burst of many), then sleep, doubling from
# BACKOFF_MIN up to BACKOFF_MAX seconds. While a frontend thread is blocked
# waiting for a result, the process has nothing else to run: poll for up to
# SPIN_WAITED seconds instead, yielding the CPU between polls, because a
# sleeping thread answers a peer's message only when its sleep ends (up to
# BACKOFF_MAX late, at every hop of a negotiation). Only where every rank on
# this machine has a CPU of its own: oversubscribed, the polling would take
# the CPU from a rank that is still computing.
SPIN_TIME = 200e-6
SPIN_PER_TENSOR = 10e-6
SPIN_WAITED = 10e-3
BACKOFF_MIN = 20e-6
BACKOFF_MAX = 500e-6
LIVENESS_PERIOD = 0.1


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
    timeline: Any
    colocated: int  # ranks sharing this machine's CPUs
    initial_process_sets: Mapping[int, tuple]
    members: Callable[[int], Any]  # process set id -> its global ranks
    set_rank_of: Callable[[int, int], int]  # (set, global rank) -> rank in the set
    apply_process_set_change: Callable[[Any], Any]  # runs an add/remove response
    fatal: Callable[[BaseException], None]  # the job cannot go on
    check_dead: Callable[[], list]  # peers found dead since the last call


class Background:
    def __init__(self, parts: Collaborators):
        self.parts = parts
        self.config = parts.config
        self.rank = parts.rank
        self.size = parts.size
        self.queue = parts.queue
        self.handles = parts.handles
        self.ops = parts.ops
        self.timeline = parts.timeline
        self.channel = parts.channel
        self.executor = Executor()
        self.is_coordinator = self.rank == 0
        self.cache = WorkerCache()
        self.cache_enabled = self.config.cache_capacity > 0
        self.spin_waited = waited_spin_budget(parts.colocated, _cpus())
        self.sent_by_id = {}  # cache id -> entry sent as that id
        self.resend = []  # entries the coordinator asked to have in full
        cfg = self.config
        self.controller = None
        self.watchdog = None
        self.watch = None
        if self.is_coordinator:
            inspector = StallInspector(cfg.stall_check_time, cfg.stall_shutdown_time,
                                       cfg.stall_check_disable)
            self.controller = Controller(
                self.size, fusion_threshold=cfg.fusion_threshold,
                cache_capacity=cfg.cache_capacity, stall_inspector=inspector,
                timeline=self.timeline,
                cycle_time=cfg.cycle_time_ms / 1000.0, pack_limit=cfg.pack_limit)
            for pid, ranks in parts.initial_process_sets.items():
                self.controller.register_process_set(pid, ranks)
            self._evict_seq = [0] * self.size
            self.watchdog = Watchdog(0, cfg.stall_check_time, cfg.stall_shutdown_time,
                                     cfg.stall_check_disable)
        else:
            self.watch = CoordinatorWatch(cfg.stall_check_time, cfg.stall_shutdown_time,
                                          cfg.stall_check_disable)
        self.autotuner = None
        if self.is_coordinator and self.config.autotune:
            from coordinator.autotune import Autotuner

            self.autotuner = Autotuner(self.controller, self.config.autotune_log)
        self._shutdown_wanted = False
        self._shutdown_why = ""
        self._shutdown_sent = False
        self._shutdown_asked_at = None
        self._final = None  # (Ibarrier request, deadline, reason) once shutting down
        self.stopping = False  # shutting down: no new work is taken
        self.finished = False
        self._next_liveness = 0.0
        self._next_stall_check = 0.0
        self._next_watch = 0.0
        self._pinged = False  # rank 0 asked for a report
        self.stats = {"cached_requests": 0, "full_requests": 0, "responses": 0}
        self.thread = threading.Thread(target=self._main, name="coordinator-background",
                                       daemon=True)

    # ------------------------------------------------------------ control
    def start(self):
        self.thread.start()

    def request_shutdown(self, why=""):
        self._shutdown_why = why
        self._shutdown_wanted = True
        self.queue.wakeup.set()

    # --------------------------------------------------------------- loop
    def _main(self):
        _tighten_timer_slack()
        try:
            self._loop()
        except BaseException as exc:  # the thread must never die silently
            log.exception("coordinator background thread failed")
            self.parts.fatal(HorovodInternalError(
                f"rank {self.rank}: the coordinator's background thread failed: {exc!r}"))
        finally:
            self.finished = True

    def _loop(self):
        sleeps = 0
        last_progress = time.perf_counter()
        wakeup = self.queue.wakeup
        while not self.finished:
            wakeup.clear()
            if self._turn():
                sleeps = 0
                last_progress = time.perf_counter()
                continue
            if self.finished:
                break
            timeout = self._timeout(sleeps, last_progress)
            if timeout is None:
                continue
            sleeps += 1
            wakeup.wait(timeout)

    def _timeout(self, sleeps, last_progress):
        inflight = self.queue.inflight_count()
        busy = (inflight or self.executor or self._final is not None
                or self._shutdown_wanted or self.channel.progress())
        if busy:
            spent = time.perf_counter() - last_progress
            if spent < SPIN_TIME + SPIN_PER_TENSOR * inflight:
                return None
            if inflight and spent < self.spin_waited and self.handles.waiting:
                os.sched_yield()
                return None
            timeout = min(BACKOFF_MIN * (1 << min(sleeps, 16)), BACKOFF_MAX)
        else:
            timeout = self.config.idle_poll_interval
        if self.controller is not None:
            deadline = self.controller.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        return timeout

    def _turn(self):
        worked = False
        entries = self.queue.drain()
        requests = None
        if entries or self.resend:
            requests = self._request_list(entries)
            worked = True
            if self.timeline.enabled:
                self.timeline.mark_cycle()
        if self._final is not None:
            return self._final_turn() or worked
        if self.is_coordinator:
            worked |= self._coordinate(requests)
        else:
            worked |= self._work(requests)
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

    # ------------------------------------------------------------ requests
    def _request_list(self, entries):
        rl = pb.RequestList()
        todo = list(entries)
        if self.resend:
            todo = self.resend + todo
            self.resend = []
        for e in todo:
            try:
                self._describe(rl, e)
            except Exception as exc:  # one entry's description never stops the loop
                self.queue.complete(e, error=HorovodInternalError(
                    f"{e.describe()}: could not be sent to the coordinator: {exc!r}"))
        return rl

    def _describe(self, rl, e):
        if self.cache_enabled and e.op in CACHEABLE and not e.rejected:
            cache_id = self.cache.lookup(e.key, e.signature())
            if cache_id:
                self.stats["cached_requests"] += 1
                e.cache_id = cache_id
                self.sent_by_id[cache_id] = e
                rl.cached.add(cache_id=cache_id, submit_time=e.submit_time)
                return
        e.cache_id = 0
        self.stats["full_requests"] += 1
        req = pb.Request(name=e.name, op=e.op, shape=e.shape, process_set_id=e.process_set_id,
                         device=e.device, submit_time=e.submit_time)
        if e.rejected:
            req.rejected = e.rejected
        if e.dtype_info is not None:
            req.dtype = e.dtype_info.wire
        if e.op in (pb.ALLREDUCE, pb.REDUCESCATTER):
            req.reduce_op = e.reduce_op
            req.prescale = e.prescale
            req.postscale = e.postscale
        elif e.op == pb.BROADCAST:
            req.root_rank = e.root_rank
        elif e.op == pb.ALLTOALL:
            req.splits.extend(e.splits)
        elif e.op in (pb.ADD_PROCESS_SET, pb.P2P):
            req.ranks.extend(e.ranks)
        if e.group:
            req.group = e.group
            req.group_size = e.group_size
        rl.requests.append(req)

    # --------------------------------------------------------- coordinator
    def _coordinate(self, requests):
        ctl = self.controller
        worked = False
        answers = set()  # ranks that sent a watchdog report: they get an answer
        if requests is not None:
            ctl.submit(0, requests)
        if self._shutdown_wanted and not self._shutdown_sent:
            self._shutdown_sent = True
            ctl.request_shutdown(0, self._shutdown_why)
            worked = True
        for source, payload in self.channel.receive(TAG_REQUEST):
            msg = pb.RequestList()
            msg.ParseFromString(payload)
            self.watchdog.heard(source)
            if msg.shutdown and msg.shutdown_kind == pb.STALL:
                # A worker gave up on this rank (it was stopped): so does the job.
                self._stall_shutdown(f"rank {source}: {msg.shutdown_reason}")
                return True
            if msg.report:
                self.watchdog.report(source, [(f.process_set_id, f.name, f.op, f.seconds)
                                              for f in msg.in_flight])
                answers.add(source)
            ctl.submit(source, msg)
            worked = True
        now = time.monotonic()
        if now >= self._next_stall_check:
            period = ctl.stall_inspector.next_check(now)
            self._next_stall_check = now + (period if period else 3600.0)
            for text in ctl.inspect_stalls(now):
                log.warning(text)
        plans = ctl.take_plans(now)
        if self.autotuner is not None:
            self.autotuner.observe(plans)
        resends = ctl.take_resends()
        reason = ctl.shutdown_reason
        if not (plans or resends or reason or answers):
            return worked
        own = []
        outgoing = {}

        def out(rank):
            msg = outgoing.get(rank)
            if msg is None:
                msg = outgoing[rank] = pb.ResponseList()
            return msg

        for rank in answers:
            out(rank)  # an empty ResponseList answers a report
        for plan in plans:
            for rank in plan.recipients:
                if rank == 0:
                    own.append(plan.response)
                else:
                    out(rank).responses.append(plan.response)
        for rank, ids in resends.items():
            if rank == 0:
                self._resend_ids(ids)
            else:
                out(rank).resend.extend(ids)
        if reason:
            for rank in range(1, self.size):
                msg = out(rank)
                msg.shutdown = True
                msg.shutdown_reason = reason
        cache = ctl.cache
        for rank, msg in outgoing.items():
            ids, self._evict_seq[rank] = cache.evictions_since(self._evict_seq[rank])
            msg.evicted.extend(ids)
            self.channel.send(rank, TAG_RESPONSE, msg.SerializeToString())
        ids, self._evict_seq[0] = cache.evictions_since(self._evict_seq[0])
        for cache_id in ids:
            self.cache.evict(cache_id)
        if ids or len(outgoing) == self.size - 1:
            cache.trim_evictions(min(self._evict_seq))
        for resp in own:
            self._execute(resp)
        if reason:
            self._begin_final(reason)
        return True

    # -------------------------------------------------------------- worker
    def _work(self, requests):
        worked = False
        if self._shutdown_wanted and not self._shutdown_sent:
            if requests is None:
                requests = pb.RequestList()
            requests.shutdown = True
            requests.shutdown_reason = self._shutdown_why
            self._shutdown_sent = True
            self._shutdown_asked_at = time.monotonic()
        if requests is not None:
            self.channel.send(0, TAG_REQUEST, requests.SerializeToString())
            worked = True
        for _, payload in self.channel.receive(TAG_RESPONSE):
            msg = pb.ResponseList()
            msg.ParseFromString(payload)
            worked = True
            self.watch.heard()
            if msg.shutdown and msg.shutdown_kind == pb.STALL:
                self._die(StallError(msg.shutdown_reason))
                return True
            for cache_id in msg.evicted:
                self.cache.evict(cache_id)
            if msg.resend:
                self._resend_ids(msg.resend)
            for resp in msg.responses:
                self._execute(resp)
            if msg.ping:
                self._pinged = True
                self._next_watch = 0.0
            if msg.shutdown:
                self._begin_final(msg.shutdown_reason)
                return True
        if (self._shutdown_asked_at is not None
                and time.monotonic() - self._shutdown_asked_at > SHUTDOWN_TIMEOUT):
            log.warning("rank %d: no shutdown confirmation from rank 0 after %.0f s; "
                        "leaving without it", self.rank, SHUTDOWN_TIMEOUT)
            self._finish_final("shutdown() was not confirmed by rank 0")
        return worked

    def _resend_ids(self, ids):
        for cache_id in ids:
            self.cache.evict(cache_id)
            entry = self.sent_by_id.pop(cache_id, None)
            if entry is not None and not entry.done:
                self.resend.append(entry)
        self.queue.wakeup.set()

    # ----------------------------------------------------------- watchdog
    def _watch(self, now):
        """Watchdog duties (watchdog.py): rank 0 pings members of long-running
        collectives and names the silent ones; a worker reports while busy
        and notices rank 0 going silent."""
        if self.is_coordinator:
            return self._watch_members(now)
        return self._watch_coordinator(now)

    def _own_ops(self):
        return [(op.response.process_set_id, op.names[0] if op.names else "", op.response.op,
                 op.started) for op in self.executor.in_flight() if op.started is not None]

    def _watch_members(self, now):
        dog = self.watchdog
        if not dog.enabled:
            self._next_watch = float("inf")
            return False
        self._next_watch = now + dog.period / 2
        members = self.controller.process_sets.get
        pings, warnings, fatal = dog.inspect(self._own_ops(), members, now)
        for text in warnings:
            log.warning(text)
        if fatal:
            self._stall_shutdown(fatal)
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
        busy = bool(self.queue.inflight_count() or self.executor)
        sent = False
        if self._pinged or watch.report_due(busy, now):
            self._pinged = False
            items = [(pset, name, op, now - started)
                     for pset, name, op, started in self._own_ops()
                     if now - started >= watch.period]
            msg = pb.RequestList(report=True)
            for pset, name, op, seconds in items:
                msg.in_flight.add(process_set_id=pset, name=name, op=op, seconds=seconds)
            self.channel.send(0, TAG_REQUEST, msg.SerializeToString())
            watch.sent_report(bool(items), now)
            sent = True
        if busy:
            warning, fatal = watch.inspect(self._waiting_for(), now)
            if warning:
                log.warning("rank %d: %s", self.rank, warning)
            if fatal:
                # Rank 0 reads this when (if) it runs again, and fails too.
                notice = pb.RequestList(shutdown=True, shutdown_reason=fatal,
                                        shutdown_kind=pb.STALL)
                self.channel.send(0, TAG_REQUEST, notice.SerializeToString())
                self._die(StallError(fatal))
                return True
        return sent

    def _waiting_for(self):
        op = self.executor.oldest()
        if op is not None and op.names:
            return f"{op_name(op.response.op)} of tensor '{op.names[0]}'"
        return "work submitted to it"

    def _stall_shutdown(self, text):
        """A member stopped answering in the middle of a collective: its
        peers can never finish it, so the job fails on every rank that can
        still hear rank 0."""
        log.error("%s", text)
        msg = pb.ResponseList(shutdown=True, shutdown_reason=text, shutdown_kind=pb.STALL)
        payload = msg.SerializeToString()
        for rank in range(1, self.size):
            self.channel.send(rank, TAG_RESPONSE, payload)
        self._die(StallError(text))

    def _die(self, exc):
        """Leaves at once: collectives in flight are abandoned (a peer will
        never complete them) and everything pending fails with `exc`."""
        self.executor.abandon()
        self.parts.fatal(exc)
        self.finished = True

    # ----------------------------------------------------------- execution
    def _collect(self, resp):
        """This rank's entries for a response, in the response's order."""
        entries = []
        new_ids = resp.new_cache_ids
        pset = resp.process_set_id
        for i, name in enumerate(resp.names):
            entry = self.queue.get((pset, name))
            if entry is None:
                entry = self._stand_in(resp, name, i)
            elif i < len(new_ids) and new_ids[i]:
                self.cache.store(entry.key, entry.signature(), new_ids[i])
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
                f"rank {self.rank} was asked to run {op_name(resp.op)} of tensor '{name}', "
                "which it never submitted")
        info = dtypes.BY_WIRE[spec.dtype]
        shape = tuple(spec.shape)
        return Entry(name, resp.op, tensor=self.ops.zeros(resp, shape, info.dtype),
                     dtype_info=info, shape=shape, process_set_id=resp.process_set_id,
                     device=resp.device)

    def _mine(self, entry):
        return entry is not None and self.queue.get(entry.key) is entry

    def _execute(self, resp):
        self.stats["responses"] += 1
        try:
            entries = self._collect(resp)
        except HorovodInternalError as exc:
            self.parts.fatal(exc)
            return
        if resp.error:
            kind = ERROR_TYPES.get(resp.error_kind, HorovodInternalError)
            for e in entries:
                if self._mine(e):
                    self.queue.complete(e, error=kind(resp.error))
            return
        op = resp.op
        try:
            if op in (pb.BARRIER, pb.JOIN, pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET):
                if op == pb.BARRIER:
                    result = None
                elif op == pb.JOIN:
                    result = resp.value
                else:
                    result = self.parts.apply_process_set_change(resp)
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
        operation = Operation(resp, entries, shown, lane, gen, traced)
        for done in self.executor.start(operation):
            self._finish_op(done)

    def _progress(self):
        """Drives the operations in flight; True when any of them moved."""
        steps = self.executor.steps
        done = self.executor.progress()
        for op in done:
            self._finish_op(op)
        return bool(done) or self.executor.steps != steps

    def _finish_op(self, op):
        if op.traced:
            self.timeline.op_end(op.names)
        if op.error is not None:
            self._failed(op.response, op.entries, op.error)
            return
        self._complete(op.entries, op.results)

    def _complete(self, entries, results):
        for e, result in zip(entries, results):
            if self._mine(e):
                if e.cache_id and self.sent_by_id.get(e.cache_id) is e:
                    del self.sent_by_id[e.cache_id]  # answered by name this time
                self.queue.complete(e, result=result)

    def _failed(self, resp, entries, exc):
        """A failed call fails these tensors only."""
        names = ", ".join(f"'{e.name}'" for e in entries if e is not None)
        err = HorovodInternalError(
            f"rank {self.rank}: {op_name(resp.op)} of tensor(s) {names} failed: {exc}")
        for e in entries:
            if self._mine(e):
                self.queue.complete(e, error=err)

    # ------------------------------------------------------------ shutdown
    def _begin_final(self, reason):
        self.stopping = True
        # Collectives already started run to completion (every rank started
        # them); everything else fails now.
        running = {id(e) for op in self.executor.in_flight() for e in op.entries}
        self.queue.close_and_fail(lambda e: ShutdownError(
            f"{e.describe()}: the coordinator has shut down ({reason})"), keep=running)
        request = self.channel.barrier()
        self._final = (request, time.monotonic() + SHUTDOWN_TIMEOUT, reason)

    def _final_turn(self):
        request, deadline, reason = self._final
        # Keep draining so no peer blocks on a message we never take.
        tag = TAG_REQUEST if self.is_coordinator else TAG_RESPONSE
        drained = bool(self.channel.receive(tag))
        self.channel.progress()
        if self.executor:
            drained |= self._progress()
        if (request is None or request.Test()) and not self.executor:
            self._finish_final(reason)
        elif time.monotonic() > deadline:
            log.warning("rank %d: not every rank confirmed shutdown within %.0f s",
                        self.rank, SHUTDOWN_TIMEOUT)
            for op in self.executor.abandon():
                self._failed(op.response, op.entries, ShutdownError(
                    f"the coordinator shut down ({reason}) before it completed"))
            self._finish_final(reason)
        return drained

    def _finish_final(self, reason):
        self.channel.cancel_sends()
        self.finished = True

    # ------------------------------------------------------------ liveness
    def _check_liveness(self):
        found = self.parts.check_dead()
        if found:
            self.executor.abandon()
            self.parts.fatal(RankFailedError(
                f"{describe_dead(found)} exited while the job was running; collective "
                "operations that involve it can never complete"))
            self.finished = True
