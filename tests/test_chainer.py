"""The Chainer frontend's single-process parts: dataset ranges, the GPU
communicator names, and importing Chainer 7.8.1 on a current toolchain."""

import numpy as np
import pytest

from chainer_presence import CHAINER_REASON, NO_CHAINER

if NO_CHAINER:
    pytest.skip(CHAINER_REASON, allow_module_level=True)

import frontends.chainer as chainermn
from frontends.chainer import _import_chainer
from frontends.chainer.communicators import GPU_COMMUNICATORS
from frontends.chainer.datasets import index_ranges


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 10, 23, 100])
def test_exact_ranges_partition_the_dataset_with_sizes_differing_by_at_most_one(n, size):
    ranges = index_ranges(n, size, force_equal_length=False)
    covered = np.concatenate([np.arange(b, e) for b, e in ranges])
    np.testing.assert_array_equal(covered, np.arange(n))
    lengths = [e - b for b, e in ranges]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the longer ones come first


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 5, 10, 23, 100])
def test_equal_length_ranges_cover_everything_inside_the_dataset(n, size):
    ranges = index_ranges(n, size)
    assert {e - b for b, e in ranges} == {-(-n // size)}
    assert all(0 <= b <= e <= n for b, e in ranges)
    covered = set().union(*(range(b, e) for b, e in ranges))
    assert covered == set(range(n))
    duplicates = sum(e - b for b, e in ranges) - n
    assert duplicates == (-n) % size  # only the padding is repeated


@pytest.mark.parametrize("name", sorted(GPU_COMMUNICATORS))
def test_gpu_communicator_names_without_cupy_raise_before_touching_mpi(name):
    with pytest.raises(RuntimeError, match="CuPy is not installed") as info:
        chainermn.create_communicator(name)
    assert repr(name) in str(info.value) and "'naive'" in str(info.value)


def test_allreduce_grad_dtype_must_be_a_float_as_in_chainermn():
    with pytest.raises(ValueError, match="numpy.float16"):
        chainermn.create_communicator("pure_nccl", allreduce_grad_dtype=np.int32)
    with pytest.raises(ValueError, match="only available at 'pure_nccl'"):
        chainermn.create_communicator("flat", allreduce_grad_dtype=np.float16)


def test_unknown_communicator_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unrecognized communicator") as info:
        chainermn.create_communicator("fancy")
    for name in ("naive", "pure_nccl", "hierarchical", "two_dimensional", "single_node"):
        assert name in str(info.value)


def test_chainermn_names_are_all_there():
    for name in ("create_communicator", "CommunicatorBase", "create_multi_node_optimizer",
                 "scatter_dataset", "scatter_index", "create_empty_dataset", "DataSizeError",
                 "create_multi_node_evaluator", "create_multi_node_checkpointer"):
        assert hasattr(chainermn, name), name
    assert hasattr(chainermn.links, "MultiNodeBatchNormalization")
    assert hasattr(chainermn.iterators, "create_synchronized_iterator")
    assert hasattr(chainermn.iterators, "create_multi_node_iterator")
    assert hasattr(chainermn.extensions, "AllreducePersistent")
    assert chainermn.__version__ == "7.8.1"


_COMPARE_WITH_CHAINERMN = """
import types
import frontends.chainer as ours
import chainermn
missing = []
for sub in ("", "communicators", "datasets", "extensions", "functions", "iterators", "links",
            "optimizers"):
    theirs = getattr(chainermn, sub) if sub else chainermn
    mine = getattr(ours, sub) if sub else ours
    for name in dir(theirs):
        value = getattr(theirs, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue  # private, or a submodule (e.g. chainermn.extensions.checkpoint)
        if getattr(value, "__module__", "chainermn").split(".")[0] != "chainermn":
            continue  # what ChainerMN imported (e.g. its `warnings`)
        if not hasattr(mine, name):
            missing.append(f"{sub}.{name}" if sub else name)
import importlib
import pkgutil

for info in pkgutil.iter_modules(chainermn.communicators.__path__):
    if not info.name.startswith("_"):  # its communicators' module paths
        importlib.import_module(f"chainermn.communicators.{info.name}")
for name in dir(chainermn.communicators):
    value = getattr(chainermn.communicators, name)
    if isinstance(value, types.ModuleType) and not name.startswith("_") \
            and value.__name__.startswith("chainermn."):
        for cls in [v for v in vars(value).values() if isinstance(v, type)
                    and v.__module__ == value.__name__ and not v.__name__.startswith("_")]:
            if not hasattr(getattr(ours.communicators, name, None), cls.__name__):
                missing.append(f"communicators.{name}.{cls.__name__}")
for name in dir(chainermn.CommunicatorBase):  # the methods a communicator offers
    if not name.startswith("_") and not hasattr(ours.CommunicatorBase, name):
        missing.append(f"CommunicatorBase.{name}")
print("MISSING", missing)
"""


def test_every_public_name_of_the_installed_chainermn_is_there():
    """Against ChainerMN 7.8.1 itself, in a child process (importing it
    starts MPI, which this process must not)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("chainermn") is None:
        pytest.skip("the reference ChainerMN is not installed")
    out = subprocess.run([sys.executable, "-c", _COMPARE_WITH_CHAINERMN], capture_output=True,
                         text=True, timeout=120)
    assert "MISSING" in out.stdout, out.stderr[-2000:]
    assert out.stdout.split("MISSING", 1)[1].strip() == "[]", out.stdout


def test_generic_evaluator_without_a_communicator_aggregates_every_batch():
    import chainer

    class _Sum3(chainermn.extensions.GenericMultiNodeEvaluator):
        def aggregate(self, results):
            return sum(float(r.sum()) for r in results), len(results)

    data = chainer.datasets.TupleDataset(*([np.arange(10, dtype=np.float32)] * 3))
    it = chainer.iterators.SerialIterator(data, 4, repeat=False, shuffle=False)
    seen = []
    evaluator = _Sum3(None, it, lambda a, b, c: a + b + c, progress_hook=seen.append)
    assert evaluator() == (3 * 45.0, 3)
    assert evaluator() == (3 * 45.0, 3)  # the iterator is reset
    assert [len(b) for b in seen] == [4, 4, 2] * 2


def test_config_scope_records_a_user_communicators_settings_per_communicator():
    class Mine(chainermn.CommunicatorBase):
        def __init__(self, fast):
            with self.config_scope():
                assert self.within_config_scope
                self.fast = fast
            self.counter = 0  # outside the scope: not a config

    Mine.__abstractmethods__ = frozenset()
    a, b = Mine(True), Mine(False)
    assert not a.within_config_scope
    assert a.fast is True and a.counter == 0
    assert a.get_config("fast") is True and a.get_config() == {"fast": True}
    assert b.get_config() == {"fast": False}  # each communicator its own
    with pytest.raises(ValueError, match="counter"):
        a.get_config("counter")


def test_chainer_environment_check_is_skipped_only_when_it_cannot_run():
    import sys

    check = sys.modules["chainer._environment_check"]
    skipped = (check.__doc__ or "").startswith("Chainer's import-time environment check, "
                                               "skipped")
    assert skipped == (not _import_chainer.environment_check_can_run())


class _Loopback:
    """A communicator of rank 0 whose send and gather keep what a peer
    would receive, and whose recv and scatter hand it back."""

    rank, size = 0, 2

    def __init__(self):
        self.sent = []

    def send(self, data, rank, tag=0):
        self.sent.append(data)

    def recv(self, rank, tag=0):
        return self.sent.pop(0)


def test_model_parallel_functions_make_their_placeholders_with_the_inputs_module(monkeypatch):
    """On a GPU the inputs are CuPy arrays and Chainer refuses a NumPy
    array beside them (TypeError: incompatible array types are mixed):
    send's placeholder, the delegate it returns, recv's zero gradients and
    pseudo_connect's empty delegate are made by the module Chainer names
    for the arrays (chainer.backend.get_array_module), NumPy here."""
    import chainer

    made = []

    class Module:
        def __getattr__(self, name):
            attr = getattr(np, name)
            if name not in ("empty", "zeros", "ones"):
                return attr
            return lambda *a, **k: made.append(name) or attr(*a, **k)

    import sys

    real = chainer.backend.get_array_module

    def get_array_module(*arrays):  # the recording module for our code only
        ours = sys._getframe(1).f_globals.get("__name__", "").startswith("frontends.")
        return Module() if ours else real(*arrays)

    monkeypatch.setattr(chainer.backend, "get_array_module", get_array_module)
    comm = _Loopback()
    x = chainer.Variable(np.arange(3, dtype=np.float32))
    delegate = chainermn.functions.send(x, comm, rank=1)
    assert made.count("empty") == 2, made  # the placeholder and the delegate
    y = chainermn.functions.recv(comm, rank=1, delegate_variable=delegate)
    np.testing.assert_array_equal(y.array, np.arange(3))
    made.clear()
    comm.sent.append((np.ones(3, np.float32),))  # the gradient x will receive
    y2 = chainer.functions.sum(y * 0)  # y gets a gradient of zeros
    y2.backward()
    assert "zeros" in made, made  # the delegate's zero gradient
    made.clear()
    z, = chainermn.functions.pseudo_connect(None, chainer.Variable(np.ones(2, np.float32)))
    assert made == ["empty"], made


class _Comm:
    """What the checks below read of a communicator before any communication."""
    rank, size = 0, 2


class _Snapshot:
    filename = "snapshot"


@pytest.mark.parametrize("call,fragment", [
    (lambda: chainermn.scatter_dataset(list(range(4)), _Comm(), root=2), "root 2 is not a rank"),
    (lambda: chainermn.scatter_dataset(list(range(4)), _Comm(), root=-1),
     "root -1 is not a rank"),
    (lambda: chainermn.scatter_index(4, _Comm(), root=5), "root 5 is not a rank"),
    (lambda: index_ranges(4, 0), "cannot split 4 samples over 0 ranks"),
    (lambda: index_ranges(-1, 2), "cannot split -1 samples over 2 ranks"),
    (lambda: chainermn.create_multi_node_checkpointer("c", _Comm(), cp_interval=0),
     "cp_interval and gc_interval must be positive"),
    (lambda: chainermn.create_multi_node_checkpointer("c", _Comm(), gc_interval=-1),
     "cp_interval and gc_interval must be positive"),
    (lambda: chainermn.extensions.multi_node_snapshot(_Comm(), _Snapshot(), [[0, 2]]),
     "names ranks [2], outside 0..1"),
    (lambda: chainermn.extensions.multi_node_snapshot(_Comm(), _Snapshot(), [[0], [0, 1]]),
     "ranks [0] are in more than one replica set"),
    (lambda: chainermn.extensions.multi_node_snapshot(None, _Snapshot(), []),
     "needs a communicator and a snapshot extension"),
    (lambda: chainermn.extensions.GenericMultiNodeEvaluator(_Comm(), None, None, root=2),
     "root 2 is not a rank of the communicator"),
    (lambda: chainermn.extensions.AllreducePersistent({"not": "a link"}, _Comm())(),
     "the model must be a chainer.Link, got dict"),
])
def test_arguments_chainermn_asserts_on_raise_an_assertion_error_that_says_why(call, fragment):
    # ChainerMN checks these with `assert`: code written for it that catches
    # AssertionError still does; they are ValueErrors too, and say what was
    # wrong.
    with pytest.raises(AssertionError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert fragment in str(info.value), str(info.value)
