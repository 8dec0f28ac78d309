"""Steady-state training allocates nothing per step in the coordinator
(checked with tracemalloc), and fusion buffers stay within the threshold."""

import tracemalloc

import numpy as np

THRESHOLD = 1 << 20  # set by tests/test_memory_mpi.py


def _step(hvd, grads, outs, step):
    handles = [hvd.allreduce_async(g, name=f"mem.{i}", output=o) for i, (g, o) in
               enumerate(zip(grads, outs))]
    handles.append(hvd.broadcast_async(grads[0], root_rank=0, name="mem.bcast",
                                       output=outs[-1]))
    for h in handles:
        hvd.synchronize(h)


def case_steady_state_training_allocates_nothing_per_step(hvd):
    from coordinator import runtime

    rng = np.random.default_rng(hvd.rank())
    shapes = [(256, 256), (256,), (128, 64), (64,), (1000,), (300, 300)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    outs = [np.empty_like(g) for g in grads] + [np.empty_like(grads[0])]
    tensor_bytes = sum(g.nbytes for g in grads)
    for step in range(30):  # warm up: caches, fusion buffers, interned names
        _step(hvd, grads, outs, step)
    tracemalloc.start(25)
    try:
        base_current, _ = tracemalloc.get_traced_memory()
        before = tracemalloc.take_snapshot()
        tracemalloc.reset_peak()
        for step in range(200):
            _step(hvd, grads, outs, step)
        current, peak = tracemalloc.get_traced_memory()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    filters = [tracemalloc.Filter(True, "*/coordinator/*")]
    growth = sum(stat.size_diff for stat in
                 after.filter_traces(filters).compare_to(before.filter_traces(filters),
                                                         "filename"))
    # No leak: 200 steps leave the coordinator's memory where it was.
    assert growth < 64 * 1024, f"coordinator memory grew by {growth} bytes over 200 steps"
    # No tensor-sized allocation per step: the peak stays far below one
    # step's tensors (everything goes through the reused fusion buffer).
    assert peak - base_current < tensor_bytes / 4, (peak - base_current, tensor_bytes)
    assert runtime.current().buffers.nbytes() <= 2 * THRESHOLD
