"""The one background thread of a process.

Each turn of its loop it
1. takes what the frontends submitted and describes it to the coordinator
   (in full, or by response-cache id);
2. on rank 0, feeds every rank's requests to the `Controller` and sends each
   rank the responses it must run, in the one global order;
3. runs the responses it received, in order, through the backends, and
   completes the frontends' handles.

It is event-driven: a submission wakes it at once. While this rank has work
in flight it polls the control channel with a short back-off; with nothing in
flight it sleeps, waking only every `idle_poll_interval` for control messages,
stalls and dead peers.
"""

import ctypes
import logging
import os
import threading
import time

import numpy as np

from coordinator import dtypes
from coordinator.control_channel import TAG_REQUEST, TAG_RESPONSE, ControlChannel
from coordinator.controller import CACHEABLE, Controller
from coordinator.errors import (HorovodInternalError, RankFailedError, ShutdownError,
                                StallError, TensorMismatchError)
from coordinator.liveness import describe_dead
from coordinator.ops_names import op_name
from coordinator.response_cache import WorkerCache
from coordinator.stall_inspector import StallInspector
from coordinator.tensor_queue import Entry
from coordinator.runtime import SHUTDOWN_TIMEOUT
from coordinator.wire import pb

log = logging.getLogger("coordinator")

ERROR_TYPES = {
    pb.MISMATCH: TensorMismatchError,
    pb.STALL: StallError,
    pb.INVALID: HorovodInternalError,
    pb.INTERNAL: HorovodInternalError,
}

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


