"""The watchdog: a rank that stops answering while work involving it is in
flight.

The stall inspector sees tensors that some ranks never submitted. It cannot
see a rank that submitted and then stopped (SIGSTOP, a debugger, a frozen
driver call) while the collective was in flight: the other members simply
wait for it. The watchdog closes that gap, with messages only while
something is in flight (the heartbeat, at the end of this file, watches
liveness whatever is in flight, with one message each way a second):

- A worker with work in flight for longer than `period` reports to rank 0
  every `period`, listing its collectives in flight for that long; rank 0
  answers every report.
- Rank 0, while a collective (its own, or one a worker reported) has been in
  flight for longer than `period`, pings the members of its process set it
  has not heard from within `period`. Every rank answers a ping at once,
  whatever it is doing.
- A member that leaves pings unanswered for `check_time` is named in a
  warning; after `shutdown_time`, or `silence` (COORDINATOR_SILENT_RANK_SECONDS,
  which holds without a stall shutdown time: a rank that does not answer is
  stopped, not slow), the job fails with a StallError on every rank that
  can still hear rank 0.
- A worker whose reports rank 0 leaves unanswered for those times warns, then
  fails, naming rank 0.
- A member that answers but never starts a collective the others are in
  (the ranks disagree on what runs: a bug) is named the same way. Every
  member starts the operations of a communicator (a lane) in one order, so
  each counts them; reports carry the counts, and an operation's place in
  that order. A member whose count stays below the place of an operation
  others have had in flight for `check_time` has not started it; after
  `shutdown_time` (or `silence`) the job fails.

Reports also say how long every thread that submits work on the rank has
been blocked waiting, with nothing in flight there: ranks so for
COORDINATOR_DEADLOCK_SECONDS, each for tensors only the others could
submit, are deadlocked, and the stall inspector fails the operations they
wait on (stall_inspector.py).

With stall checks off (HOROVOD_STALL_CHECK_DISABLE) there are no warnings
and no stall shutdown time, but `silence` still holds: the setting quiets
the reports of slow ranks, and a stopped one would otherwise hang the job
for good.

`period` is a quarter of the shortest of the times, at most 1 s. The
classes here are plain Python with an injectable clock; background.py sends
and receives the messages.
"""

import time

from coordinator.ops_names import describe, format_ranks

MAX_PERIOD = 1.0
MIN_PERIOD = 0.05


def watch_times(check_time, shutdown_time, disabled):
    """(check time, shutdown time) in force: none with stall checks off."""
    return (0.0, 0.0) if disabled else (check_time, shutdown_time)


def watch_period(check_time, shutdown_time, disabled=False, silence=0.0, deadlock=0.0):
    """Seconds between reports and pings, or None when nothing is watched
    (no times, or stall checks off and no silence or deadlock limit)."""
    times = [t for t in (*watch_times(check_time, shutdown_time, disabled), silence, deadlock)
             if t > 0]
    if not times:
        return None
    return max(MIN_PERIOD, min(MAX_PERIOD, min(times) / 4))


def _fatal(text, silent, shutdown_time, silence):
    """The StallError's text once `silent` has reached the stall shutdown
    time or the silence limit (whichever is set and shorter), else None."""
    limits = [(t, why) for t, why in (
        (shutdown_time, "the stall shutdown time of {:g} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)"),
        (silence, "{:g} s (COORDINATOR_SILENT_RANK_SECONDS)")) if t > 0]
    for limit, why in sorted(limits, key=lambda item: item[0]):
        if silent >= limit:
            return f"Stalled{text}; failed after {why.format(limit)}"
    return None


def _members(pset, pair, members_of):
    """The ranks that take part in a collective: a send/recv's `pair`, or
    its set's ranks (`members_of(pset)`, None when unknown)."""
    return tuple(pair) or (members_of(pset) if members_of is not None else None) or ()


class InsideText(str):
    """What the watchdog says a rank is inside (`Watchdog.inside`), with
    `waiting_for`: the silent ranks that text names, so a stall text does not
    name them twice."""

    waiting_for = frozenset()


def _what(pset, name, op):
    where = f" in process set {pset}" if pset else ""
    return f"{describe(op, name)}{where}"


