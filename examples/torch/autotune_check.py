"""Does HOROVOD_AUTOTUNE converge on the small-CNN step, and does its choice
lose to the defaults?

    coordrun -np 2 -x HOROVOD_AUTOTUNE=1 -x HOROVOD_AUTOTUNE_LOG=autotune.csv \
        python examples/torch/autotune_check.py

Phase 1 trains the small CNN (as in compare_ddp.py) until the tuner on rank 0
has chosen. Phase 2 alternates blocks of steps with the defaults and with
the tuned settings (rank 0's controller holds both knobs) and prints the
median step time of each and their ratio.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import frontends.torch as hvd  # noqa: E402
from coordinator import runtime  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(0)
    model = models.build("small_cnn")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    x = torch.randn(args.batch_size, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    bg = runtime.current().background
    tuner = bg.autotuner
    ctl = bg.controller  # rank 0 only
    steps = 0
    while True:
        done = hvd.broadcast_object(tuner.done if tuner is not None else None, root_rank=0,
                                    name="autotune.done")
        if done is None:
            if hvd.rank() == 0:
                print("HOROVOD_AUTOTUNE is not set: nothing to check")
            return
        if done or steps >= args.max_steps:
            break
        for _ in range(10):
            step()
        steps += 10
    if tuner is not None and ctl is not None:
        defaults = (runtime.current().config.fusion_threshold,
                    runtime.current().config.cycle_time_ms / 1000.0)
        chosen = tuner.best or (ctl.fusion_threshold, ctl.cycle_time)
    else:
        defaults = chosen = None
    defaults, chosen = hvd.broadcast_object((defaults, chosen), root_rank=0,
                                            name="autotune.choice")

    times = {"defaults": [], "tuned": []}
    for r in range(args.rounds):
        for label in (("defaults", "tuned") if r % 2 == 0 else ("tuned", "defaults")):
            if ctl is not None:
                ctl.fusion_threshold, ctl.cycle_time = defaults if label == "defaults" else chosen
            hvd.barrier()
            block = []
            for _ in range(args.block):
                start = time.perf_counter()
                step()
                block.append(time.perf_counter() - start)
            times[label].append(statistics.median(block))
    if hvd.rank() == 0:
        d = statistics.median(times["defaults"]) * 1e3
        t = statistics.median(times["tuned"]) * 1e3
        print(f"autotune converged after {steps} steps: fusion threshold {chosen[0]} bytes, "
              f"cycle time {chosen[1] * 1e3:g} ms (defaults: {defaults[0]} bytes, "
              f"{defaults[1] * 1e3:g} ms)")
        print(f"median step: defaults {d:.2f} ms, tuned {t:.2f} ms, tuned/defaults {t / d:.3f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
