"""Multi-rank cases for ChainerMN's multi_node_snapshot and
MultiNodeEarlyStoppingTrigger in frontends.chainer, run by
tests/test_chainer_extensions_mpi.py at 2 and 3 ranks.

Besides ChainerMN's behaviour, they pin what ChainerMN 7.8.1 got wrong
here: its early-stopping trigger failed on Variables without ChainerX, and
ranks that disagree (a master that cannot load its snapshot, an aggregator
that raises on rank 0) left the other ranks waiting. Here every rank raises.
"""

import os
import shutil
import tempfile

import numpy as np

import frontends.chainer as chainermn  # makes Chainer importable first

import chainer  # noqa: E402
import chainer.links as L  # noqa: E402
from chainer import training  # noqa: E402
from chainer.training import extensions  # noqa: E402

from frontends.chainer.extensions import (  # noqa: E402
    MultiNodeEarlyStoppingTrigger, ObservationAggregator, _multi_node_snapshot,
    create_multi_node_early_stopping_trigger, multi_node_snapshot)

COMM = None


def setup(hvd):
    global COMM
    COMM = chainermn.create_communicator("naive")


def expect_raises(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


class Updater:
    """Counts iterations as Chainer's updaters do (what triggers read)."""

    def __init__(self, iter_per_epoch):
        self.iter_per_epoch = iter_per_epoch
        self.iteration = 0
        self.epoch = 0
        self.epoch_detail = 0.0
        self.previous_epoch_detail = None
        self.is_new_epoch = False

    def update(self):
        self.iteration += 1
        self.epoch = self.iteration // self.iter_per_epoch
        self.previous_epoch_detail = (self.iteration - 1) / self.iter_per_epoch
        self.epoch_detail = self.iteration / self.iter_per_epoch

    def get_all_optimizers(self):
        return {}

    def connect_trainer(self, trainer):
        pass


def stub_trainer(iter_per_epoch):
    return training.Trainer(Updater(iter_per_epoch), stop_trigger=None)


class Calls:
    """A callable that counts its calls and returns scripted values."""

    def __init__(self, *returns):
        self.returns = list(returns)
        self.count = 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.returns.pop(0) if self.returns else None


def rank_dir():
    """A directory of this rank's own, as on separate hosts."""
    return tempfile.mkdtemp(prefix=f"mn-snapshot-{COMM.rank}-")


# ------------------------------------------------------------ replica sets
def case_replica_sets_parse_as_in_chainermn_and_refuse_bad_ranks(hvd):
    parse = _multi_node_snapshot._parse_replica_sets
    evens, odds = set(range(0, 16, 2)), set(range(1, 16, 2))
    table = [([0], 4, [{0}, {1, 2, 3}]),
             ([0, 1], 4, [{0}, {1}, {2, 3}]),
             ([[0, 1], [2, 3]], 4, [{0, 1}, {2, 3}]),
             ([], 4, [{0, 1, 2, 3}]),
             ([range(0, 16, 2), range(1, 16, 2)], 16, [evens, odds]),
             ([range(0, 16, 2)], 16, [evens, odds]),
             ([], 8, [set(range(8))])]
    for sets, size, expected in table:
        assert parse(sets, size) == expected, (sets, size)
    expect_raises(ValueError, parse, [4], 4)
    expect_raises(ValueError, parse, [[0, 1], [1, 2]], 4)


def case_masters_are_the_lowest_rank_of_each_set_and_file_names_carry_the_rank(hvd):
    me = COMM.rank
    snapshot = extensions.snapshot()
    plain = snapshot.filename
    mn = multi_node_snapshot(COMM, snapshot, [[0, 1]])
    assert mn.is_master == (me in (0, 2)), (me, mn.is_master)
    assert mn.snapshot.filename == f"{plain}.{me}"

    def name_of(trainer):
        return f"deadbeef-{trainer.updater.iteration}"

    mn = multi_node_snapshot(COMM, extensions.snapshot(filename=name_of), [[0, 1]])
    trainer = stub_trainer(2)
    assert mn.snapshot.filename(trainer) == f"deadbeef-0.{me}"


def case_without_autoload_only_the_master_runs_the_snapshot(hvd):
    condition, writer = Calls(True, False), Calls()
    target = chainer.Link()
    snapshot = extensions.snapshot(target=target, condition=condition, writer=writer)
    mn = multi_node_snapshot(COMM, snapshot, [])
    trainer = stub_trainer(2)
    mn.initialize(trainer)
    mn(trainer)
    mn(trainer)
    mn.finalize()
    if COMM.rank == 0:
        assert (condition.count, writer.count) == (2, 1)
    else:
        assert (condition.count, writer.count) == (0, 0)


# ---------------------------------------------------------------- autoload
def load_digits():
    from coordinator.digits import load_digits as bundled_digits

    digits = bundled_digits()
    return chainer.datasets.TupleDataset((digits.data / 16.0).astype(np.float32),
                                         digits.target.astype(np.int32))


def prepare(out, iterations, replica_sets):
    """ChainerMN's test setup on the digits: a multi-node Adam trains a
    Classifier for `iterations` steps after the snapshot's initialize."""
    model = L.Classifier(L.Linear(64, 10))
    optimizer = chainermn.create_multi_node_optimizer(chainer.optimizers.Adam(), COMM)
    optimizer.setup(model)
    train = chainermn.scatter_dataset(load_digits() if COMM.rank == 0 else None, COMM,
                                      shuffle=True, seed=0)
    updater = training.StandardUpdater(chainer.iterators.SerialIterator(train, 10), optimizer)
    trainer = training.Trainer(updater, out=out)
    snapshot = extensions.snapshot(target=updater, autoload=True)
    mn = multi_node_snapshot(COMM, snapshot, replica_sets)
    mn.initialize(trainer)
    for _ in range(iterations):
        updater.update()
    return updater, mn, trainer, model


def case_autoload_resumes_every_rank_from_its_master_snapshot(hvd):
    out = rank_dir()
    try:
        updater, mn, trainer, model = prepare(out, 3, [])
        assert updater.iteration == 3
        mn(trainer)  # only rank 0 writes, in its own directory
        written = os.listdir(out)
        assert written == ([f"snapshot_iter_3.{COMM.rank}"] if COMM.rank == 0 else []), written
        saved = {k: p.array.copy() for k, p in model.namedparams()}

        updater, _, _, model = prepare(out, 0, [])
        assert updater.iteration == 3
        for k, p in model.namedparams():
            # Rank 0 loaded its snapshot; the others got that state from it.
            theirs = COMM.bcast_obj(saved[k] if COMM.rank == 0 else None, root=0)
            np.testing.assert_array_equal(p.array, theirs, err_msg=k)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def case_autoload_with_replica_sets_resumes_each_set_from_its_own_master(hvd):
    out = rank_dir()
    try:
        updater, mn, trainer, _ = prepare(out, 2, [0])  # sets {0} and {1, ...}
        mn(trainer)
        assert bool(os.listdir(out)) == (COMM.rank in (0, 1))
        updater, _, _, _ = prepare(out, 0, [0])
        assert updater.iteration == 2
    finally:
        shutil.rmtree(out, ignore_errors=True)


def case_autoload_when_a_master_cannot_load_raises_on_every_rank_instead_of_hanging(hvd):
    out = rank_dir()
    try:
        if COMM.rank == 0:
            with open(os.path.join(out, "snapshot_iter_5.0"), "wb") as f:
                f.write(b"not an npz file")
        try:
            prepare(out, 0, [])
        except Exception as exc:
            caught = exc
        else:
            raise AssertionError("no rank may resume")
        if COMM.rank == 0:
            assert not isinstance(caught, RuntimeError) or "master" not in str(caught)
        else:
            assert isinstance(caught, RuntimeError), repr(caught)
            assert "master rank(s) [0]" in str(caught) and "no rank resumes" in str(caught)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def case_autoload_with_masters_on_different_snapshots_raises_on_every_rank(hvd):
    out = rank_dir()
    try:
        updater, mn, trainer, _ = prepare(out, 2, [0])  # masters: ranks 0 and 1
        mn(trainer)
        if COMM.rank == 0:
            updater.iteration += 1  # (an update would need every rank)
            mn(trainer)  # rank 0 alone keeps a newer snapshot
        exc = expect_raises(RuntimeError, prepare, out, 0, [0])
        assert "different snapshots" in str(exc), str(exc)
        assert "snapshot_iter_3" in str(exc) and "snapshot_iter_2" in str(exc), str(exc)
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------- early stopping
ACCURACIES = [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.6, 0.6, 0.4, 0.4, 0.3, 0.3, 0.2, 0.2]
# Checked once per epoch (2 iterations): best at epoch 4 (0.7), then three
# epochs without improvement (patience 3), so it fires at iteration 14 and,
# at the next check, at 16.
EXPECTED = [False] * 13 + [True, False, True]


def run_trigger(trigger, values, key="main/accuracy"):
    trainer = stub_trainer(2)
    fired = []
    for value in values:
        trainer.updater.update()
        trainer.observation = {} if value is None else {key: value}
        fired.append(trigger(trainer))
    return fired


def case_early_stopping_on_variables_fires_at_the_same_iteration_on_every_rank(hvd):
    n, me = COMM.size, COMM.rank
    scale = 1 - me / n  # every rank observes a different value
    values = [chainer.Variable(np.asarray(a * scale, np.float32)) for a in ACCURACIES]
    trigger = MultiNodeEarlyStoppingTrigger(COMM, monitor="main/accuracy", patience=3,
                                            check_trigger=(1, "epoch"))
    assert run_trigger(trigger, values) == EXPECTED
    everyone = COMM.gather_obj(trigger.actual_trigger.best)
    if me == 0:
        mean_scale = sum(1 - r / n for r in range(n)) / n
        assert len(set(everyone)) == 1, everyone
        assert abs(everyone[0] - 0.7 * mean_scale) < 1e-6, everyone


def case_early_stopping_mean_counts_every_observation_of_every_rank(hvd):
    n, me = COMM.size, COMM.rank
    # Rank 0 reports every iteration; the others only the first of each
    # epoch, so the means weigh rank 0 double.
    values = [a if me == 0 or i % 2 == 0 else None for i, a in enumerate(ACCURACIES)]
    trigger = create_multi_node_early_stopping_trigger(
        COMM, monitor="main/accuracy", patience=3, check_trigger=(1, "epoch"))
    seen = []
    trainer = stub_trainer(2)
    for value in values:
        trainer.updater.update()
        trainer.observation = {} if value is None else {"main/accuracy": value}
        trigger(trainer)
        if "main/accuracy_aggregated" in trainer.observation:
            seen.append(trainer.observation["main/accuracy_aggregated"])
    epoch_means = [(2 * a + (n - 1) * a) / (n + 1) for a in ACCURACIES[::2]]
    np.testing.assert_allclose(seen, epoch_means, rtol=1e-12)


def case_early_stopping_with_no_observation_anywhere_goes_on_on_every_rank(hvd):
    trigger = MultiNodeEarlyStoppingTrigger(COMM, monitor="main/loss", patience=1,
                                            check_trigger=(1, "epoch"),
                                            max_trigger=(100, "epoch"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run_trigger(trigger, [None] * 6, key="main/loss") == [False] * 6


def case_a_trigger_only_rank_0_made_does_not_stall_the_others_checking(hvd):
    # Named after how many triggers the process had made, a spare trigger on
    # rank 0 left its working one named differently from the others': a
    # stall, then DeadlockError. ChainerMN matches them by call order.
    if COMM.rank == 0:
        MultiNodeEarlyStoppingTrigger(COMM, monitor="main/accuracy")  # never called
    trigger = MultiNodeEarlyStoppingTrigger(COMM, monitor="main/accuracy", patience=3,
                                            check_trigger=(1, "epoch"))
    assert run_trigger(trigger, ACCURACIES) == EXPECTED


def case_early_stopping_keeps_chainermn_arguments(hvd):
    trigger = MultiNodeEarlyStoppingTrigger(COMM, patients=4, max_trigger=(7, "epoch"),
                                            suffix="_mean")
    assert trigger.actual_trigger.patience == 4
    assert trigger.actual_trigger.monitor == "main/loss_mean"
    assert trigger.get_training_length() == (7, "epoch")
    assert not trigger._stop_condition()


def case_observation_aggregator_error_on_rank_0_raises_on_every_rank(hvd):
    def broken(lists):
        raise ZeroDivisionError("nothing to average")

    aggregator = ObservationAggregator(COMM, "main/loss", aggregator=broken)
    trainer = stub_trainer(2)
    trainer.updater.update()
    trainer.observation = {"main/loss": 1.0}
    if COMM.rank == 0:
        expect_raises(ZeroDivisionError, aggregator, trainer)
    else:
        exc = expect_raises(RuntimeError, aggregator, trainer)
        assert "raised on rank 0" in str(exc) and "nothing to average" in str(exc)
