"""Which hosts an elastic job may use: discovery, blacklisting, cooldown.

Plain Python with an injectable clock, so the driver's policy is tested
without processes or MPI.

- A discovery (`DiscoveryScript`, `FixedHosts`) names the hosts that exist
  now and their slots. The script is horovodrun's: one `host` or
  `host:slots` per line on stdout; a failing script fails the job on its
  first run and is retried after that.
- `HostManager` keeps the hosts in a stable order (the oldest host first, so
  ranks move as little as possible) and blacklists a host when a worker on
  it fails, as Horovod does. Without a cooldown range a blacklisted host is
  out for the rest of the job; with `cooldown_range=(low, high)` it comes
  back after a cooldown that doubles with each blacklisting (with jitter),
  between low and high seconds.
"""

import dataclasses
import logging
import random
import subprocess
import time
from typing import Dict, List, Optional, Tuple

log = logging.getLogger("coordinator.elastic")

# Horovod's bounds on --blacklist-cooldown-range.
COOLDOWN_LOWEST = 1
COOLDOWN_HIGHEST = 3600
# Seconds a discovery script may run.
DISCOVERY_TIMEOUT = 60

# Horovod's HostUpdateResult bits.
NO_UPDATE = 0
REMOVED = 1
ADDED = 2


def parse_discovery_output(text: str, default_slots: Optional[int]) -> Dict[str, int]:
    """{host: slots} from a discovery script's stdout; raises ValueError
    naming the line that is neither `host` nor `host:slots`."""
    hosts = {}
    for line in text.splitlines():
        item = line.strip()
        if not item:
            continue
        host, sep, slots = item.rpartition(":")
        if not sep:
            host, slots = item, None
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"discovery output line {line!r} is not host or host:slots")
        if slots is None:
            if default_slots is None:
                raise ValueError(f"discovery output line {line!r} gives no slots; print "
                                 "host:slots or pass --slots-per-host")
            count = default_slots
        elif slots.isdigit():
            count = int(slots)
        else:
            raise ValueError(f"discovery output line {line!r}: slots must be a "
                             "non-negative integer")
        hosts[host] = count
    return hosts


class DiscoveryScript:
    def __init__(self, script: str, default_slots: Optional[int] = None):
        self.script = script
        self.default_slots = default_slots

    def find(self) -> Dict[str, int]:
        """Runs the script; raises RuntimeError if it fails."""
        try:
            out = subprocess.run(self.script, shell=True, capture_output=True, text=True,
                                 timeout=DISCOVERY_TIMEOUT, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"host discovery script {self.script!r} ran for more than "
                               f"{DISCOVERY_TIMEOUT} s") from None
        except OSError as exc:
            raise RuntimeError(f"cannot run host discovery script {self.script!r}: "
                               f"{exc.strerror}") from None
        if out.returncode != 0:
            raise RuntimeError(f"host discovery script {self.script!r} exited with status "
                               f"{out.returncode}: {out.stderr.strip()[-500:]}")
        try:
            return parse_discovery_output(out.stdout, self.default_slots)
        except ValueError as exc:
            raise RuntimeError(f"host discovery script {self.script!r}: {exc}") from None


class FixedHosts:
    def __init__(self, host_slots: Dict[str, int]):
        self.host_slots = dict(host_slots)

    def find(self) -> Dict[str, int]:
        return dict(self.host_slots)


def validate_cooldown_range(cooldown_range):
    if cooldown_range is None:
        return None
    low, high = cooldown_range
    if low < COOLDOWN_LOWEST:
        raise ValueError(f"--blacklist-cooldown-range: the lower limit {low} is below "
                         f"{COOLDOWN_LOWEST} s")
    if high > COOLDOWN_HIGHEST:
        raise ValueError(f"--blacklist-cooldown-range: the upper limit {high} is above "
                         f"{COOLDOWN_HIGHEST} s")
    if low > high:
        raise ValueError(f"--blacklist-cooldown-range: {low} {high} is not a range (low "
                         "first)")
    return (low, high)


@dataclasses.dataclass
class HostRecord:
    failures: int = 0
    blacklistings: int = 0
    blacklisted: bool = False
    until: float = 0.0  # end of the cooldown; 0: none (for good, if blacklisted)


class HostManager:
    """The hosts the job may use now, in assignment order."""

    def __init__(self, discovery, cooldown_range=None, clock=time.monotonic,
                 rng: Optional[random.Random] = None):
        self.discovery = discovery
        self.cooldown_range = validate_cooldown_range(cooldown_range)
        self.clock = clock
        self.rng = rng or random.Random()
        self.host_slots: Dict[str, int] = {}
        self.order: List[str] = []
        self.records: Dict[str, HostRecord] = {}

    def _record(self, host):
        return self.records.setdefault(host, HostRecord())

    def find(self) -> Dict[str, int]:
        """Runs the discovery; raises RuntimeError if it fails."""
        return self.discovery.find()

    def update(self, found: Dict[str, int]) -> Tuple[int, bool]:
        """Takes what the discovery `found` and ends cooldowns that have
        passed. Returns (update bits, whether anything changed)."""
        revived = self._end_cooldowns()
        bits = NO_UPDATE
        for host, slots in self.host_slots.items():
            if found.get(host, 0) < slots:
                bits |= REMOVED
        for host, slots in found.items():
            if slots > self.host_slots.get(host, 0):
                bits |= ADDED
        if revived:
            bits |= ADDED
        changed = found != self.host_slots or bool(revived)
        self.host_slots = found
        self.order = [h for h in self.order if h in found] + sorted(
            h for h in found if h not in self.order)
        return bits, changed

    def _end_cooldowns(self):
        now = self.clock()
        revived = []
        for host, rec in self.records.items():
            if rec.blacklisted and rec.until and rec.until <= now:
                rec.blacklisted = False
                rec.until = 0.0
                revived.append(host)
                log.warning("host %s is back from the blacklist after its cooldown", host)
        return revived

    def record_failure(self, host):
        """A worker on `host` failed: blacklist it (again)."""
        rec = self._record(host)
        rec.failures += 1
        if rec.blacklisted:
            return
        rec.blacklisted = True
        rec.blacklistings += 1
        if self.cooldown_range is None:
            log.warning("blacklisted host %s after a worker on it failed (no "
                        "--blacklist-cooldown-range: for the rest of the job)", host)
            return
        low, high = self.cooldown_range
        delay = low * (1 << rec.blacklistings) + self.rng.uniform(0, 1) * low
        delay = max(low, min(high, delay))
        rec.until = self.clock() + delay
        log.warning("blacklisted host %s after a worker on it failed (failure %d); it may "
                    "come back in %.1f s", host, rec.failures, delay)

    def is_blacklisted(self, host) -> bool:
        rec = self.records.get(host)
        return rec is not None and rec.blacklisted

    def available(self) -> List[Tuple[str, int]]:
        """(host, slots) the job may use now, in assignment order."""
        return [(h, self.host_slots[h]) for h in self.order
                if self.host_slots.get(h, 0) > 0 and not self.is_blacklisted(h)]

    def available_slots(self) -> int:
        return sum(slots for _, slots in self.available())

    def next_cooldown_end(self) -> Optional[float]:
        ends = [r.until for r in self.records.values() if r.blacklisted and r.until]
        return min(ends) if ends else None
