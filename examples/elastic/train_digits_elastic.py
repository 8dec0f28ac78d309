"""examples/torch/train_digits.py as an elastic job: the small CNN on the
bundled digits, with its state (model, optimizer, ElasticSampler, epoch)
in a TorchState committed every --batches-per-commit batches, so the job
goes on when workers are lost and grows when hosts appear.

    coordrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/elastic/train_digits_elastic.py

--no-elastic runs the same training loop without any of it (no state, no
commits; launch with plain coordrun -np N), the baseline of benchmark.py.
--kill-at STEP:RANK SIGKILLs that rank of the first membership at that step
(benchmark.py's recovery measurement). Rank 0 prints a line per step
("step <n> size <s> t=<unix time>") with --log-steps, and at the end the
median and mean time from one step's end to the next after the first
epoch (the mean includes the commits).
"""

import argparse
import os
import signal
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from coordinator.digits import load_digits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
from train_digits import DigitsCNN  # noqa: E402

import frontends.torch as hvd  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.002, help="per rank; scaled by size")
    p.add_argument("--batches-per-commit", type=int, default=10)
    p.add_argument("--no-elastic", action="store_true")
    p.add_argument("--kill-at", default="", metavar="STEP:RANK")
    p.add_argument("--log-steps", action="store_true")
    return p.parse_args()


def main():
    args = parse()
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    times = []
    last = []  # when the previous step ended (after the first epoch)

    def step(state, xb, yb):
        if args.kill_at:
            at, victim = map(int, args.kill_at.split(":"))
            from coordinator.elastic import membership
            m = membership.current()
            if (state.steps, hvd.rank()) == (at, victim) and m and m.generation == 0:
                print(f"killing rank {victim} at step {at} t={time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
        state.steps += 1
        if state.epoch > 0:
            # Time since the previous step ended: the step and whatever came
            # between (a commit, the next batch).
            now = time.perf_counter()
            if last:
                times.append(now - last[0])
            last[:] = [now]
        if args.log_steps and hvd.rank() == 0:
            print(f"step {state.steps} size {hvd.size()} t={time.time():.6f}", flush=True)

    if args.no_elastic:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, hvd.size(), hvd.rank(), shuffle=True, seed=1)
        state = argparse.Namespace(epoch=0, steps=0)
        for state.epoch in range(args.epochs):
            sampler.set_epoch(state.epoch)
            for xb, yb in torch.utils.data.DataLoader(dataset, args.batch_size,
                                                      sampler=sampler):
                step(state, xb, yb)
    else:
        sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
        state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0,
                                       steps=0)

        def on_reset():
            for group in optimizer.param_groups:
                group["lr"] = args.lr * hvd.size()

        state.register_reset_callbacks([on_reset])

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, args.epochs):
                loader = torch.utils.data.DataLoader(dataset, args.batch_size,
                                                     sampler=state.sampler)
                for xb, yb in loader:
                    step(state, xb, yb)
                    state.sampler.record_batch(state.batch, args.batch_size)
                    state.batch += 1
                    if state.batch % args.batches_per_commit == 0:
                        state.commit()
                state.batch = 0
                state.sampler.set_epoch(state.epoch + 1)
                state.commit()

        train(state)
    if hvd.rank() == 0:
        median = statistics.median(times) if times else float("nan")
        mean = statistics.fmean(times) if times else float("nan")
        print(f"done: {hvd.size()} ranks, {state.steps} steps, median step "
              f"{median * 1e3:.3f} ms, mean step {mean * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
