"""Autotuning the knobs rank 0 controls (HOROVOD_AUTOTUNE=1).

In this design two settings shape how tensors are dispatched, and both live
in rank 0's controller, so tuning them needs no agreement between ranks:

- the fusion threshold (how much one fused buffer may hold), and
- the cycle time (how long a ready tensor may wait for others to fuse with;
  0 means dispatch at once).

The tuner measures throughput (bytes reduced per second) over samples of a
few training steps. A step is recognised when the first tensor name to come
round again (the first one seen twice, so one-off broadcasts do not count)
comes round once more (or, for unnamed tensors, after `max_window` seconds). It
measures the defaults first, then tries the thresholds with the cycle time at
0, then cycle times with the best threshold (coordinate descent), each
candidate over `samples` samples after one warm-up sample, and keeps the
candidate with the best median. Since the defaults are candidates, the choice
is never one that measured worse than them. A knob the user set
(HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME, or their coordrun flags) is
held where it was set, as Horovod holds it. Every sample and the final choice
are logged to HOROVOD_AUTOTUNE_LOG (CSV).
"""

import statistics
import time

MIB = 1024 * 1024
THRESHOLDS = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB]
CYCLE_TIMES = [0.0, 0.0005, 0.002, 0.005]  # seconds


class Autotuner:
    def __init__(self, controller, log_path="", steps_per_sample=5, samples=3,
                 warmup_samples=1, max_window=2.0, clock=time.monotonic, fixed=()):
        self.controller = controller
        self.steps_per_sample = steps_per_sample
        self.samples = samples
        self.warmup_samples = warmup_samples
        self.max_window = max_window
        self.clock = clock
        self.done = False
        self.best = None
        self._log = open(log_path, "w") if log_path else None
        if self._log:
            self._log.write("sample,phase,fusion_threshold_bytes,cycle_time_ms,steps,bytes,"
                            "seconds,bytes_per_second\n")
            self._log.flush()
        default = (controller.fusion_threshold, controller.cycle_time)
        # Knobs the user set stay as set (Horovod's autotuner holds them).
        self._fixed = frozenset(fixed)
        self._phase = "threshold"
        self._queue = [default]
        if "fusion_threshold" not in self._fixed:
            cycle = default[1] if "cycle_time" in self._fixed else 0.0
            self._queue += [(t, cycle) for t in THRESHOLDS if (t, cycle) != default]
        self._scores = {}  # candidate -> [bytes/s samples]
        self._candidate = None
        self._marker = None
        self._seen = set()
        self._sample_no = 0
        self._next_candidate()

    # -- measurement -----------------------------------------------------------
    def observe(self, plans):
        """Called by rank 0's background thread with every batch of plans."""
        if self.done or not plans:
            return
        now = self.clock()
        for plan in plans:
            if plan.response.error:
                continue
            self._bytes += plan.nbytes
            if self._marker is not None:
                if self._marker in plan.names:
                    self._steps += 1
            elif len(self._seen) < 100000:
                # The first name to come round again marks the training step.
                for name in plan.names:
                    if name in self._seen:
                        self._marker = name
                        break
                    self._seen.add(name)
        if self._steps >= self.steps_per_sample or now - self._start >= self.max_window:
            self._end_sample(now)

    def _begin_sample(self):
        self._start = self.clock()
        self._bytes = 0
        self._steps = 0

    def _end_sample(self, now):
        seconds = max(now - self._start, 1e-9)
        rate = self._bytes / seconds
        self._sample_no += 1
        warm = self._warmup_left > 0
        if warm:
            self._warmup_left -= 1
        else:
            self._scores.setdefault(self._candidate, []).append(rate)
        self._write(self._sample_no, "warmup" if warm else self._phase, self._candidate,
                    self._steps, self._bytes, seconds, rate)
        if len(self._scores.get(self._candidate, ())) >= self.samples:
            self._next_candidate()
        else:
            self._begin_sample()

    # -- search ---------------------------------------------------------------
    def score(self, candidate):
        samples = self._scores.get(candidate)
        return statistics.median(samples) if samples else float("-inf")

    def _next_candidate(self):
        while self._queue and self._queue[0] in self._scores:
            self._queue.pop(0)
        if not self._queue and self._phase == "threshold":
            self._phase = "cycle_time"
            best_threshold = max(self._scores, key=self.score)[0]
            if "cycle_time" not in self._fixed:
                self._queue = [(best_threshold, c) for c in CYCLE_TIMES
                               if (best_threshold, c) not in self._scores]
        if not self._queue:
            self._finish()
            return
        self._candidate = self._queue.pop(0)
        self._apply(self._candidate)
        self._warmup_left = self.warmup_samples
        self._begin_sample()

    def _apply(self, candidate):
        self.controller.fusion_threshold, self.controller.cycle_time = candidate

    def _finish(self):
        self.best = max(self._scores, key=self.score)
        self._apply(self.best)
        self.done = True
        self._write("final", "chosen", self.best, "", "", "", self.score(self.best))
        if self._log:
            self._log.close()
            self._log = None

    def _write(self, sample, phase, candidate, steps, nbytes, seconds, rate):
        if not self._log:
            return
        threshold, cycle = candidate
        secs = f"{seconds:.6f}" if seconds != "" else ""
        self._log.write(f"{sample},{phase},{threshold},{cycle * 1e3:g},{steps},{nbytes},"
                        f"{secs},{rate:.1f}\n")
        self._log.flush()
