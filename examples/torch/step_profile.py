"""Where a training step's time goes on the GPU: a few steps of each
implementation under torch.profiler, summarised from its trace.

Used by `compare_ddp.py --profile N`. For each implementation it prints,
per step (median over the profiled steps), on the host how long the step,
its backward() and its optimizer step took, and on the device's own clock
from the step's first kernel:
  span      until the step's last kernel ended
  bwd end   when the last kernel launched inside backward() ended
  compute   time some compute kernel ran (communication kernels and the
            coordinator's pack/unpack kernels excepted)
  comm      time some communication kernel (NCCL) ran, and how many ran
  tail      span - bwd end: what the step waited for after backward
and, for the last profiled step, each communication kernel (start and
duration, ms) and each pack/unpack kernel, so two implementations' NCCL
calls can be laid side by side. The traces are kept (`--profile-dir`) for
Perfetto or chrome://tracing.
"""

import json
import os
import statistics

COMM_MARKS = ("nccl",)  # kernel names that communicate
FUSION_PREFIX = "coordinator_"  # the device fusion kernels (ops/device_fusion.py)


def _kind(name):
    low = name.lower()
    if any(mark in low for mark in COMM_MARKS):
        return "comm"
    if name.startswith(FUSION_PREFIX):
        return "fusion"
    return "compute"


def _union(intervals):
    """Total length covered by [(start, end)]."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def summarize(trace, prefix):
    """Per-step figures (ms) from a Chrome trace (dict) of steps annotated
    `<prefix>.step<i>` with a `backward` annotation inside each."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    steps = sorted((e for e in events if e.get("ph") == "X" and
                    e.get("name", "").startswith(prefix + ".step")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])

    def annotations(name):
        return [e for e in events if e.get("ph") == "X" and e.get("name") == name
                and e.get("cat") == "user_annotation"]

    backwards, optimizers = annotations("backward"), annotations("optimizer")
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    out = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        mine = [k for k in kernels if lo <= launches.get(k["args"].get("correlation"), k["ts"]) <= hi]
        bwd = next((b for b in backwards if lo <= b["ts"] <= hi), None)
        opt = next((o for o in optimizers if lo <= o["ts"] <= hi), None)
        ms = 1e-3
        host = {"host": step["dur"] * ms,
                "bwd_host": bwd["dur"] * ms if bwd else 0.0,
                "opt_host": opt["dur"] * ms if opt else 0.0}
        if not mine:
            out.append(host)
            continue
        start = min(k["ts"] for k in mine)
        end = max(k["ts"] + k["dur"] for k in mine)

        def launched_in_backward(k):
            t = launches.get(k["args"].get("correlation"))
            return bwd is not None and t is not None and bwd["ts"] <= t <= bwd["ts"] + bwd["dur"]

        in_bwd = [k for k in mine if _kind(k["name"]) == "compute" and launched_in_backward(k)]
        bwd_end = max((k["ts"] + k["dur"] for k in in_bwd), default=start)
        comm = [k for k in mine if _kind(k["name"]) == "comm"]
        fusion = [k for k in mine if _kind(k["name"]) == "fusion"]
        compute = [k for k in mine if _kind(k["name"]) == "compute"]
        out.append({
            **host,
            "span": (end - start) * ms,
            "bwd_end": (bwd_end - start) * ms,
            "compute": _union([(k["ts"], k["ts"] + k["dur"]) for k in compute]) * ms,
            "comm": _union([(k["ts"], k["ts"] + k["dur"]) for k in comm]) * ms,
            "calls": len(comm),
            "tail": (end - bwd_end) * ms,
            "comm_kernels": [((k["ts"] - start) * ms, k["dur"] * ms) for k in comm],
            "fusion_kernels": [((k["ts"] - start) * ms, k["dur"] * ms, k["name"]) for k in fusion],
        })
    return out


def report(name, steps):
    """Lines for one implementation's summarised steps."""
    if not steps:
        return [f"  {name:5s} no step in the trace"]

    def med(key):
        return statistics.median(s[key] for s in steps)

    lines = [f"  {name:5s} host: step {med('host'):7.2f}  backward() {med('bwd_host'):7.2f}  "
             f"opt.step() {med('opt_host'):7.2f}  (ms, median of {len(steps)} steps)"]
    if "span" not in steps[-1]:
        return lines + ["        no GPU kernels in the trace (a CPU run, or no CUPTI)"]
    lines += [f"        GPU: span {med('span'):7.2f}  bwd end {med('bwd_end'):7.2f}  "
             f"compute {med('compute'):7.2f}  comm {med('comm'):7.2f} in "
             f"{statistics.median(s['calls'] for s in steps):.0f} call(s)  "
             f"tail {med('tail'):7.2f}"]
    last = steps[-1]
    calls = ", ".join(f"{s:.2f}+{d:.2f}" for s, d in last["comm_kernels"])
    lines.append(f"        last step's comm kernels (start+duration): {calls or 'none'}")
    if last["fusion_kernels"]:
        packs = ", ".join(f"{s:.2f}+{d:.3f}{'p' if 'pack' in n and 'unpack' not in n else 'u'}"
                          for s, d, n in last["fusion_kernels"])
        lines.append(f"        pack(p)/unpack(u) kernels: {packs}")
    return lines


def profile_steps(steppers, names, step_fn, steps, out_dir, rank, barrier):
    """Runs `steps` annotated steps of each implementation under the profiler
    (CUDA activity where there is a GPU); `step_fn(model, opt, annotate)`
    runs one step, its backward inside `annotate("backward")`. Writes one
    trace per rank and implementation into `out_dir`; returns {name:
    summarised steps}."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    os.makedirs(out_dir, exist_ok=True)
    result = {}
    for name in names:
        model, opt = steppers[name]
        barrier()
        with profile(activities=activities) as prof:
            for i in range(steps):
                with record_function(f"{name}.step{i}"):
                    step_fn(model, opt, record_function)
        path = os.path.join(out_dir, f"{name}.rank{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            result[name] = summarize(json.load(f), name)
    return result
