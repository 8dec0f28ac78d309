"""What frontends.torch costs the thread that submits gradients.

ResNet-50's count of gradients (161 tensors of 32 floats) is submitted with
`allreduce_async_`, as DistributedOptimizer's hooks do, and then waited
for; the figure is the median, over the steps, of the submitting loop's time
per tensor (the reduction itself is not in it). Every result is checked.

    mpirun -n 2 python examples/torch/submit_cost.py [--steps 300]

To compare two versions, run it with PYTHONPATH set to each checkout in
turn, several times, alternating.
"""

import argparse
import statistics
import time

import torch

import frontends.torch as hvd


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tensors", type=int, default=161)
    args = parser.parse_args()
    hvd.init()
    grads = [torch.full((32,), float(hvd.rank() + 1)) for _ in range(args.tensors)]
    names = [f"g{i}" for i in range(args.tensors)]
    want = sum(r + 1.0 for r in range(hvd.size()))
    times = []
    for step in range(args.steps + 30):  # the first 30 warm up
        for g in grads:
            g.fill_(hvd.rank() + 1)
        start = time.perf_counter()
        handles = [hvd.allreduce_async_(g, name=n, op=hvd.Sum) for g, n in zip(grads, names)]
        submitted = time.perf_counter()
        for h in handles:
            hvd.synchronize(h)
        if step >= 30:
            times.append((submitted - start) / len(grads) * 1e6)
    assert all(bool((g == want).all()) for g in grads), "a wrong result"
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(grads)} tensors: submit "
              f"{statistics.median(times):.2f} us/tensor (median of {args.steps} steps)",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
