"""Data-parallel softmax regression on the bundled digits (coordinator/digits.py), in NumPy.

    coordrun -np 2 python examples/numpy_digits.py [--epochs 30]

Each rank trains on its own shard of the training set; gradients are averaged
with the coordinator's allreduce, so every rank takes the same step. Rank 0
prints the loss and the test accuracy after each epoch.
"""

import argparse

import numpy as np
from coordinator.digits import load_digits
from coordinator.digits import train_test_split

import coordinator as hvd


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    # Every rank takes its own slice of the training data.
    x_train, y_train = x_train[rank::size], y_train[rank::size]

    n_features, n_classes = x.shape[1], 10
    rng = np.random.default_rng(rank)  # deliberately different per rank...
    weights = rng.normal(0, 0.01, (n_features, n_classes)).astype(np.float32)
    bias = np.zeros(n_classes, np.float32)
    # ...then made identical: everyone starts from rank 0's parameters.
    hvd.broadcast(weights, root_rank=0, name="init.weights", output=weights)
    hvd.broadcast(bias, root_rank=0, name="init.bias", output=bias)

    steps = int(np.ceil(len(x_train) / args.batch_size))
    # Ranks must take the same number of steps: agree on the largest.
    steps = int(hvd.allreduce(np.array(steps), op=hvd.Max, name="steps"))
    order = np.random.default_rng(1234 + rank)
    for epoch in range(1, args.epochs + 1):
        perm = order.permutation(len(x_train))
        loss_sum = np.zeros(1, np.float64)
        for step in range(steps):
            idx = perm[(step * args.batch_size) % len(perm):][:args.batch_size]
            xb, yb = x_train[idx], y_train[idx]
            probs = softmax(xb @ weights + bias)
            loss_sum += -np.log(probs[np.arange(len(yb)), yb] + 1e-9).mean()
            probs[np.arange(len(yb)), yb] -= 1.0
            grad_w = xb.T @ probs / len(yb)
            grad_b = probs.mean(axis=0)
            # Submit both gradients, then wait: they negotiate and fuse together.
            hw = hvd.allreduce_async(grad_w, name="grad.weights")
            hb = hvd.allreduce_async(grad_b, name="grad.bias")
            weights -= args.lr * hvd.synchronize(hw)
            bias -= args.lr * hvd.synchronize(hb)
        loss = hvd.allreduce(loss_sum / steps, name="metric.loss")[0]
        correct = np.array([(np.argmax(x_test @ weights + bias, axis=1) == y_test).sum()])
        accuracy = correct[0] / len(y_test)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {loss:.4f}  test accuracy {accuracy:.4f}", flush=True)

    # All ranks hold the same model.
    fingerprint = hvd.allgather(np.array([weights.sum()], np.float64), name="check")
    assert np.allclose(fingerprint, fingerprint[0]), "ranks diverged"
    if rank == 0:
        print(f"done: {size} ranks, final test accuracy {accuracy:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
