"""The elastic driver: who is in the job, and how it goes on after a change.

coordrun (or coordinator.run) runs one driver per job; the workers call it
over gRPC (service.py puts this class behind the ElasticDriver service of
proto/driver.proto). It never touches tensors or MPI: the workers re-form
the job themselves with MPI (membership.py) and ask the driver only what to
do.

- Memberships are numbered (generations). Generation 0 is the world mpirun
  starts; each re-forming of the job makes the next. The driver keeps, for
  each, the slot (host, index) of every rank.
- `reform()` is asked by rank 0 of the survivors: it records the lost
  workers (their hosts are blacklisted), counts the reset against
  --reset-limit, and answers which survivors must leave (their host was
  removed) and which new workers to spawn where. After losing a worker the
  job goes on at once with the survivors (new workers are spawned then only
  to reach --min-np); free slots are offered right after, as a change of
  hosts, so the time from a failure to the next step stays short.
- Below --min-np it waits up to --elastic-timeout for hosts, then stops the
  job with a message that says why.
- A discovery thread polls the host discovery every DISCOVER_PERIOD; when
  the hosts the job should use differ from the hosts it uses, the workers
  watching for changes get a notice (HostsUpdatedInterrupt at their next
  commit).
- Every worker sends a heartbeat. One of the current membership silent for
  `silence_limit` seconds (SIGSTOPped, or hung) is ended (SIGKILL) by the
  driver or by a worker on its machine (heartbeat replies name it), so that
  MPI sees it fail and the others re-form without it: ULFM's own detector
  watches only the ranks mpirun started, not those spawned later. Where no
  process on its machine ends it within END_WAIT, the driver stops the job
  saying so, rather than leave the others waiting for it.
"""

import dataclasses
import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

from coordinator import liveness
from coordinator.elastic.hosts import ADDED, NO_UPDATE, REMOVED, HostManager

log = logging.getLogger("coordinator.elastic")

DISCOVER_PERIOD = 1.0
DEFAULT_ELASTIC_TIMEOUT = 600.0
# A worker silent for this many seconds is reported as lost (heartbeats come
# every worker.HEARTBEAT_PERIOD).
HEARTBEAT_LOST = 15.0
# How long after asking for a silent worker's end the driver waits for the
# others to re-form without it before it stops the job.
END_WAIT = 15.0

Slot = Tuple[str, int]


class InvalidRequest(ValueError):
    """A request that makes no sense (answered with INVALID_ARGUMENT)."""


class JobStopped(RuntimeError):
    """The driver stopped the job; the message says why."""


@dataclasses.dataclass
class Plan:
    action: str  # "continue" or "stop"
    reason: str = ""
    generation: int = 0
    leave: List[int] = dataclasses.field(default_factory=list)
    spawn: List[Slot] = dataclasses.field(default_factory=list)
    hosts_version: int = 0


@dataclasses.dataclass
class Outcome:
    exit_code: int
    result: bytes = b""
    error: str = ""


def assign(available: List[Tuple[str, int]], kept: List[Slot], max_np: Optional[int]):
    """Places a job on the `available` (host, slots). `kept`: the slots of
    the workers that exist, in rank order. Returns (indices of `kept` that
    stay, indices that must leave, new slots to fill), filling hosts in
    order and never going beyond `max_np` workers."""
    capacity = dict(available)
    stay, leave, used = [], [], set()
    for i, (host, index) in enumerate(kept):
        if index < capacity.get(host, 0) and (host, index) not in used:
            stay.append(i)
            used.add((host, index))
        else:
            leave.append(i)
    if max_np is not None and len(stay) > max_np:
        leave = sorted(leave + stay[max_np:])
        stay = stay[:max_np]
    free = [(h, k) for h, n in available for k in range(n) if (h, k) not in used]
    room = len(free) if max_np is None else max(0, max_np - len(stay))
    return stay, leave, free[:room]


def _identified(process):
    """Whether a registered (identity, pid, start) names its process fully,
    so that it can be ended (liveness.end_process)."""
    return process is not None and bool(process[0]) and bool(process[2])


def _describe(slots):
    return ", ".join(f"{h}[{k}]" for h, k in slots)


