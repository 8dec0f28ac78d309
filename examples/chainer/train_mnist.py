#!/usr/bin/env python
"""ChainerMN's MNIST example, on the coordinator.

The script has the shape of ChainerMN's examples/mnist/train_mnist.py: an MLP
inside L.Classifier, a multi-node Adam optimizer, the dataset scattered from
rank 0, a Trainer with a multi-node evaluator, and reports printed by rank 0.
Only the import differs (`import frontends.chainer as chainermn`), and the
data: the bundled 8x8 digits (1,797 images, coordinator/digits.py), because
nothing can be downloaded here.

    mpiexec -n 4 python examples/chainer/train_mnist.py

(as root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 and --oversubscribe beyond the core count.)
"""

import argparse

import numpy as np

import frontends.chainer as chainermn  # ChainerMN's API; imports Chainer

import chainer  # noqa: E402 (after the frontend, which makes Chainer importable)
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402


class MLP(chainer.Chain):
    def __init__(self, n_units, n_out):
        super().__init__()
        with self.init_scope():
            # Input sizes are inferred on the first call.
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_units)
            self.l3 = L.Linear(None, n_out)

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


def load_digits(test_fraction=0.2, seed=0):
    """The bundled digits as (train, test) TupleDatasets of float32 pixels
    in [0, 1] and int32 labels, split by a fixed permutation."""
    from coordinator.digits import load_digits as bundled_digits

    digits = bundled_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (chainer.datasets.TupleDataset(x[train], y[train]),
            chainer.datasets.TupleDataset(x[test], y[test]))


def main():
    parser = argparse.ArgumentParser(description="ChainerMN example: digits")
    parser.add_argument("--batchsize", "-b", type=int, default=100,
                        help="Number of images in each mini-batch (per process)")
    parser.add_argument("--communicator", type=str, default="naive",
                        help="Type of communicator")
    parser.add_argument("--epoch", "-e", type=int, default=15,
                        help="Number of sweeps over the dataset to train")
    parser.add_argument("--out", "-o", default="result", help="Directory to output the result")
    parser.add_argument("--resume", "-r", default="", help="Resume the training from snapshot")
    parser.add_argument("--unit", "-u", type=int, default=1000, help="Number of units")
    args = parser.parse_args()

    comm = chainermn.create_communicator(args.communicator)

    if comm.rank == 0:
        print("==========================================")
        print(f"Num process (COMM_WORLD): {comm.size}")
        print(f"Using {args.communicator} communicator")
        print(f"Num unit: {args.unit}")
        print(f"Num Minibatch-size: {args.batchsize}")
        print(f"Num epoch: {args.epoch}")
        print("==========================================")

    model = L.Classifier(MLP(args.unit, 10))

    # A multi-node optimizer: gradients are averaged over the ranks (through
    # the coordinator) before each Adam step.
    optimizer = chainermn.create_multi_node_optimizer(chainer.optimizers.Adam(), comm)
    optimizer.setup(model)

    # Rank 0 loads the data; every rank gets its share.
    if comm.rank == 0:
        train, test = load_digits()
    else:
        train, test = None, None
    train = chainermn.scatter_dataset(train, comm, shuffle=True)
    test = chainermn.scatter_dataset(test, comm, shuffle=True)

    train_iter = chainer.iterators.SerialIterator(train, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(test, args.batchsize, repeat=False,
                                                 shuffle=False)

    updater = training.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (args.epoch, "epoch"), out=args.out)

    # The evaluator reports the mean over the ranks of each rank's result.
    evaluator = extensions.Evaluator(test_iter, model)
    evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(evaluator)

    # Only rank 0 prints and writes logs.
    log = None
    if comm.rank == 0:
        log = extensions.LogReport()
        trainer.extend(log)
        trainer.extend(extensions.PrintReport(
            ["epoch", "main/loss", "validation/main/loss", "main/accuracy",
             "validation/main/accuracy", "elapsed_time"]))

    if args.resume:
        chainer.serializers.load_npz(args.resume, trainer)

    trainer.run()

    if log is not None and log.log:
        last = log.log[-1]
        print(f"final validation accuracy {float(last['validation/main/accuracy']):.4f} "
              f"after {args.epoch} epochs on {comm.size} processes")


if __name__ == "__main__":
    main()
