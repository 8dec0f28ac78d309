"""The stall inspector: tensors some ranks submitted and others never did.

Rank 0 runs it over the negotiations still open. After `check_time` seconds it
warns, naming each tensor, the ranks that have not submitted it and how long
the others have waited. After `shutdown_time` seconds (0: never) the stalled
operations are failed on every rank that submitted them, and ranks that submit
them later get the same error. A missing rank known to be inside a long
collective (the watchdog's reports) is said to be: it cannot submit anything
until that one ends, which is then the place to look.
"""

from coordinator.ops_names import format_ranks, op_name


class Stall:
    __slots__ = ("key", "name", "op", "missing", "submitted", "waited", "inside")

    def __init__(self, key, op, missing, submitted, waited, inside=None):
        self.key = key  # (process set id, tensor name)
        self.name = key[1]
        self.op = op
        self.missing = missing
        self.submitted = submitted
        self.waited = waited
        self.inside = inside or {}  # missing rank -> the long collective it is in

    def describe(self):
        where = f" in process set {self.key[0]}" if self.key[0] else ""
        inside = "".join(f"; rank {rank} has been inside {what}"
                         for rank, what in sorted(self.inside.items()))
        return (f"{op_name(self.op)} of tensor '{self.name}'{where}: "
                f"{format_ranks(self.missing)} "
                f"did not submit it{inside}; {format_ranks(self.submitted)} "
                f"{'has' if len(self.submitted) == 1 else 'have'} waited {self.waited:.1f} s")


class StallInspector:
    def __init__(self, check_time, shutdown_time, disabled=False):
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self.disabled = disabled or (check_time <= 0 and shutdown_time <= 0)
        self._warned = {}  # key -> time of the last warning

    def next_check(self, now):
        """Seconds until the inspector could next have something to say."""
        if self.disabled:
            return None
        times = [t for t in (self.check_time, self.shutdown_time) if t > 0]
        return min(times) / 4 if times else None

    def inspect(self, now, negotiations, inside=None):
        """Look at the open negotiations.

        `negotiations` yields ((process set, name), op, first_submit_time,
        submitted ranks, missing ranks); `inside(rank)` says which long
        collective a rank is in, or None. Returns (warnings, expired): stalls
        to warn about now, and stalls past the shutdown time.
        """
        warnings, expired = [], []
        if self.disabled:
            return warnings, expired
        live = set()
        for key, op, first, submitted, missing in negotiations:
            if not missing:
                continue
            waited = now - first
            live.add(key)
            stall = Stall(key, op, sorted(missing), sorted(submitted), waited,
                          self._inside(missing, inside))
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
        return warnings, expired

    @staticmethod
    def _inside(ranks, inside):
        if inside is None:
            return None
        found = {rank: inside(rank) for rank in ranks}
        return {rank: what for rank, what in found.items() if what}

    @staticmethod
    def warning_text(stalls, shutdown_time):
        lines = ["One or more tensors were submitted by some ranks but not by others; "
                 "the ranks that did are waiting:"]
        lines += ["  " + s.describe() for s in stalls]
        if shutdown_time > 0:
            lines.append(f"  These operations fail after {shutdown_time:g} s "
                         "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).")
        return "\n".join(lines)

    @staticmethod
    def error_text(stall, shutdown_time):
        return (f"Stalled {stall.describe()}; failed after the stall shutdown time of "
                f"{shutdown_time:g} s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")
