"""frontends.tensorflow and frontends.tensorflow.keras against horovod.tensorflow
0.28.1's public signatures (parameter names, order and defaults), so that a
Horovod program that passes arguments by keyword or position switches with one
import. Extra parameters of ours must be optional and come last."""

import pytest

from horovod_signatures import AVG, GPS, NONE, REQUIRED, check_signature

pytest.importorskip("tensorflow")

import frontends.tensorflow as hvd  # noqa: E402
import frontends.tensorflow.keras as hvd_keras  # noqa: E402
from frontends.tensorflow import util  # noqa: E402
from frontends.tensorflow.keras import callbacks, elastic as keras_elastic  # noqa: E402

R = REQUIRED
# horovod.tensorflow 0.28.1 (its __init__, mpi_ops and functions modules).
HOROVOD_TF = {
    "allreduce": [
        ("tensor", R), ("average", None), ("device_dense", ""), ("device_sparse", ""),
        ("compression", NONE), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0),
        ("name", None), ("process_set", GPS), ("ignore_name_scope", False)],
    "reducescatter": [
        ("tensor", R), ("device_dense", ""), ("compression", NONE), ("op", AVG), ("name", None),
        ("process_set", GPS), ("ignore_name_scope", False), ("prescale_factor", 1.0),
        ("postscale_factor", 1.0)],
    "grouped_allreduce": [
        ("tensors", R), ("average", None), ("device_dense", ""), ("device_sparse", ""),
        ("compression", NONE), ("op", None), ("prescale_factor", 1.0), ("postscale_factor", 1.0),
        ("process_set", GPS), ("ignore_name_scope", False), ("name", None)],
    "grouped_reducescatter": [
        ("tensors", R), ("device_dense", ""), ("compression", NONE), ("op", AVG),
        ("process_set", GPS), ("prescale_factor", 1.0), ("postscale_factor", 1.0)],
    "broadcast_global_variables": [("root_rank", R)],
    "DistributedOptimizer": [
        ("optimizer", R), ("name", None), ("use_locking", False), ("device_dense", ""),
        ("device_sparse", ""), ("compression", NONE), ("sparse_as_dense", False),
        ("backward_passes_per_step", 1), ("op", AVG), ("gradient_predivide_factor", 1.0),
        ("average_aggregated_gradients", False), ("num_groups", 0), ("groups", None),
        ("process_set", GPS), ("scale_local_gradients", True)],
    "DistributedGradientTape": [
        ("gradtape", R), ("device_dense", ""), ("device_sparse", ""), ("compression", NONE),
        ("sparse_as_dense", False), ("op", AVG), ("gradient_predivide_factor", 1.0),
        ("num_groups", 0), ("groups", None), ("process_set", GPS),
        ("scale_local_gradients", True)],
    "PartialDistributedGradientTape": [
        ("gradtape", R), ("device_dense", ""), ("device_sparse", ""), ("compression", NONE),
        ("sparse_as_dense", False), ("op", AVG), ("gradient_predivide_factor", 1.0),
        ("num_groups", 0), ("groups", None), ("process_set", GPS), ("local_layers", None),
        ("scale_local_gradients", True)],
    "init": [],
    "allgather": [
        ("tensor", R), ("name", None), ("ignore_name_scope", False), ("process_set", GPS)],
    "grouped_allgather": [
        ("tensors", R), ("name", None), ("ignore_name_scope", False), ("process_set", GPS)],
    "broadcast": [
        ("tensor", R), ("root_rank", R), ("name", None), ("ignore_name_scope", False),
        ("process_set", GPS)],
    "broadcast_": [("variables", R), ("root_rank", R), ("name", None), ("process_set", GPS)],
    "alltoall": [
        ("tensor", R), ("splits", None), ("name", None), ("ignore_name_scope", False),
        ("process_set", GPS)],
    "join": [],
    "size_op": [("process_set_id", 0), ("name", None)],
    "process_set_included_op": [("process_set_id", 0), ("name", None)],
    "local_size_op": [("name", None)],
    "rank_op": [("name", None)],
    "local_rank_op": [("name", None)],
    "broadcast_variables": [
        ("variables", R), ("root_rank", R), ("process_set", GPS), ("inplace", False)],
    "broadcast_object": [
        ("obj", R), ("root_rank", 0), ("session", None), ("name", None), ("process_set", GPS)],
    "broadcast_object_fn": [
        ("root_rank", 0), ("session", None), ("name", None), ("process_set", GPS)],
    "allgather_object": [("obj", R), ("session", None), ("name", None), ("process_set", GPS)],
}
HOROVOD_TF["vars_to_refs"] = [("vars", R)]
HOROVOD_TF["refs_to_vars"] = [("refs", R)]
# horovod.tensorflow.keras 0.28.1.
HOROVOD_KERAS = {
    "DistributedOptimizer": [
        ("optimizer", R), ("name", None), ("device_dense", ""), ("device_sparse", ""),
        ("compression", NONE), ("sparse_as_dense", False), ("gradient_predivide_factor", 1.0),
        ("op", AVG), ("backward_passes_per_step", 1), ("average_aggregated_gradients", False),
        ("num_groups", 0), ("groups", None), ("process_set", GPS),
        ("scale_local_gradients", True)],
    "broadcast_global_variables": [("root_rank", R)],
    "allreduce": [
        ("value", R), ("name", None), ("average", None), ("prescale_factor", 1.0),
        ("postscale_factor", 1.0), ("op", None), ("compression", NONE)],
    "allgather": [("value", R), ("name", None)],
    "broadcast": [("value", R), ("root_rank", R), ("name", None)],
    "reducescatter": [("value", R), ("name", None), ("op", AVG)],
    "load_model": [
        ("filepath", R), ("custom_optimizers", None), ("custom_objects", None),
        ("compression", NONE), ("legacy_opts", False)],
}
# Constructors (self left out).
HOROVOD_CLASSES = {
    (hvd, "BroadcastGlobalVariablesHook"): [("root_rank", R), ("device", "")],
    (callbacks, "BroadcastGlobalVariablesCallback"): [("root_rank", R), ("device", ""),
                                                      ("local_variables", None)],
    (callbacks, "MetricAverageCallback"): [("device", "")],
    (callbacks, "LearningRateScheduleCallback"): [
        ("initial_lr", R), ("multiplier", R), ("start_epoch", 0), ("end_epoch", None),
        ("staircase", True), ("momentum_correction", True), ("steps_per_epoch", None)],
    (callbacks, "LearningRateWarmupCallback"): [
        ("initial_lr", R), ("warmup_epochs", 5), ("momentum_correction", True),
        ("steps_per_epoch", None), ("verbose", 0)],
    (keras_elastic, "KerasState"): [("model", R), ("optimizer", None)],
    (keras_elastic, "CommitStateCallback"): [("state", R), ("batches_per_commit", 1)],
    (keras_elastic, "UpdateBatchStateCallback"): [("state", R)],
    (keras_elastic, "UpdateEpochStateCallback"): [("state", R)],
}


