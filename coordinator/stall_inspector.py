"""The stall inspector: tensors some ranks submitted and others never did.

Rank 0 runs it over the negotiations still open. After `check_time` seconds it
warns, naming each tensor, the ranks that have not submitted it and how long
the others have waited. After `shutdown_time` seconds (0: never) the stalled
operations are failed on every rank that submitted them, and ranks that submit
them later get the same error. A missing rank known to be inside a long
collective (the watchdog's reports) is said to be: it cannot submit anything
until that one ends, which is then the place to look.

A deadlock is told apart from slow ranks: ranks blocked waiting for
results (every thread that submits work there waits, and nothing is in
flight there: from the watchdog's reports), each for tensors only the
others of them could submit, will never move (`waiting_on_each_other`).
They called collectives in different orders or under different conditions
(rank 0 waits on 'a', which rank 1 skipped, while rank 1 waits on 'b').
The warnings say so, and after `deadlock_time` (COORDINATOR_DEADLOCK_SECONDS,
stall checks on or off) their stalled operations fail on every rank that
submitted them, each error naming every wait of the deadlock. Horovod
warns about such a job for ever.
"""

from coordinator.ops_names import describe, format_ranks


class Stall:
    __slots__ = ("key", "name", "op", "missing", "submitted", "waited", "inside", "deadlocked",
                 "silent")

    def __init__(self, key, op, missing, submitted, waited, inside=None, silent=None):
        self.key = key  # (process set id, tensor name)
        self.name = key[1]
        self.op = op
        self.missing = missing
        self.submitted = submitted
        self.waited = waited
        self.inside = inside or {}  # missing rank -> the long collective it is in
        self.silent = silent or {}  # rank -> seconds it has not answered rank 0
        self.deadlocked = False

    def describe(self):
        where = f" in process set {self.key[0]}" if self.key[0] else ""
        inside = "".join(f"; rank {rank} has been inside {what}"
                         for rank, what in sorted(self.inside.items()))
        # Ranks that stopped answering explain the wait, wherever they are:
        # a missing rank may be held up in another set's collective by one.
        told = set().union(*(getattr(what, "waiting_for", ()) for what in self.inside.values()))
        silent = "".join(f"; rank {rank} has not answered for {quiet:.1f} s"
                         for rank, quiet in sorted(self.silent.items()) if rank not in told)
        return (f"{describe(self.op, self.name)}{where}: "
                f"{format_ranks(self.missing)} "
                f"did not submit it{inside}{silent}; {format_ranks(self.submitted)} "
                f"{'has' if len(self.submitted) == 1 else 'have'} waited {self.waited:.1f} s")


# Ranks waiting on each other for this long are said to in a stall warning
# (a wait shorter than this may be a rank between two submissions).
DEADLOCK_NOTICE = 1.0
# How many of a deadlock's other waits an error names.
DEADLOCK_SHOWN = 4