class InFlightOp:
    """A collective some rank has had in flight since `started`; `seq` is its
    place among the operations of its lane (the set's communicator on
    `device`), from 1; 0 where it is not counted. A send/recv has its two
    ranks as `pair`: only they take part, and its seq counts the send/recvs
    between them."""

    __slots__ = ("process_set_id", "name", "op", "started", "ranks", "device", "seq", "pair")

    def __init__(self, process_set_id, name, op, started, ranks=(), device=-1, seq=0, pair=()):
        self.process_set_id = process_set_id
        self.name = name
        self.op = op
        self.started = started
        self.ranks = set(ranks)  # ranks known to be running it
        self.device = device
        self.seq = seq
        self.pair = tuple(pair)

    @property
    def lane(self):
        return (self.process_set_id, self.device) + self.pair

    def members(self, members_of):
        """The ranks that take part in it."""
        return _members(self.process_set_id, self.pair, members_of)

    def describe(self):
        if self.name.startswith("("):  # not a tensor: the negotiation itself
            return self.name
        return _what(self.process_set_id, self.name, self.op)


class Watchdog:
    """Rank 0's side: which members of in-flight collectives stopped answering."""

    def __init__(self, rank, check_time, shutdown_time, disabled=False, clock=time.monotonic,
                 silence=0.0, deadlock=0.0):
        self.rank = rank
        self.check_time, self.shutdown_time = watch_times(check_time, shutdown_time, disabled)
        self.silence = silence
        self.period = watch_period(check_time, shutdown_time, disabled, silence, deadlock)
        self.clock = clock
        self._heard = {}  # rank -> when rank 0 last heard from it
        self._silent_since = {}  # rank -> first ping it has not answered
        self._pinged = {}  # rank -> last ping
        self._reports = {}  # rank -> (when, [(pset, name, op, seconds, device, seq[, pair])])
        self._positions = {}  # rank -> (when, {lane: operations started there})
        self._absent_since = {}  # (rank, lane, seq) -> first seen not to have started it
        self._warned = {}  # rank -> last warning about it
        self._blocked = {}  # rank -> (when, seconds it had been blocked then)
        self.silent = False  # the fatal text inspect returned is about a silent rank

    @property
    def enabled(self):
        return self.period is not None

    def heard(self, rank, now=None):
        now = self.clock() if now is None else now
        self._heard[rank] = now
        self._silent_since.pop(rank, None)

    def report(self, rank, items, now=None, positions=None, blocked=0.0):
        """`rank`'s collectives in flight for a while: (process set, name, op,
        seconds, device, seq[, pair]) each (pair: a send/recv's two ranks);
        replaces its previous report. `positions`: {(process set, device):
        operations it started there, (process set, device, a, b):
        send/recvs between ranks a and b}. `blocked`: how long every thread
        that submits there has been waiting, with nothing in flight there."""
        now = self.clock() if now is None else now
        self.heard(rank, now)
        self._blocked[rank] = (now, blocked)
        if items:
            self._reports[rank] = (now, list(items))
        else:
            self._reports.pop(rank, None)
        if positions is not None:
            self._positions[rank] = (now, dict(positions))

    def _long_ops(self, now, own):
        ops = {}

        def running(rank, pset, name, op, started, device, seq, pair=()):
            pair = tuple(pair)
            item = ops.setdefault((pset, name, device, seq, pair),
                                  InFlightOp(pset, name, op, started, (), device, seq, pair))
            item.started = min(item.started, started)
            item.ranks.add(rank)

        for pset, name, op, started, *where in own:
            if now - started >= self.period:
                running(self.rank, pset, name, op, started, *where)
        for rank, (when, items) in list(self._reports.items()):
            if now - when > 3 * self.period:  # no report since: it finished them
                del self._reports[rank]
                continue
            for pset, name, op, seconds, *where in items:
                running(rank, pset, name, op, when - seconds, *where)
        return [op for op in ops.values() if now - op.started >= self.period]

    def inspect(self, own, members_of, now=None, own_positions=None):
        """Looks at the collectives in flight: `own` lists rank 0's as
        (process set, name, op, start time, device, seq[, pair]);
        `members_of(pset)` gives a set's ranks; `own_positions` is rank 0's
        count of operations started per lane (and pair). Returns (ranks to
        ping now, warning texts, fatal text or None)."""
        now = self.clock() if now is None else now
        pings, suspects = set(), {}
        if not self.enabled:
            return pings, [], None
        absent, absent_since = {}, {}
        for op in self._long_ops(now, own):
            for member in op.members(members_of):
                heard = now - self._heard.get(member, -1e18) if member != self.rank else 0.0
                if heard >= self.period:
                    self._ping(member, now, pings)
                    silent = now - self._silent_since.setdefault(member, now)
                    suspects.setdefault(member, []).append((op, silent))
                # Reports come every period or so: one a little late is no
                # reason to forget how long a member has been behind.
                if heard < 3 * self.period:
                    self._check_started(member, op, now, own_positions, pings, absent,
                                        absent_since)
        self._absent_since = absent_since
        warnings, fatal = [], None
        texts = [(rank, items, self._text) for rank, items in sorted(suspects.items())]
        # A member silent for a while explains the others' waits first.
        if not any(silent >= 3 * self.period for items in suspects.values()
                   for _, silent in items):
            texts += [(rank, items, self._absent_text) for rank, items in sorted(absent.items())]
        for rank, items, say in texts:
            # The collective it holds up says more than the cycle it misses.
            op, silent = max(items, key=lambda item: (not item[0].name.startswith("("),
                                                      now - item[0].started))
            text = say(rank, op, silent, now)
            ends = _fatal(" " + text, silent, self.shutdown_time, self.silence)
            if ends:
                if fatal is None:
                    fatal, self.silent = ends, say == self._text
            elif self.check_time > 0 and silent >= self.check_time:
                last = self._warned.get(rank)
                if last is None or now - last >= self.check_time:
                    self._warned[rank] = now
                    warnings.append(text)
        return pings, warnings, fatal

    def blocked_for(self, rank, now=None):
        """How long `rank` has been blocked (handles.HandleTable.
        blocked_seconds), from its last report; 0 without a recent one (it
        reports every period while it waits)."""
        now = self.clock() if now is None else now
        when, seconds = self._blocked.get(rank, (None, 0.0))
        if when is None or seconds <= 0 or now - when > 3 * self.period:
            return 0.0
        return seconds + (now - when)

    def inside(self, rank, own, now=None, members_of=None):
        """The collective `rank` has been in the longest, for more than a
        period (rank 0's from `own`, the others' from their last reports), as
        "allreduce of tensor 'x' for 3.0 s", and, given `members_of(pset)`,
        the members holding it up that have not answered for a period (",
        waiting for rank 2, which has not answered for 5.0 s"): the stall
        inspector's error about a tensor `rank` never submitted then names
        the stopped rank behind it too; None if none (negotiation cycles
        are not collectives here: waiting in one is what a stall looks like)."""
        now = self.clock() if now is None else now
        if not self.enabled:
            return None
        if rank == self.rank:
            items = [(pset, name, op, now - started, *where)
                     for pset, name, op, started, *where in own]
        else:
            when, reported = self._reports.get(rank, (None, ()))
            if when is None or now - when > 3 * self.period:
                return None
            items = [(pset, name, op, seconds + now - when, *where)
                     for pset, name, op, seconds, *where in reported]
        items = [item for item in items if not item[1].startswith("(") and
                 item[3] >= self.period]
        if not items:
            return None
        pset, name, op, seconds, *where = max(items, key=lambda item: item[3])
        silent = self._held_up_by(where, pset, members_of, now)
        said = ", ".join(f"rank {rank}, which has not answered for {quiet:.1f} s"
                         for rank, quiet in silent)
        text = InsideText(f"{_what(pset, name, op)} for {seconds:.1f} s"
                          + (f", waiting for {said}" if said else ""))
        text.waiting_for = frozenset(rank for rank, _ in silent)
        return text

    def silent_ranks(self, now=None):
        """{rank: seconds} of the ranks that have left rank 0's pings
        unanswered for a period or more (pings still being sent: a
        collective in flight still waits for them)."""
        now = self.clock() if now is None else now
        if not self.enabled:
            return {}
        return {rank: now - since for rank, since in self._silent_since.items()
                if now - since >= self.period
                and now - self._pinged.get(rank, -1e18) <= 3 * self.period}

    def _held_up_by(self, where, pset, members_of, now):
        """[(rank, seconds)] of the members of a collective (a send/recv's
        pair, or its set's ranks) that have not answered rank 0's pings for
        a period."""
        members = _members(pset, where[2] if len(where) > 2 else (), members_of)
        return sorted((rank, quiet) for rank, quiet in self.silent_ranks(now).items()
                      if rank in members)

    def _ping(self, member, now, pings):
        if now - self._pinged.get(member, -1e18) >= self.period:
            pings.add(member)
            self._pinged[member] = now

    def _check_started(self, member, op, now, own_positions, pings, absent, absent_since):
        """Notes `member` (which answers) in `absent` if it has not started
        `op`, a counted operation others have had in flight for a while."""
        if not op.seq or member in op.ranks:
            return
        if member == self.rank:
            positions = own_positions
        else:
            when, positions = self._positions.get(member, (None, None))
            if when is None or now - when >= 2 * self.period:
                self._ping(member, now, pings)  # its answer brings its count
                return
        if positions is None or positions.get(op.lane, 0) >= op.seq:
            return
        key = (member, op.lane, op.seq)
        since = absent_since[key] = self._absent_since.get(key, now)
        absent.setdefault(member, []).append((op, now - since))

    def _absent_text(self, rank, op, absent, now):
        _, doing = self._reports.get(rank, (None, ()))
        where = (f"; it is running {', '.join(self._describe_item(i) for i in doing)}"
                 if doing and rank != self.rank else "")
        return (f"{op.describe()}: rank {rank} answers but has not started it (operation "
                f"{op.seq} of its communicator) in {absent:.1f} s, while it was in flight "
                f"for {now - op.started:.1f} s on {format_ranks(op.ranks)}{where} (the ranks "
                "disagree on what runs: a bug in the coordinator, please report it)")

    @staticmethod
    def _describe_item(item):
        pset, name, op = item[:3]
        return name if name.startswith("(") else _what(pset, name, op)

    @staticmethod
    def _text(rank, op, silent, now):
        return (f"{op.describe()}: rank {rank} has not answered for {silent:.1f} s while "
                f"it was in flight for {now - op.started:.1f} s on "
                f"{format_ranks(op.ranks)} (rank {rank} is stopped, or its coordinator "
                "thread cannot run)")


