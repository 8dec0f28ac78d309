"""Who was late: a report over a coordinator timeline.

    python -m coordinator.timeline report TRACE [--top N] [--plot PNG]

It reads the trace one event per line (as the writer writes it), so memory
grows with the number of tensors and steps, not with the file's size. For
every negotiation it takes each rank's submit time: the ranks that came last
are late, and the others waited for them from the first submission to the
last. It prints

- the top stalls: tensor, late rank(s), how long the others waited;
- each rank's total lateness (the time the first rank waited for it, summed);
- the share of wall-clock time spent negotiating, copying in and out of
  fusion buffers, and communicating;

and with --plot draws the negotiations over time, each rank's arrival, and
the late ranks marked.
"""

import argparse
import heapq
import json
import sys

PLOT_LIMIT = 400
# A negotiation whose ranks arrived within this many microseconds of each
# other had no late rank: that spread is the control plane's own latency.
LATE_THRESHOLD = 200.0


def iter_events(path):
    """Yields the trace's events, one JSON object per line."""
    with open(path, "rb") as f:
        for raw in f:
            line = raw.strip()
            if line.endswith(b","):
                line = line[:-1]
            if not line or line in (b"[", b"]"):
                continue
            if line.startswith(b"["):
                line = line[1:]
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash mid-write


class _Union:
    """Total length of a union of intervals, merged in bounded batches."""

    def __init__(self):
        self._pending = []
        self._merged = []

    def add(self, start, end):
        self._pending.append((start, end))
        if len(self._pending) > 200000:
            self._compact()

    def _compact(self):
        items = sorted(self._merged + self._pending)
        merged = []
        for s, e in items:
            if merged and s <= merged[-1][1]:
                if e > merged[-1][1]:
                    merged[-1][1] = e
            else:
                merged.append([s, e])
        self._merged = merged
        self._pending = []

    def total(self):
        self._compact()
        return sum(e - s for s, e in self._merged)


def _category(label):
    if label.startswith("NEGOTIATE_"):
        return "negotiation"
    if label.startswith("MEMCPY_"):
        return "fusion copies"
    if label.startswith(("MPI_", "NCCL_", "ADASUM", "GLOO_")):
        return "communication"
    return None