def _check(fn, expected, skip_first=False):
    check_signature(fn, expected, hvd, skip_first)


@pytest.mark.parametrize("name", sorted(HOROVOD_TF))
def test_signature_matches_horovod_tensorflow(name):
    module = util if name in ("vars_to_refs", "refs_to_vars") else hvd
    _check(getattr(module, name), HOROVOD_TF[name])


@pytest.mark.parametrize("name", sorted(HOROVOD_KERAS))
def test_signature_matches_horovod_tensorflow_keras(name):
    _check(getattr(hvd_keras, name), HOROVOD_KERAS[name])


@pytest.mark.parametrize("where", sorted(HOROVOD_CLASSES, key=lambda k: k[1]),
                         ids=lambda k: k[1])
def test_constructor_matches_horovod(where):
    module, name = where
    _check(getattr(module, name).__init__, HOROVOD_CLASSES[where], skip_first=True)


def test_every_horovod_name_is_exported():
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
                 "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
                 "SyncBatchNormalization", "BroadcastGlobalVariablesHook", "elastic", "util",
                 "is_homogeneous", "mpi_threads_supported", "start_timeline", "stop_timeline"):
        assert hasattr(hvd, name), name
    for name in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                 "LearningRateScheduleCallback", "LearningRateWarmupCallback",
                 "BestModelCheckpoint"):
        assert hasattr(callbacks, name), name


def test_horovods_common_helpers_are_here_too():
    """horovod.tensorflow re-exports these from horovod.common.util (Horovod's
    own Adasum test calls hvd.gpu_available before its GPU skip)."""
    import tensorflow as tf

    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    assert hvd.gpu_available("tensorflow") is has_gpu
    assert hvd.gpu_available("horovod.tensorflow") is has_gpu
    assert hvd.gpu_available("mxnet") is False
    assert hvd.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert hvd.split_list([1], 3) == [[1], [], []]
    assert [n for n in range(10) if hvd.check_num_rank_power_of_2(n)] == [1, 2, 4, 8]
    assert hvd.check_extension("horovod.tensorflow", "HOROVOD_WITH_TENSORFLOW", __file__) is None