class StallInspector:
    def __init__(self, check_time, shutdown_time, disabled=False, deadlock_time=0.0):
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self.disabled = disabled or (check_time <= 0 and shutdown_time <= 0)
        self.deadlock_time = deadlock_time
        self._warned = {}  # key -> time of the last warning
        # At the last inspect: the ranks waiting on each other for at least
        # DEADLOCK_NOTICE, and for how long all of them had been.
        self.stuck_ranks, self.stuck = (), 0.0

    @property
    def idle(self):
        """Nothing to look for: no warnings, no stall shutdown, no deadlocks."""
        return self.disabled and self.deadlock_time <= 0

    def next_check(self, now):
        """Seconds until the inspector could next have something to say."""
        times = [t for t in (self.check_time, self.shutdown_time) if t > 0 and not self.disabled]
        if self.deadlock_time > 0:
            times.append(self.deadlock_time)
        return min(times) / 4 if times else None

    def inspect(self, now, negotiations, inside=None, blocked=None, silent=None):
        """Look at the open negotiations.

        `negotiations` yields ((process set, name), op, first_submit_time,
        submitted ranks, missing ranks); `inside(rank)` says which long
        collective a rank is in, or None; `blocked` maps ranks to how long
        each has been blocked waiting, with nothing in flight (absent: not
        blocked); `silent` maps ranks to how long each has not answered
        rank 0's pings (the watchdog's). Returns (warnings, expired): stalls
        to warn about now, and
        stalls past the shutdown time or deadlocked for the deadlock time
        (`Stall.deadlocked`).
        """
        warnings, expired = [], []
        self.stuck_ranks, self.stuck = (), 0.0
        if self.idle:
            return warnings, expired
        rows = [row for row in negotiations if row[4]]
        blocked = blocked or {}
        circle = waiting_on_each_other(rows, blocked, DEADLOCK_NOTICE)
        if circle:
            self.stuck_ranks = sorted(circle)
            self.stuck = min(blocked[r] for r in circle)
        stuck = (waiting_on_each_other(rows, blocked, self.deadlock_time)
                 if self.deadlock_time > 0 and circle else set())
        live = set()
        for key, op, first, submitted, missing in rows:
            waited = now - first
            live.add(key)
            stall = Stall(key, op, sorted(missing), sorted(submitted), waited,
                          self._inside(missing, inside), silent)
            if stuck.intersection(submitted):
                stall.deadlocked = True
                expired.append(stall)
                continue
            if self.disabled:
                continue
            if self.shutdown_time > 0 and waited >= self.shutdown_time:
                expired.append(stall)
                continue
            if self.check_time > 0 and waited >= self.check_time:
                last = self._warned.get(key)
                if last is None or now - last >= self.check_time:
                    self._warned[key] = now
                    warnings.append(stall)
        for key in list(self._warned):
            if key not in live:
                del self._warned[key]
        if stuck:
            self.stuck_ranks = sorted(stuck)
            self.stuck = min(blocked[r] for r in stuck)
        return warnings, expired

    @staticmethod
    def _inside(ranks, inside):
        if inside is None:
            return None
        found = {rank: inside(rank) for rank in ranks}
        return {rank: what for rank, what in found.items() if what}

    def _deadlock_text(self):
        ranks = format_ranks(self.stuck_ranks)
        return (f"{ranks} have been waiting for {self.stuck:.1f} s with nothing in flight, "
                "each for tensors only the others could submit: a deadlock (they called "
                "collectives in different orders or under different conditions)")

    def warning_text(self, stalls):
        lines = ["One or more tensors were submitted by some ranks but not by others; "
                 "the ranks that did are waiting:"]
        lines += ["  " + s.describe() for s in stalls]
        if self.stuck_ranks:
            after = (f"; they fail after {self.deadlock_time:g} s of this "
                     "(COORDINATOR_DEADLOCK_SECONDS)" if self.deadlock_time > 0 else "")
            text = self._deadlock_text()
            lines.append(f"  {text[0].upper()}{text[1:]}{after}.")
        if self.shutdown_time > 0:
            lines.append(f"  These operations fail after {self.shutdown_time:g} s "
                         "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).")
        return "\n".join(lines)

    def error_text(self, stall, stalls=()):
        """The error of a stall that expired; `stalls`: every stall that
        expired with it (a deadlock's text names each rank's wait)."""
        if not stall.deadlocked:
            return (f"Stalled {stall.describe()}; failed after the stall shutdown time of "
                    f"{self.shutdown_time:g} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")
        others = [s for s in stalls if s is not stall and s.deadlocked]
        also = ""
        if others:
            # Each rank's own wait first; a step's many gradients only counted.
            mine = set(stall.submitted)
            others.sort(key=lambda s: (not mine.isdisjoint(s.submitted), s.key))
            shown = [s.describe() for s in others[:DEADLOCK_SHOWN]]
            if len(others) > DEADLOCK_SHOWN:
                shown.append(f"and {len(others) - DEADLOCK_SHOWN} more")
            also = "; the others wait on: " + "; ".join(shown)
        return (f"Deadlocked {stall.describe()}; {self._deadlock_text()}{also}; failed "
                f"after {self.deadlock_time:g} s (COORDINATOR_DEADLOCK_SECONDS)")


def waiting_on_each_other(rows, blocked, at_least):
    """The ranks deadlocked on the open negotiations `rows` ((key, op, first,
    submitted, missing) each, missing not empty): the largest set of ranks,
    each blocked for `at_least` seconds (`blocked`), each with some
    submission still open, and each open submission of each waiting only
    for ranks of the set. None of them can submit what the others wait for
    (with nothing in flight, what a blocked rank waits on is one of its open
    submissions), so none will move. Ranks outside it (running, or waiting
    on one that runs) do not matter: a set of ranks can deadlock while the
    others train on."""
    ranks = {rank for rank, seconds in blocked.items() if seconds >= at_least}
    if len(ranks) < 2:
        return set()
    waits = {}
    for _, _, _, submitted, missing in rows:
        for rank in submitted:
            if rank in ranks:
                waits.setdefault(rank, []).append(set(missing))
    ranks = set(waits)
    while True:
        kept = {rank for rank in ranks if all(m <= ranks for m in waits[rank])}
        if kept == ranks:
            return ranks
        ranks = kept
