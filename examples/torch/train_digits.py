"""Data-parallel training of a small CNN on the bundled 8x8 digits
(coordinator/digits.py), written as a Horovod PyTorch script; only the
import differs.

    mpirun -np 2 python examples/torch/train_digits.py [--epochs 12]
    (or: coordrun -np 2 python examples/torch/train_digits.py)

Each rank trains on its own shard of the training set with
hvd.DistributedOptimizer (gradients averaged over the ranks as they are
computed); rank 0's initial weights and optimizer state are broadcast first,
and the learning rate is scaled by the number of ranks. Rank 0 prints the
average training loss and the test accuracy after each epoch (the test set
is split over the ranks and the counts are summed with allreduce).
"""

import argparse

import torch
import torch.nn.functional as F
from coordinator.digits import load_digits
from coordinator.digits import train_test_split
from torch import nn

import frontends.torch as hvd


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different per rank, then broadcast
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    # Each rank its shard (what DistributedSampler would give).
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    x_test, y_test = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Ranks must take the same number of steps per epoch: agree on the largest.
    steps = -(-len(x_train) // args.batch_size)
    steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Max, name="steps_per_epoch"))
    order = torch.Generator().manual_seed(args.seed + 1000 * hvd.rank())
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(len(x_train), generator=order)
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for step in range(steps):
            idx = perm[(step * args.batch_size) % len(perm):][:args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
        mean_loss = hvd.allreduce(loss_sum / steps, name="train_loss").item()

        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).sum()
        counts = hvd.allreduce(torch.tensor([int(correct), len(y_test)]), op=hvd.Sum,
                               name="test_counts")
        accuracy = counts[0].item() / counts[1].item()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}: train loss {mean_loss:.4f}  test accuracy {accuracy:.4f}",
                  flush=True)
    if hvd.rank() == 0:
        print(f"done: {hvd.size()} ranks, final test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
