#!/usr/bin/env python
"""ChainerMN's model-parallel MNIST example, on the coordinator.

The script has the shape of ChainerMN's
examples/mnist/train_mnist_model_parallel.py: an MLP split over exactly two
processes with MultiNodeChainList. Rank 0 holds the first layer and the
classifier: it sends the first layer's output to rank 1 and receives the
logits back. Rank 1 holds the two other layers and iterates an empty
dataset of the same length, so both ranks run the same number of steps.
Backward sends the gradients the other way. Every message is a send/recv
through the coordinator (it shows in the timeline with HOROVOD_TIMELINE).

Only the import differs (`import frontends.chainer as chainermn`), and the
data: the bundled 8x8 digits (1,797 images, coordinator/digits.py), because
nothing can be downloaded here; the first layer therefore has 64 inputs, not 784. The
layers start from fixed seeds, so `--single` trains the same MLP, unsplit,
in one process from the very same weights, for comparison:

    mpiexec -n 2 python examples/chainer/train_mnist_model_parallel.py
    python examples/chainer/train_mnist_model_parallel.py --single

(as root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.)
"""

import argparse

import numpy as np

import frontends.chainer as chainermn  # ChainerMN's API; imports Chainer

import chainer  # noqa: E402 (after the frontend, which makes Chainer importable)
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

N_IN = 64  # 8x8 digits


def seeded(seed):
    """Chainer's default initializer (LeCun normal) drawing from its own
    seed, so the split and the single-process model start equal."""
    return chainer.initializers.LeCunNormal(rng=np.random.RandomState(seed))


class MLP0SubA(chainer.Chain):
    def __init__(self, comm, n_out):
        super().__init__(l1=L.Linear(N_IN, n_out, initialW=seeded(1)))

    def forward(self, x):
        return F.relu(self.l1(x))


class MLP0SubB(chainer.Chain):
    def __init__(self, comm):
        super().__init__()

    def forward(self, y):
        return y


class MLP0(chainermn.MultiNodeChainList):
    # Model on worker 0.
    def __init__(self, comm, n_out):
        super().__init__(comm=comm)
        self.add_link(MLP0SubA(comm, n_out), rank_in=None, rank_out=1)
        self.add_link(MLP0SubB(comm), rank_in=1, rank_out=None)


class MLP1Sub(chainer.Chain):
    def __init__(self, n_units, n_out):
        super().__init__(l2=L.Linear(n_units, n_units, initialW=seeded(2)),
                         l3=L.Linear(n_units, n_out, initialW=seeded(3)))

    def forward(self, h0):
        h1 = F.relu(self.l2(h0))
        return self.l3(h1)


class MLP1(chainermn.MultiNodeChainList):
    # Model on worker 1.
    def __init__(self, comm, n_units, n_out):
        super().__init__(comm=comm)
        self.add_link(MLP1Sub(n_units, n_out), rank_in=0, rank_out=0)


class MLP(chainer.Chain):
    """The same layers in one process (--single)."""

    def __init__(self, n_units, n_out):
        super().__init__(first=MLP0SubA(None, n_units), rest=MLP1Sub(n_units, n_out))

    def forward(self, x):
        return self.rest(self.first(x))


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
    parser = argparse.ArgumentParser(description="ChainerMN example: pipelined neural network")
    parser.add_argument("--batchsize", "-b", type=int, default=100,
                        help="Number of images in each mini-batch")
    parser.add_argument("--epoch", "-e", type=int, default=20,
                        help="Number of sweeps over the dataset to train")
    parser.add_argument("--out", "-o", default="result", help="Directory to output the result")
    parser.add_argument("--unit", "-u", type=int, default=1000, help="Number of units")
    parser.add_argument("--single", action="store_true",
                        help="Train the unsplit model in this one process, for comparison")
    args = parser.parse_args()

    if args.single:
        comm = None
        rank, model = 0, L.Classifier(MLP(args.unit, 10))
    else:
        comm = chainermn.create_communicator("naive")
        if comm.size != 2:
            raise ValueError("This example can only be executed on exactly 2 processes.")
        rank = comm.rank
        if rank == 0:
            model = L.Classifier(MLP0(comm, args.unit))
        else:
            model = MLP1(comm, args.unit, 10)

    if rank == 0:
        print("==========================================")
        print("Single process (unsplit model)" if args.single else "Model split over 2 processes")
        print(f"Num unit: {args.unit}")
        print(f"Num Minibatch-size: {args.batchsize}")
        print(f"Num epoch: {args.epoch}")
        print("==========================================")

    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)

    # Iterate dataset only on worker 0.
    train, test = load_digits()
    if rank == 1:
        train = chainermn.datasets.create_empty_dataset(train)
        test = chainermn.datasets.create_empty_dataset(test)

    train_iter = chainer.iterators.SerialIterator(train, args.batchsize, shuffle=False)
    test_iter = chainer.iterators.SerialIterator(test, args.batchsize, repeat=False,
                                                 shuffle=False)

    updater = training.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (args.epoch, "epoch"), out=args.out)
    trainer.extend(extensions.Evaluator(test_iter, model))

    # Some display and output extensions are necessary only for worker 0.
    log = None
    if rank == 0:
        log = extensions.LogReport()
        trainer.extend(extensions.DumpGraph("main/loss"))
        trainer.extend(log)
        trainer.extend(extensions.PrintReport(
            ["epoch", "main/loss", "validation/main/loss", "main/accuracy",
             "validation/main/accuracy", "elapsed_time"]))

    trainer.run()

    if log is not None and log.log:
        last = log.log[-1]
        how = "in one process" if args.single else "split over 2 processes"
        print(f"final validation accuracy {float(last['validation/main/accuracy']):.4f} "
              f"after {args.epoch} epochs {how}")


if __name__ == "__main__":
    main()
