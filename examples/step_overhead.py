"""What the core costs per tensor in a step of many small gradients.

ResNet-50's count of gradients (161 tensors of 32 floats) is submitted with
`allreduce_async` and then waited for with `synchronize`, step after step,
as a frontend's hooks and optimizer do. Every result is checked. Rank 0
prints, as medians over the steps: the submitting thread's CPU time per
tensor in the submissions and in the synchronizes, the background thread's
CPU time per step (read from /proc: Linux), and the step's wall time.

    python examples/step_overhead.py [--steps 300]   # np=1: the core's Python alone
    coordrun -np 2 python examples/step_overhead.py

To compare two versions, run it with PYTHONPATH set to each checkout in
turn, several times, alternating.
"""

import argparse
import os
import statistics
import threading
import time

import numpy as np

import coordinator as hvd


def _thread_cpu(native_id):
    """CPU seconds the thread `native_id` of this process has used (Linux)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tensors", type=int, default=161)
    args = parser.parse_args()
    hvd.init()
    n = hvd.size()
    grads = [np.full(32, hvd.rank() + 1.0 + i, np.float32) for i in range(args.tensors)]
    names = [f"step_overhead.{i}" for i in range(args.tensors)]
    expected = [np.full(32, (n + 1) / 2 + i, np.float32) for i in range(args.tensors)]
    background = [t.native_id for t in threading.enumerate()
                  if t.name == "coordinator-background"]
    warmup = max(1, args.steps // 10)
    submit, wait, wall = [], [], []
    hvd.barrier()
    bg_start = None
    for step in range(warmup + args.steps):
        if step == warmup:
            bg_start = _thread_cpu(background[0]) if background else float("nan")
        start, cpu = time.perf_counter(), time.thread_time()
        handles = [hvd.allreduce_async(g, name=name, op=hvd.Average)
                   for g, name in zip(grads, names)]
        submitted = time.thread_time()
        results = [hvd.synchronize(h) for h in handles]
        done = time.thread_time()
        if step >= warmup:
            submit.append(submitted - cpu)
            wait.append(done - submitted)
            wall.append(time.perf_counter() - start)
        for got, want in zip(results, expected):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    bg = ((_thread_cpu(background[0]) - bg_start) / args.steps if background
          else float("nan"))
    if hvd.rank() == 0:
        per = 1e6 / args.tensors
        print(f"{n} rank{'s' if n > 1 else ''}, {args.tensors} tensors: "
              f"submit {statistics.median(submit) * per:.2f} us/tensor, "
              f"synchronize {statistics.median(wait) * per:.2f} us/tensor, "
              f"background thread {bg * 1e3:.2f} ms/step, "
              f"step {statistics.median(wall) * 1e3:.2f} ms (median of {args.steps} steps)",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