class Background:
    def __init__(self, runtime):
        self.rt = runtime
        self.config = runtime.config
        self.rank = runtime.rank
        self.size = runtime.size
        self.queue = runtime.queue
        self.ops = runtime.ops
        self.channel = ControlChannel(runtime.control_comm)
        self.is_coordinator = self.rank == 0
        self.cache = WorkerCache()
        self.cache_enabled = self.config.cache_capacity > 0
        topo = runtime.topology
        colocated = self.size if topo.simulated else topo.local_size
        self.spin_waited = waited_spin_budget(colocated, _cpus())
        self.sent_by_id = {}  # cache id -> entry sent as that id
        self.resend = []  # entries the coordinator asked to have in full
        self.controller = None
        if self.is_coordinator:
            cfg = self.config
            inspector = StallInspector(cfg.stall_check_time, cfg.stall_shutdown_time,
                                       cfg.stall_check_disable)
            self.controller = Controller(
                self.size, fusion_threshold=cfg.fusion_threshold,
                cache_capacity=cfg.cache_capacity, stall_inspector=inspector,
                timeline=runtime.timeline,
                cycle_time=cfg.cycle_time_ms / 1000.0, pack_limit=cfg.pack_limit)
            for pid, ranks in runtime.initial_process_sets.items():
                self.controller.register_process_set(pid, ranks)
            self._evict_seq = [0] * self.size
        self.autotuner = None
        if self.is_coordinator and self.config.autotune:
            from coordinator.autotune import Autotuner

            self.autotuner = Autotuner(self.controller, self.config.autotune_log)
        self._shutdown_wanted = False
        self._shutdown_why = ""
        self._shutdown_sent = False
        self._shutdown_asked_at = None
        self._final = None  # (Ibarrier request, deadline) once shutting down
        self.finished = False
        self._next_liveness = 0.0
        self._next_stall_check = 0.0
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
            self.rt.fatal(HorovodInternalError(
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
        busy = (inflight or self._final is not None or self._shutdown_wanted
                or self.channel.progress())
        if busy:
            spent = time.perf_counter() - last_progress
            if spent < SPIN_TIME + SPIN_PER_TENSOR * inflight:
                return None
            if inflight and spent < self.spin_waited and self.rt.handles.waiting:
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
            if self.rt.timeline.enabled:
                self.rt.timeline.mark_cycle()
        if self._final is not None:
            return self._final_turn() or worked
        if self.is_coordinator:
            worked |= self._coordinate(requests)
        else:
            worked |= self._work(requests)
        self.channel.progress()
        now = time.monotonic()
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_PERIOD
            self._check_liveness()
        return worked

    # ------------------------------------------------------------ requests
    def _request_list(self, entries):
        rl = pb.RequestList()
        todo = list(entries)
        if self.resend:
            todo = self.resend + todo
            self.resend = []
        for e in todo:
            if self.cache_enabled and e.op in CACHEABLE:
                cache_id = self.cache.lookup(e.name, e.signature())
                if cache_id:
                    self.stats["cached_requests"] += 1
                    e.cache_id = cache_id
                    self.sent_by_id[cache_id] = e
                    rl.cached.add(cache_id=cache_id, submit_time=e.submit_time)
                    continue
            e.cache_id = 0
            self.stats["full_requests"] += 1
            req = rl.requests.add(name=e.name, op=e.op, shape=e.shape,
                                  process_set_id=e.process_set_id, device=e.device,
                                  submit_time=e.submit_time)
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
            elif e.op == pb.ADD_PROCESS_SET:
                req.ranks.extend(e.ranks)
            if e.group:
                req.group = e.group
                req.group_size = e.group_size
        return rl

    # --------------------------------------------------------- coordinator
    def _coordinate(self, requests):
        ctl = self.controller
        worked = False
        if requests is not None:
            ctl.submit(0, requests)
        if self._shutdown_wanted and not self._shutdown_sent:
            self._shutdown_sent = True
            ctl.request_shutdown(0, self._shutdown_why)
            worked = True
        for source, payload in self.channel.receive(TAG_REQUEST):
            msg = pb.RequestList()
            msg.ParseFromString(payload)
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
        if not (plans or resends or reason):
            return worked
        own = []
        outgoing = {}

        def out(rank):
            msg = outgoing.get(rank)
            if msg is None:
                msg = outgoing[rank] = pb.ResponseList()
            return msg

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
            for cache_id in msg.evicted:
                self.cache.evict(cache_id)
            if msg.resend:
                self._resend_ids(msg.resend)
            for resp in msg.responses:
                self._execute(resp)
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

    # ----------------------------------------------------------- execution
    def _collect(self, resp):
        """This rank's entries for a response, in the response's order."""
        entries = []
        new_ids = resp.new_cache_ids
        for i, name in enumerate(resp.names):
            entry = self.queue.get(name)
            if entry is None:
                entry = self._stand_in(resp, name, i)
            elif i < len(new_ids) and new_ids[i]:
                self.cache.store(name, entry.signature(), new_ids[i])
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
        return Entry(name, resp.op, tensor=np.zeros(shape, info.dtype), dtype_info=info,
                     shape=shape, process_set_id=resp.process_set_id, device=resp.device)

    def _execute(self, resp):
        self.stats["responses"] += 1
        try:
            entries = self._collect(resp)
        except HorovodInternalError as exc:
            self.rt.fatal(exc)
            return
        mine = [e for e in entries if e is not None and self.queue.get(e.name) is e]
        if resp.error:
            kind = ERROR_TYPES.get(resp.error_kind, HorovodInternalError)
            for e in mine:
                self.queue.complete(e, error=kind(resp.error))
            return
        op = resp.op
        try:
            if op == pb.BARRIER:
                results = [None] * len(entries)
            elif op == pb.JOIN:
                results = [resp.value] * len(entries)
            elif op in (pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET):
                results = [self.rt.apply_process_set_change(resp)] * len(entries)
            else:
                names = list(resp.names) + [e.name for e in entries[len(resp.names):]]
                kwargs = {}
                if op == pb.BROADCAST:
                    kwargs["root"] = self.rt.set_rank_of(resp.process_set_id, resp.root_rank)
                timeline = self.rt.timeline
                traced = timeline.enabled
                if traced:
                    timeline.op_start(names, resp, entries)
                results = self.ops.run(resp, entries, names, **kwargs)
                if traced:
                    timeline.op_end(names)
        except Exception as exc:  # a failed MPI call fails these tensors only
            names = ", ".join(f"'{e.name}'" for e in entries if e is not None)
            err = HorovodInternalError(
                f"rank {self.rank}: {op_name(op)} of tensor(s) {names} failed: {exc}")
            for e in mine:
                self.queue.complete(e, error=err)
            return
        for e, result in zip(entries, results):
            if e is not None and self.queue.get(e.name) is e:
                if e.cache_id and self.sent_by_id.get(e.cache_id) is e:
                    del self.sent_by_id[e.cache_id]  # answered by name this time
                self.queue.complete(e, result=result)

    # ------------------------------------------------------------ shutdown
    def _begin_final(self, reason):
        err = ShutdownError
        self.rt.close_queue(lambda e: err(
            f"{e.describe()}: the coordinator has shut down ({reason})"), reason)
        try:
            request = self.rt.control_comm.Ibarrier()
        except Exception:  # pragma: no cover - MPI already unusable
            request = None
        self._final = (request, time.monotonic() + SHUTDOWN_TIMEOUT, reason)

    def _final_turn(self):
        request, deadline, reason = self._final
        # Keep draining so no peer blocks on a message we never take.
        tag = TAG_REQUEST if self.is_coordinator else TAG_RESPONSE
        drained = bool(self.channel.receive(tag))
        self.channel.progress()
        if request is None or request.Test():
            self._finish_final(reason)
        elif time.monotonic() > deadline:
            log.warning("rank %d: not every rank confirmed shutdown within %.0f s",
                        self.rank, SHUTDOWN_TIMEOUT)
            self._finish_final(reason)
        return drained

    def _finish_final(self, reason):
        self.channel.cancel_sends()
        self.finished = True

    # ------------------------------------------------------------ liveness
    def _check_liveness(self):
        found = self.rt.monitor.check() if self.rt.monitor is not None else []
        if found:
            self.rt.fatal(RankFailedError(
                f"{describe_dead(found)} exited while the job was running; collective "
                "operations that involve it can never complete"))
            self.finished = True