class CoordinatorWatch:
    """A worker's side: reports while busy, and notices rank 0 going silent."""

    def __init__(self, check_time, shutdown_time, disabled=False, clock=time.monotonic,
                 silence=0.0, deadlock=0.0):
        self.check_time, self.shutdown_time = watch_times(check_time, shutdown_time, disabled)
        self.silence = silence
        self.period = watch_period(check_time, shutdown_time, disabled, silence, deadlock)
        self.clock = clock
        self._busy_since = None
        self._last_report = None
        self._unanswered_since = None
        self._warned = None
        self.reported_ops = False  # the last report listed collectives

    @property
    def enabled(self):
        return self.period is not None

    def heard(self):
        """Rank 0 sent something: it is alive."""
        self._unanswered_since = None

    def report_due(self, busy, now=None):
        """True when a report should go to rank 0 now. `busy`: this rank has
        work in flight."""
        if not self.enabled:
            return False
        now = self.clock() if now is None else now
        if not busy:
            self._busy_since = None
            self._unanswered_since = None
            return self.reported_ops  # one empty report clears rank 0's view
        if self._busy_since is None:
            self._busy_since = now
        if now - self._busy_since < self.period:
            return False
        return self._last_report is None or now - self._last_report >= self.period

    def sent_report(self, listed_ops, now=None):
        now = self.clock() if now is None else now
        self._last_report = now
        self.reported_ops = bool(listed_ops)
        if self._unanswered_since is None:
            self._unanswered_since = now

    def inspect(self, waiting_for, now=None):
        """(warning text or None, fatal text or None) about rank 0 not
        answering; `waiting_for` describes this rank's oldest work."""
        if not self.enabled or self._unanswered_since is None:
            return None, None
        now = self.clock() if now is None else now
        silent = now - self._unanswered_since
        if silent < self.period:
            return None, None
        text = (f"rank 0 (the coordinator) has not answered for {silent:.1f} s while "
                f"{waiting_for} was in flight (rank 0 is stopped, or its coordinator thread "
                "cannot run)")
        ends = _fatal(": " + text, silent, self.shutdown_time, self.silence)
        if ends:
            return None, ends
        if self.check_time > 0 and silent >= self.check_time:
            if self._warned is None or now - self._warned >= self.check_time:
                self._warned = now
                return text, None
        return None, None


