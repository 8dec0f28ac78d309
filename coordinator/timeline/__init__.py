"""The timeline: a Chrome trace of what happened to every tensor.

Rank 0 writes it (it sees every rank's requests). Each tensor gets its own row
(a trace "process") holding

- `NEGOTIATE_<OP>`, from the first rank's request to the last, with an instant
  mark `rank R ready` at each rank's own submit time (args: rank, and how long
  after the first rank it came);
- the operation itself (`ALLREDUCE`, ...), args carrying dtype and shape, and
  nested inside it the activities the backend reports: `MEMCPY_IN_FUSION_BUFFER`,
  `MPI_ALLREDUCE`, `MEMCPY_OUT_FUSION_BUFFER`, ...;
- `CYCLE_START` marks when mark_cycles is on.

The background thread only appends tuples to a queue; a writer thread turns
them into JSON. Every write is one `pwrite` of complete events followed by the
closing `]`, which the next write overwrites, so the file is valid JSON at
every moment, even after SIGKILL. One event per line lets the report stream
multi-GB traces.

    python -m coordinator.timeline report TRACE [--top N] [--plot PNG]
"""

import collections
import errno
import json
import os
import threading
import time

from coordinator.ops_names import op_name

FLUSH_PERIOD = 0.1


def _create(path):
    """Opens `path` for writing, truncated. A symbolic link there is refused:
    following it would let whoever planted it (say in /tmp) have rank 0
    truncate any file rank 0 may write."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OSError(errno.ELOOP, "the timeline path is a symbolic link, which is not "
                      "followed; remove it or choose another path", path) from None


class TimelineWriter:
    """Owns the file and the writer thread."""

    def __init__(self, path):
        self.path = path
        self._fd = _create(path)
        self._pos = 0
        self._first = True
        self._queue = collections.deque()
        self._wake = threading.Event()
        self._stop = False
        self._pids = {}
        self._write(b"[")
        self._thread = threading.Thread(target=self._run, name="coordinator-timeline",
                                        daemon=True)
        self._thread.start()

    def put(self, event):
        self._queue.append(event)

    def _write(self, data):
        os.pwrite(self._fd, data + b"\n]\n", self._pos)
        self._pos += len(data)

    def _run(self):
        while True:
            self._wake.wait(FLUSH_PERIOD)
            self._wake.clear()
            self._drain()
            if self._stop:
                self._drain()
                return

    def _drain(self):
        if not self._queue:
            return
        lines = []
        queue = self._queue
        while queue:
            lines.extend(self._format(queue.popleft()))
        if not lines:
            return
        sep = b"\n" if self._first else b",\n"
        self._first = False
        self._write(sep + ",\n".join(lines).encode())

    def _pid(self, name, lines):
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            lines.append(json.dumps({"name": "process_name", "ph": "M", "pid": pid,
                                     "args": {"name": name}}, separators=(",", ":")))
            lines.append(json.dumps({"name": "process_sort_index", "ph": "M", "pid": pid,
                                     "args": {"sort_index": pid}}, separators=(",", ":")))
        return pid

    def _format(self, event):
        kind, ts, names, label, args = event
        dur = None
        if kind == "X":  # a complete event: its duration travels in args
            args = dict(args)
            dur = round(args.pop("dur"), 3)
        lines = []
        for name in names:
            record = {"name": label, "ph": kind, "ts": round(ts, 3),
                      "pid": self._pid(name, lines), "tid": 0}
            if kind == "i":
                record["s"] = "p"
            if dur is not None:
                record["dur"] = dur
            if args:
                record["args"] = args
            lines.append(json.dumps(record, separators=(",", ":")))
        return lines

    def close(self):
        self._stop = True
        self._wake.set()
        self._thread.join(5)
        os.close(self._fd)


class Timeline:
    """The hooks the background thread calls; a no-op unless started.

    Times are microseconds since the epoch, so submit times reported by other
    ranks (wall clock) line up with rank 0's events."""

    def __init__(self):
        self._writer = None
        self.enabled = False
        self.mark_cycles = False
        self._negotiating = {}  # name -> (op, first submit time)

    def start(self, path, mark_cycles=False):
        self.stop()
        self._writer = TimelineWriter(path)
        self.mark_cycles = mark_cycles
        self.enabled = True

    def stop(self):
        self.enabled = False
        writer, self._writer = self._writer, None
        self._negotiating.clear()
        if writer is not None:
            writer.close()

    close = stop

    @property
    def path(self):
        return self._writer.path if self._writer is not None else None

    def _put(self, kind, ts, names, label, args=None):
        writer = self._writer
        if writer is not None:
            writer.put((kind, ts, names, label, args))

    @staticmethod
    def _now():
        return time.time() * 1e6

    # -- negotiation (controller, rank 0) --------------------------------
    def negotiate_start(self, name, op, request, submit_time=0.0):
        """The first request for `name` arrived; the negotiation is drawn from
        that rank's submit time."""
        now = self._now()
        start = min(submit_time * 1e6, now) if submit_time else now
        self._negotiating[name] = [op, None]
        self._put("B", start, (name,), f"NEGOTIATE_{op_name(op).upper()}")

    def negotiate_rank_ready(self, name, rank, submit_time):
        state = self._negotiating.get(name)
        ts = submit_time * 1e6 if submit_time else self._now()
        args = {"rank": rank}
        if state is not None:
            if state[1] is None:
                state[1] = ts
            args["after_first_ms"] = round((ts - state[1]) / 1e3, 3)
        self._put("i", ts, (name,), f"rank {rank} ready", args)

    def negotiate_end(self, name):
        self._negotiating.pop(name, None)
        self._put("E", self._now(), (name,), "")

    # -- execution (background thread) -------------------------------------
    def op_start(self, names, response, entries):
        now = self._now()
        label = op_name(response.op).upper()
        for name, entry in zip(names, entries):
            args = None
            if entry is not None and entry.dtype_info is not None:
                args = {"dtype": entry.dtype_info.name, "shape": list(entry.shape)}
            self._put("B", now, (name,), label, args)

    def op_end(self, names):
        self._put("E", self._now(), tuple(names), "")

    def activity_start(self, names, activity):
        """Starts `activity`; returns its timestamp (microseconds of now())."""
        now = self._now()
        self._put("B", now, tuple(names), activity)
        return now

    def activity_end(self, names):
        self._put("E", self._now(), tuple(names), "")

    def now(self):
        """The timeline's clock, in microseconds."""
        return self._now()

    def span(self, names, activity, start, end):
        """A finished activity from `start` to `end` (microseconds of now()),
        e.g. device work timed by CUDA events."""
        self._put("X", start, tuple(names), activity, {"dur": max(0.0, end - start)})

    def mark_cycle(self):
        if self.mark_cycles:
            self._put("i", self._now(), ("CYCLE",), "CYCLE_START")