class ElasticDriver:
    def __init__(self, hosts: HostManager, min_np: int, max_np: Optional[int] = None,
                 elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT,
                 reset_limit: Optional[int] = None, command=(), workdir="",
                 clock=time.monotonic):
        if max_np is not None and max_np < min_np:
            raise ValueError(f"--max-np {max_np} is below --min-np {min_np}")
        self.hosts = hosts
        self.min_np = min_np
        self.max_np = max_np
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.command = list(command)  # what spawned workers run
        self.workdir = workdir
        self.clock = clock
        self.cond = threading.Condition()
        self.worlds: Dict[int, List[Slot]] = {}
        self.formed_at_version: Dict[int, int] = {}
        self.generation = -1
        self.resets = 0
        self.hosts_version = 0
        self.notices: List[Tuple[int, int]] = []  # (version, update bits)
        self.stop_reason: Optional[str] = None
        # (generation, rank) -> (host identity, pid, start time), as registered
        # (identity "" and start 0 where the worker did not say)
        self.registered: Dict[Tuple[int, int], Tuple[str, int, int]] = {}
        self.heard: Dict[Tuple[int, int], float] = {}
        # Seconds without a heartbeat after which a worker of the current
        # membership is ended (coordrun: ULFM's detector timeout, for an
        # elastic job); None: silence is only reported.
        self.silence_limit: Optional[float] = None
        self.ending: Dict[Tuple[int, int], float] = {}  # -> when its end was asked
        self._warned: Dict[Tuple[int, int], float] = {}
        self.outcomes: Dict[Tuple[int, int], Outcome] = {}
        self.task = b""  # coordinator.run's pickled function
        self.environment = {}  # what coordrun exported to the first workers
        # Hosts where Open MPI's runtime started a daemon with the job (set
        # by the launcher for jobs over separate machines), and whether a
        # worker was ever lost (see _usable).
        self.daemon_hosts = None
        self.lost_any = False
        self._skipped = set()
        self.events: List[str] = []  # what happened, for logs and tests
        self._stopping = threading.Event()
        self._discovery = None
        self._first_discovery = True

    # --------------------------------------------------------------- start
    def discover(self):
        """One discovery round. The first failure of the script is fatal
        (a misconfiguration); later ones are logged and retried."""
        try:
            found = self.hosts.find()  # outside the lock: the script may be slow
        except RuntimeError as exc:
            if self._first_discovery:
                raise
            log.warning("driver: %s; keeping the hosts found before", exc)
            return
        self._first_discovery = False
        with self.cond:
            bits, changed = self.hosts.update(found)
            if changed:
                self._note(f"hosts: {self.hosts.available()}")
                self.cond.notify_all()
                self._offer_changes(bits)

    def start_world(self, num_proc: Optional[int] = None) -> List[Slot]:
        """Waits (up to the elastic timeout) until `num_proc` (default:
        --min-np) slots exist, then forms generation 0 on every available
        slot up to --max-np. Raises JobStopped on timeout."""
        need = max(num_proc or self.min_np, self.min_np)
        deadline = self.clock() + self.elastic_timeout
        while True:
            self.discover()
            with self.cond:
                if self.hosts.available_slots() >= need:
                    _, _, slots = assign(self.hosts.available(), [], self.max_np)
                    self._form(0, slots)
                    return slots
                if self.clock() >= deadline:
                    raise JobStopped(self._too_few(need, "to start"))
            time.sleep(min(DISCOVER_PERIOD, max(0.0, deadline - self.clock())))

    def start_discovery(self):
        self._discovery = threading.Thread(target=self._discover_loop, daemon=True,
                                           name="coordinator-discovery")
        self._discovery.start()

    def _discover_loop(self):
        while not self._stopping.wait(DISCOVER_PERIOD):
            try:
                self.discover()
            except Exception:  # a broken script must not kill the driver
                log.exception("driver: host discovery failed")
            self._check_heartbeats()

    def stop(self, reason: Optional[str] = None):
        with self.cond:
            if reason and self.stop_reason is None:
                self.stop_reason = reason
                log.error("driver: stopping the job: %s", reason)
            self._stopping.set()
            self.cond.notify_all()

    @property
    def stopping(self):
        return self._stopping.is_set()

    # ------------------------------------------------------------ requests
    def _world(self, generation) -> List[Slot]:
        world = self.worlds.get(generation)
        if world is None:
            raise InvalidRequest(f"unknown membership {generation}")
        return world

    def _slot(self, generation, rank) -> Slot:
        world = self._world(generation)
        if not 0 <= rank < len(world):
            raise InvalidRequest(f"rank {rank} is not in membership {generation} of "
                                 f"{len(world)} workers")
        return world[rank]

    def register(self, generation: int, rank: int, size: int, pid: int, identity: str = "",
                 start: int = 0) -> Slot:
        with self.cond:
            slot = self._slot(generation, rank)
            if size != len(self.worlds[generation]):
                raise InvalidRequest(f"membership {generation} has "
                                     f"{len(self.worlds[generation])} workers, not {size}")
            self.registered[(generation, rank)] = (identity, pid, start)
            self.heard[(generation, rank)] = self.clock()
            self.cond.notify_all()
            return slot

    def heartbeat(self, generation: int, rank: int) -> int:
        with self.cond:
            self._slot(generation, rank)
            self.heard[(generation, rank)] = self.clock()
            self.ending.pop((generation, rank), None)  # not silent after all
            return self.hosts_version

    def to_end(self) -> List[Tuple[int, int, str, int, int]]:
        """The silent workers whose end the driver asked for and that are
        still silent: (generation, rank, host identity, pid, start time)."""
        with self.cond:
            return [key + self.registered[key] for key in self.ending
                    if key[0] == self.generation and key in self.heard
                    and _identified(self.registered.get(key))]

    def finish(self, generation: int, rank: int, outcome: Outcome):
        with self.cond:
            self._slot(generation, rank)
            self.outcomes[(generation, rank)] = outcome
            self.heard.pop((generation, rank), None)
            self.cond.notify_all()

    def watch(self, generation: int, rank: int, active=lambda: True):
        """Yields (version, bits) for every change of hosts after membership
        `generation` formed, until a newer membership exists or the job
        stops."""
        with self.cond:
            self._slot(generation, rank)
            sent = self.formed_at_version[generation]
        while active():
            with self.cond:
                if self.generation != generation or self.stopping:
                    return
                fresh = [(v, b) for v, b in self.notices if v > sent]
                if not fresh:
                    self.cond.wait(1.0)
                    continue
            for version, bits in fresh:
                sent = version
                yield version, bits

    # -------------------------------------------------------------- reform
    def reform(self, generation: int, survivors: List[int], failure: bool) -> Plan:
        with self.cond:
            if self.stop_reason is not None:
                return Plan("stop", self.stop_reason)
            world = self._world(generation)
            if len(set(survivors)) != len(survivors) or not survivors:
                raise InvalidRequest(f"survivors {list(survivors)} are empty or repeat a rank")
            bad = [r for r in survivors if not 0 <= r < len(world)]
            if bad:
                raise InvalidRequest(f"survivors {bad} are not ranks of membership "
                                     f"{generation} of {len(world)} workers")
            alive = set(survivors)
            lost = [world[r] for r in range(len(world)) if r not in alive]
            for r in range(len(world)):
                if r not in alive:  # no longer heard from, nor waited for
                    self.heard.pop((generation, r), None)
            self.lost_any = self.lost_any or bool(lost)
            for host, index in lost:
                self._note(f"lost the worker on {host}[{index}]", important=True)
                self.hosts.record_failure(host)
            if self.reset_limit is not None and self.resets >= self.reset_limit:
                reason = (f"the job has been re-formed {self.resets} time"
                          f"{'' if self.resets == 1 else 's'}, its --reset-limit; "
                          f"{'a lost worker' if failure else 'a change of hosts'} would need "
                          "one more")
                self._stop_locked(reason)
                return Plan("stop", reason)
            self.resets += 1
            kept = [world[r] for r in survivors]
            return self._plan(kept, failure)

    def _plan(self, kept: List[Slot], failure: bool) -> Plan:
        deadline = self.clock() + self.elastic_timeout
        while True:
            stay, leave, new = assign(self._usable(), kept, self.max_np)
            if not stay:
                reason = ("no worker of the previous membership is on a host the job may "
                          "still use, so its state cannot be carried over")
                self._stop_locked(reason)
                return Plan("stop", reason)
            if failure:
                new = new[:max(0, self.min_np - len(stay))]
            if len(stay) + len(new) >= self.min_np:
                break
            if self.stopping or self.clock() >= deadline:
                reason = self._too_few(self.min_np, "to go on", have=len(stay) + len(new))
                self._stop_locked(reason)
                return Plan("stop", reason)
            self.cond.wait(min(1.0, max(0.0, deadline - self.clock())))
        generation = self.generation + 1
        self._form(generation, [kept[i] for i in stay] + list(new))
        self._note(f"membership {generation}: {len(stay)} kept, {len(leave)} leave, "
                   f"{len(new)} new: {_describe(self.worlds[generation])}", important=True)
        plan = Plan("continue", generation=generation, leave=leave, spawn=list(new),
                    hosts_version=self.hosts_version)
        self._offer_changes(NO_UPDATE)
        return plan

    def _form(self, generation, slots):
        self.generation = generation
        self.worlds[generation] = list(slots)
        self.formed_at_version[generation] = self.hosts_version
        self.cond.notify_all()

    def _offer_changes(self, bits):
        """Tells the current membership when the hosts it should use differ
        from the hosts it uses."""
        if self.generation < 0:
            return
        world = self.worlds[self.generation]
        _, leave, new = assign(self._usable(), world, self.max_np)
        if not leave and not new:
            return
        bits |= (ADDED if new else 0) | (REMOVED if leave else 0)
        self.hosts_version += 1
        self.notices.append((self.hosts_version, bits))
        self._note(f"hosts changed (version {self.hosts_version}): {len(new)} slots to add, "
                   f"{len(leave)} workers to remove")
        self.cond.notify_all()

    def _usable(self):
        """The available hosts new workers may go to. After a worker was
        lost, PRRTE can no longer start its daemon on a host it does not
        have yet (measured: it aborts the job with "NO PATH TO TARGET"), so
        with `daemon_hosts` set (separate machines) only those remain."""
        available = self.hosts.available()
        if self.daemon_hosts is None or not self.lost_any:
            return available
        usable = [(h, n) for h, n in available if h in self.daemon_hosts]
        for host, _ in available:
            if host not in self.daemon_hosts and host not in self._skipped:
                self._skipped.add(host)
                log.warning("driver: host %s appeared after a worker was lost; Open MPI's "
                            "runtime cannot start a daemon there any more, so it gets no "
                            "workers", host)
        return usable

    def _too_few(self, need, what, have=None):
        have = self.hosts.available_slots() if have is None else have
        return (f"only {have} worker slots are available, fewer than the {need} needed {what} "
                f"(--min-np), after waiting {self.elastic_timeout:g} s (--elastic-timeout); "
                f"hosts: {self.hosts.available() or 'none'}, blacklisted: "
                f"{sorted(h for h in self.hosts.records if self.hosts.is_blacklisted(h))}")

    def _stop_locked(self, reason):
        if self.stop_reason is None:
            self.stop_reason = reason
            log.error("driver: stopping the job: %s", reason)
        self._stopping.set()
        self.cond.notify_all()

    def _note(self, text, important=False):
        self.events.append(text)
        (log.warning if important else log.info)("driver: %s", text)

    def _check_heartbeats(self):
        now = self.clock()
        asked = []
        with self.cond:
            for key, when in list(self.heard.items()):
                if key[0] != self.generation:
                    continue
                silent = now - when
                host, index = self.worlds[key[0]][key[1]]
                who = f"rank {key[1]} ({host}[{index}])"
                if self.silence_limit is None or silent <= self.silence_limit:
                    if silent > HEARTBEAT_LOST and \
                            now - self._warned.get(key, now - HEARTBEAT_LOST) >= HEARTBEAT_LOST:
                        log.warning("driver: no heartbeat from %s for %.0f s", who, silent)
                        self._warned[key] = now
                elif key not in self.ending:
                    self.ending[key] = now
                    asked.append(key)
                    log.warning("driver: %s has sent no heartbeat for %.0f s (stopped, or "
                                "hung): ending it, so that the others re-form without it",
                                who, silent)
                elif now - self.ending[key] > END_WAIT:
                    self._stop_locked(
                        f"{who} of membership {key[0]} has sent no heartbeat for {silent:.0f} s "
                        "(stopped, or hung) and no process on its machine ended it, so the "
                        "other workers cannot re-form without it")
        for key in asked:
            self._end_here(key)

    def _end_here(self, key):
        """Ends a silent worker that runs on the driver's own machine (the
        others learn of the rest from their heartbeats' replies)."""
        process = self.registered.get(key)
        if _identified(process) and liveness.end_process(*process):
            log.warning("driver: ended pid %d (rank %d of membership %d)", process[1], key[1],
                        key[0])

    # ------------------------------------------------------------- results
    def final_outcomes(self) -> Dict[int, Outcome]:
        """The outcome of every rank of the last membership that reported."""
        with self.cond:
            return {rank: o for (gen, rank), o in self.outcomes.items()
                    if gen == self.generation}

    def wait_registered(self, generation, timeout) -> bool:
        deadline = self.clock() + timeout
        with self.cond:
            while True:
                size = len(self.worlds.get(generation, ()))
                done = sum(1 for (g, _) in self.registered if g == generation)
                if size and done >= size:
                    return True
                if self.clock() >= deadline or self.stopping:
                    return False
                self.cond.wait(min(1.0, max(0.0, deadline - self.clock())))