# A rank's own watch that did not run for this many periods (it looks every
# half period or so; the process was stopped, or a long C call held the
# interpreter lock) heard nothing then, through no fault of its peers: that
# time is not counted as silence. (At 3, a rank stopped for 2.7 s warned,
# once continued, that rank 0 had not answered for 2.7 s.)
PAUSE_PERIODS = 1


class Heartbeat:
    """Liveness whether or not anything is in flight: the watchdog above
    watches only the members of collectives in flight, so a rank stopped
    while the others waited in MPI calls of the program's own (a raw
    `MPI.COMM_WORLD.Barrier()`, ChainerMN's `comm.mpi_comm`) was never
    noticed, and they waited there for good.

    Rank 0 sends every worker a heartbeat every `period`; each answers at
    once (any message counts as heard). Rank 0 that has heard nothing from a
    worker for `silence` seconds (COORDINATOR_SILENT_RANK_SECONDS), or a
    worker nothing from rank 0, fails the job, and the caller releases the
    program's own communicators. Rank 0 warns at `check_time` while it has
    nothing in flight (with work in flight the watchdog names the
    collective). Time in which this rank's own thread did not run is not
    counted (PAUSE_PERIODS)."""

    def __init__(self, rank, size, silence, check_time=0.0, clock=time.monotonic):
        self.rank = rank
        self.silence = silence
        self.check_time = check_time
        self.period = watch_period(0.0, 0.0, True, silence) if size > 1 else None
        self.clock = clock
        now = clock()
        self._heard = {r: now for r in (range(1, size) if rank == 0 else (0,))}
        self._tick = now
        self._next_beat = now
        self._warned = {}

    @property
    def enabled(self):
        return self.period is not None

    def heard(self, rank, now=None):
        if rank in self._heard:
            self._heard[rank] = self.clock() if now is None else now

    def beat_due(self, now=None):
        """Rank 0: whether to send the workers a heartbeat now."""
        if not self.enabled or self.rank != 0:
            return False
        now = self.clock() if now is None else now
        if now < self._next_beat:
            return False
        self._next_beat = now + self.period
        return True

    def inspect(self, busy=False, now=None):
        """(warning texts, fatal text or None) about silent peers. `busy`:
        this rank has work in flight (rank 0 then leaves warnings to the
        watchdog)."""
        if not self.enabled:
            return [], None
        now = self.clock() if now is None else now
        gap, self._tick = now - self._tick, now
        if gap > PAUSE_PERIODS * self.period:
            for rank, when in self._heard.items():
                self._heard[rank] = min(now, when + gap)
        quiet = sorted(((now - when, rank) for rank, when in self._heard.items()
                        if now - when >= self.period), reverse=True)
        if quiet and quiet[0][0] >= self.silence:
            # Every rank silent for half the limit too is named: one stopped
            # rank can hold up the MPI traffic of another (two ranks of a
            # host, one stopped, the other unheard for as long on the other
            # host: measured), and rank 0 cannot tell which of them is the
            # stopped one. (A rank that answers is silent for up to a period
            # between heartbeats; the one past the limit is always named.)
            least = min(self.silence, max(self.silence / 2, 3 * self.period))
            named = [q for q in quiet if q[0] >= least]
            return [], _fatal(": " + self._text(named), quiet[0][0], 0.0, self.silence)
        warnings = []
        for silent, rank in quiet:
            if self.check_time > 0 and silent >= self.check_time and not busy:
                last = self._warned.get(rank)
                if last is None or now - last >= self.check_time:
                    self._warned[rank] = now
                    warnings.append(self._text([(silent, rank)]))
        return warnings, None

    @staticmethod
    def _text(quiet):
        """What the ranks in `quiet`, (seconds silent, rank) each, longest
        first, did not do."""
        if len(quiet) == 1:
            silent, rank = quiet[0]
            who = "rank 0 (the coordinator)" if rank == 0 else f"rank {rank}"
            return (f"{who} has not answered for {silent:.1f} s (rank {rank} is stopped, or its "
                    "coordinator thread cannot run)")
        each = ", ".join(f"rank {rank} for {silent:.1f} s" for silent, rank in quiet)
        return (f"{len(quiet)} ranks have not answered: {each} (one or more is stopped, or "
                "its coordinator thread cannot run; on a host with fewer cores than busy "
                "processes, ranks spinning in MPI calls can keep another off the CPU)")
