"""Where a training step's time goes on the host: a few steps of each
implementation with the gradient submissions timed and every thread's
Python stack sampled.

Used by `compare_ddp.py --host-profile N`. For each implementation it
prints, per step (median over the profiled steps), how long backward() and
the optimizer step took on the host; for the coordinator, how many
gradients were submitted a step and what one submission cost (median, 90th
and 99th percentile, and their sum a step), timed around the frontend call
DistributedOptimizer's hooks make; and, for every thread, where it was when
sampled (every SAMPLE_PERIOD seconds): its innermost frames and the share of
the samples. A thread that runs only C++ (autograd's device thread between
hooks, a thread waiting in backward()) shows only when it runs Python, or
waits for the interpreter lock to run it, so its samples say where hooks
spend their time, not how long backward() took.

On the H100 on 2026-11-27 this showed the coordinator's hooks taking 150-250
us each during backward (22 us each when submitted in a loop, bench --gpu's
(B)), most samples of autograd's thread on the line that recorded a
submission's ready event. Recorded at launch instead (coordinator/gpu.py
ReadyPoint), with no other CUDA call in the hook, they took 35-46 us.
"""

import statistics
import sys
import threading
import time

SAMPLE_PERIOD = 0.5e-3
DEPTH = 4  # frames kept per sample, innermost first
TOP = 6  # stacks printed per thread


class Sampler:
    """Samples the Python stack of every other thread while `on`."""

    def __init__(self, period=SAMPLE_PERIOD, depth=DEPTH):
        self.period = period
        self.depth = depth
        self.on = False
        self.counts = {}  # (thread name, stack) -> samples
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="host-profile-sampler",
                                        daemon=True)
        self._thread.start()

    def _run(self):
        me = threading.get_ident()
        while not self._stop:
            time.sleep(self.period)
            if self.on:
                self.sample(skip=me)

    def sample(self, skip=None):
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == skip:
                continue
            stack = []
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                stack.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}:"
                             f"{frame.f_lineno}")
                frame = frame.f_back
            name = names.get(ident) or f"native thread {ident % 10000}"
            key = (name, " < ".join(stack))
            self.counts[key] = self.counts.get(key, 0) + 1

    def take(self):
        """The samples since the last take, and a fresh start."""
        counts, self.counts = self.counts, {}
        return counts

    def stop(self):
        self._stop = True
        self._thread.join()


def sample_lines(counts, top=TOP):
    """Per thread, most samples first: its share of them and the stack."""
    threads = {}
    for (name, stack), n in counts.items():
        threads.setdefault(name, []).append((n, stack))
    lines = []
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(n for n, _ in kv[1])):
        total = sum(n for n, _ in stacks)
        lines.append(f"        {name}: {total} samples")
        for n, stack in sorted(stacks, reverse=True)[:top]:
            lines.append(f"          {100.0 * n / total:5.1f}% {stack}")
    return lines


class Timed:
    """Wraps `module.<attr>` (a function) to time its calls while `on`."""

    def __init__(self, module, attr):
        self.module, self.attr = module, attr
        self.original = getattr(module, attr)
        self.on = False
        self.calls = []  # seconds each
        original = self.original

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - start)

        setattr(module, attr, timed)

    def restore(self):
        setattr(self.module, self.attr, self.original)


class Phases:
    """Seconds per phase of one step: `annotate(label)` times a phase."""

    def __init__(self):
        self.seconds = {}

    def annotate(self, label):
        return _Phase(self.seconds, label)


class _Phase:
    __slots__ = ("seconds", "label", "start")

    def __init__(self, seconds, label):
        self.seconds, self.label = seconds, label

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds[self.label] = time.perf_counter() - self.start


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name, steps, submissions, counts):
    """Lines for one implementation: `steps` [{"backward": s, "optimizer":
    s}], `submissions` [[seconds of each submission] per step], `counts`
    the sampler's."""
    lines = []
    if steps:
        backward = statistics.median(s["backward"] for s in steps) * 1e3
        optimizer = statistics.median(s["optimizer"] for s in steps) * 1e3
        lines.append(f"  {name:5s} host: backward() {backward:7.2f}  opt.step() {optimizer:7.2f}"
                     f"  (ms, median of {len(steps)} steps)")
    flat = [d for step in submissions for d in step]
    if flat:
        per_step = statistics.median(len(s) for s in submissions)
        total = statistics.median(sum(s) for s in submissions)
        lines.append(f"        {per_step:.0f} submissions a step: median "
                     f"{quantile(flat, 0.5) * 1e6:.0f} us, p90 {quantile(flat, 0.9) * 1e6:.0f}, "
                     f"p99 {quantile(flat, 0.99) * 1e6:.0f}, {total * 1e3:.2f} ms a step")
    else:
        lines.append("        no submissions timed")
    if counts:
        lines.append(f"        where each thread was, sampled every {SAMPLE_PERIOD * 1e3:g} ms:")
        lines += sample_lines(counts)
    return lines


def profile_host(steppers, names, step_fn, steps, barrier):
    """Runs `steps` steps of each implementation; `step_fn(model, opt,
    annotate)` runs one, its backward inside `annotate("backward")` and its
    optimizer step inside `annotate("optimizer")`. Returns {name: report
    lines}."""
    import frontends.torch.optimizer as hvd_optimizer

    timers = [Timed(hvd_optimizer, "allreduce_async_"),
              Timed(hvd_optimizer, "grouped_allreduce_async_")]
    sampler = Sampler()
    out = {}
    try:
        for name in names:
            model, opt = steppers[name]
            barrier()
            phases, submissions = [], []
            for _ in range(steps):
                times = Phases()
                for t in timers:
                    t.calls = []
                    t.on = True
                sampler.on = True
                step_fn(model, opt, times.annotate)
                sampler.on = False
                for t in timers:
                    t.on = False
                phases.append(times.seconds)
                submissions.append([d for t in timers for d in t.calls])
            out[name] = report(name, phases, [s for s in submissions if s], sampler.take())
    finally:
        sampler.stop()
        for t in timers:
            t.restore()
    return out
