"""PyTorch and TensorFlow in one process share one coordinator."""

import threading

import numpy as np

from tf_common import configure_tensorflow


def setup(hvd):
    import frontends.tensorflow as hvd_tf
    import frontends.torch as hvd_torch

    configure_tensorflow()
    hvd_torch.init()
    hvd_tf.init()


def case_one_background_thread_for_both_frameworks(hvd):
    import frontends.tensorflow as hvd_tf
    import frontends.torch as hvd_torch

    workers = [t for t in threading.enumerate() if t.name == "coordinator-background"]
    assert len(workers) == 1, workers
    assert hvd_torch.rank() == hvd_tf.rank() == hvd.rank()
    assert hvd_torch.size() == hvd_tf.size() == hvd.size()
    hvd_torch.init()  # again: harmless, still one thread
    hvd_tf.init()
    assert len([t for t in threading.enumerate() if t.name == "coordinator-background"]) == 1


def case_both_frameworks_reduce_correctly_while_in_flight_together(hvd):
    import tensorflow as tf
    import torch

    import frontends.tensorflow as hvd_tf
    import frontends.torch as hvd_torch

    n, me = hvd.size(), hvd.rank()
    for step in range(5):
        t = torch.full((4, 3), float(me + step))
        handle = hvd_torch.allreduce_async(t, name=f"mix.torch.{step}", op=hvd_torch.Sum)
        out_tf = hvd_tf.allreduce(tf.fill([5], float(10 * me + step)), name=f"mix.tf.{step}",
                                  op=hvd_tf.Sum)
        out_torch = hvd_torch.synchronize(handle)
        assert torch.equal(out_torch, torch.full((4, 3), float(sum(range(n)) + n * step)))
        np.testing.assert_array_equal(out_tf.numpy(),
                                      np.full(5, float(10 * sum(range(n)) + n * step)))


def case_tensors_of_both_frameworks_fuse_into_one_response(hvd):
    import tensorflow as tf
    import torch

    import frontends.tensorflow as hvd_tf
    import frontends.torch as hvd_torch
    from coordinator import runtime

    bg = runtime.current().background
    ctl = bg.controller
    hvd.barrier()
    before = bg.stats["responses"]
    if ctl is not None:
        # Rank 0 holds ready tensors until 20 bytes are (both, 12 + 8), not
        # for a time: a rank late by more than a cycle time split them.
        # (After the barrier, which it would hold too; before its own part
        # of either tensor, without which neither is ready.)
        settings = ctl.cycle_time, ctl.fusion_threshold
        ctl.cycle_time, ctl.fusion_threshold = 60.0, 20
    try:
        handle = hvd_torch.allreduce_async(torch.ones(3), name="fuse.torch", op=hvd_torch.Sum)
        out = hvd_tf.allreduce(tf.ones([2]), name="fuse.tf", op=hvd_tf.Sum)
        hvd_torch.synchronize(handle)
    finally:
        if ctl is not None:
            ctl.cycle_time, ctl.fusion_threshold = settings
    fused = bg.stats["responses"] - before
    assert out.numpy().tolist() == [float(hvd.size())] * 2
    assert fused == 1, f"{fused} responses for the two tensors"