class Report:
    def __init__(self, top=10, plot_limit=PLOT_LIMIT):
        self.top = top
        self.plot_limit = plot_limit
        self.names = {}  # pid -> tensor name
        self.stack = {}  # pid -> [(label, ts)] of open B events
        self.open_neg = {}  # pid -> {"start": ts, "ready": {rank: ts}}
        self.events = 0
        self.first_ts = None
        self.last_ts = None
        self.negotiations = 0
        self.stalls = []  # heap of (wait, seq, record), the largest `top` kept
        self.plot_items = []  # heap of the largest waits kept for the plot
        self.lateness = {}  # rank -> [total us, times late, negotiations]
        self.shares = {"negotiation": _Union(), "fusion copies": _Union(),
                       "communication": _Union()}
        self._seq = 0

    def feed(self, ev):
        self.events += 1
        ph = ev.get("ph")
        pid = ev.get("pid")
        if ph == "M":
            if ev.get("name") == "process_name":
                self.names[pid] = ev.get("args", {}).get("name", str(pid))
            return
        ts = ev.get("ts")
        if ts is None:
            return
        if self.first_ts is None or ts < self.first_ts:
            self.first_ts = ts
        if self.last_ts is None or ts > self.last_ts:
            self.last_ts = ts
        if ph == "B":
            label = ev.get("name", "")
            self.stack.setdefault(pid, []).append((label, ts))
            if label.startswith("NEGOTIATE_"):
                self.open_neg[pid] = {"start": ts, "ready": {}, "op": label[10:].lower()}
        elif ph == "E":
            opened = self.stack.get(pid)
            if not opened:
                return
            label, start = opened.pop()
            cat = _category(label)
            if cat is not None:
                self.shares[cat].add(start, ts)
            if label.startswith("NEGOTIATE_"):
                neg = self.open_neg.pop(pid, None)
                if neg is not None:
                    self._negotiation_done(pid, neg)
        elif ph == "i":
            args = ev.get("args") or {}
            if "rank" in args and pid in self.open_neg:
                self.open_neg[pid]["ready"][args["rank"]] = ts

    def _negotiation_done(self, pid, neg):
        ready = neg["ready"]
        if not ready:
            return
        self.negotiations += 1
        first = min(ready.values())
        last = max(ready.values())
        wait = last - first
        late = sorted(r for r, t in ready.items()
                      if wait >= LATE_THRESHOLD and t - first >= 0.5 * wait)
        for rank, t in ready.items():
            row = self.lateness.setdefault(rank, [0.0, 0, 0])
            row[0] += t - first
            row[2] += 1
            if rank in late:
                row[1] += 1
        record = {"tensor": self.names.get(pid, str(pid)), "op": neg["op"], "wait": wait,
                  "late": late, "first": first, "ready": dict(ready)}
        self._seq += 1
        item = (wait, self._seq, record)
        for heap, limit in ((self.stalls, self.top), (self.plot_items, self.plot_limit)):
            if len(heap) < limit:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)

    def top_stalls(self):
        return [rec for _, _, rec in sorted(self.stalls, reverse=True) if rec["late"]]

    def text(self):
        span = (self.last_ts - self.first_ts) if self.events and self.first_ts is not None else 0
        lines = [f"{self.events} events, {len(self.names)} tensors, {self.negotiations} "
                 f"negotiations over {span / 1e6:.3f} s"]
        stalls = self.top_stalls()
        lines.append("")
        lines.append(f"Top {len(stalls)} stalls (the other ranks waited for the late ones):")
        if not stalls:
            lines.append("  none: every tensor was submitted by all ranks at the same time")
        for i, rec in enumerate(stalls, 1):
            late = ", ".join(str(r) for r in rec["late"])
            label = "rank" if len(rec["late"]) == 1 else "ranks"
            at = (rec["first"] - self.first_ts) / 1e6
            lines.append(f"  {i:2d}. {rec['op']} of '{rec['tensor']}': late {label} {late}; "
                         f"others waited {rec['wait'] / 1e3:.3f} ms (at {at:.3f} s)")
        lines.append("")
        lines.append("Lateness by rank (time the first rank to submit waited for it, summed):")
        for rank in sorted(self.lateness):
            total, times_late, count = self.lateness[rank]
            lines.append(f"  rank {rank}: {total / 1e3:.3f} ms, last to arrive in {times_late} "
                         f"of {count} negotiations")
        if self.lateness:
            worst = max(self.lateness, key=lambda r: self.lateness[r][0])
            if self.lateness[worst][0] > 0:
                lines.append(f"  most late: rank {worst}")
        lines.append("")
        lines.append("Share of wall-clock time (union over tensors):")
        for cat, union in self.shares.items():
            share = union.total() / span * 100 if span else 0.0
            lines.append(f"  {cat:14s} {share:6.2f}%")
        return "\n".join(lines)

    def plot(self, path):
        """Draws `figure()` into the PNG file `path`."""
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def figure(self):
        """A matplotlib figure of the longest waits: one row per tensor, a
        dot for each rank's arrival, a large x in the rank's colour for the
        late ones."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [rec for _, _, rec in sorted(self.plot_items, key=lambda it: it[2]["first"])]
        tensors = sorted({rec["tensor"] for rec in records})
        row = {name: i for i, name in enumerate(tensors)}
        ranks = sorted({r for rec in records for r in rec["ready"]})
        colors = plt.get_cmap("tab10")
        fig, ax = plt.subplots(figsize=(12, max(3, 0.35 * len(tensors) + 1.5)))
        base = self.first_ts or 0.0
        for rec in records:
            y = row[rec["tensor"]]
            times = [(t - base) / 1e6 for t in rec["ready"].values()]
            ax.plot([min(times), max(times)], [y, y], color="0.7", linewidth=3, zorder=1)
            for rank, t in rec["ready"].items():
                # A late arrival is a large x in its rank's colour, so the
                # plot says who was late, not only that someone was.
                late = rank in rec["late"]
                ax.scatter((t - base) / 1e6, y, color=colors(ranks.index(rank) % 10),
                           marker="x" if late else "o", s=80 if late else 18,
                           zorder=3 if late else 2)
        for i, rank in enumerate(ranks):
            ax.scatter([], [], color=colors(i % 10), label=f"rank {rank} ready")
            ax.scatter([], [], color=colors(i % 10), marker="x", s=80, label=f"rank {rank} late")
        ax.set_yticks(range(len(tensors)))
        ax.set_yticklabels(tensors, fontsize=7)
        ax.set_xlabel("seconds since the start of the trace")
        shown = (f"the {len(records)} longest waits of {self.negotiations}"
                 if len(records) < self.negotiations else f"all {len(records)}")
        ax.set_title(f"Negotiations ({shown}): when each rank submitted each tensor; "
                     f"x = the others waited {LATE_THRESHOLD / 1e3:g} ms or more")
        ax.legend(loc="upper right", fontsize=7)
        fig.tight_layout()
        return fig


def analyse(path, top=10):
    report = Report(top=top)
    for ev in iter_events(path):
        report.feed(ev)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m coordinator.timeline",
                                     description="Reports over a coordinator timeline.")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="who stalled on what, and where time went")
    rep.add_argument("trace")
    rep.add_argument("--top", type=int, default=10, help="how many stalls to list")
    rep.add_argument("--plot", metavar="PNG", help="also draw the negotiations to this file")
    args = parser.parse_args(argv)
    try:
        report = analyse(args.trace, args.top)
    except OSError as exc:
        print(f"cannot read {args.trace}: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    if args.plot:
        report.plot(args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
