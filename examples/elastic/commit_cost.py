"""What commits and host-update checks cost a training step, measured
inside one elastic job so that the machine's load hits both sides alike.

    coordrun -np 2 --min-np 2 -H localhost:1,127.0.0.1:1 \\
        python examples/elastic/commit_cost.py [--rounds 40] [--block 20] [--batches-per-commit 10]

The digits CNN of train_digits_elastic.py trains in blocks of --block steps;
blocks alternate between plain steps and steps with `state.commit()` every
--batches-per-commit steps (a copy of model, optimizer and sampler state to
host memory, then the check for host changes: one broadcast from rank 0).
Rank 0 prints the median block time of each kind and their ratio, and the
median time of one commit.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from coordinator.digits import load_digits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
from train_digits import DigitsCNN  # noqa: E402

import frontends.torch as hvd  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--batches-per-commit", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = DigitsCNN()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), 0.002),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, seed=1)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    blocks = {"plain": [], "commits": []}
    commits = []

    @hvd.elastic.run
    def train(state):
        batches = iter(())
        for round_ in range(args.rounds):
            for kind in (("plain", "commits") if round_ % 2 else ("commits", "plain")):
                started = time.perf_counter()
                for i in range(args.block):
                    try:
                        xb, yb = next(batches)
                    except StopIteration:
                        batches = iter(torch.utils.data.DataLoader(
                            dataset, args.batch_size, sampler=state.sampler))
                        xb, yb = next(batches)
                    optimizer.zero_grad()
                    F.cross_entropy(model(xb), yb).backward()
                    optimizer.step()
                    state.batch += 1
                    if kind == "commits" and (i + 1) % args.batches_per_commit == 0:
                        t = time.perf_counter()
                        state.commit()
                        commits.append(time.perf_counter() - t)
                if round_ > 0:
                    blocks[kind].append(time.perf_counter() - started)

    train(state)
    if hvd.rank() == 0:
        plain = statistics.median(blocks["plain"]) / args.block
        with_commits = statistics.median(blocks["commits"]) / args.block
        ratios = [c / p for c, p in zip(blocks["commits"], blocks["plain"])]
        print(f"per step: plain {plain * 1e3:.3f} ms, with a commit every "
              f"{args.batches_per_commit} steps {with_commits * 1e3:.3f} ms; ratio of medians "
              f"{with_commits / plain:.4f}, median of per-round ratios "
              f"{statistics.median(ratios):.4f}; one commit {statistics.median(commits) * 1e3:.3f}"
              f" ms (median of {len(commits)})", flush=True)


if __name__ == "__main__":
    main()
