"""A cached tensor submitted on one rank with another description (run by
tests/test_refusals_mpi.py with stall checks off): that rank describes it in
a round while the others set its bit in the negotiation cycle for the
cached description. Every rank gets the TensorMismatchError naming both
descriptions, and the job goes on. It used to wait for the stall check's
report (30 s by default), and for ever with stall checks off."""

import numpy as np

from core_cases import assert_equal, expect_raises


def _cached_then_changed_on_one_rank(hvd, name, call, good, changed, fragment):
    n, me = hvd.size(), hvd.rank()
    odd = n - 1
    for _ in range(3):  # cached on every rank, and run in the cycle
        call(good(me), name)
    exc = expect_raises(hvd.TensorMismatchError, call,
                        changed(me) if me == odd else good(me), name)
    assert fragment in str(exc) and f"'{name}'" in str(exc), str(exc)
    assert f"rank {odd}" in str(exc), str(exc)
    call(good(me), name)  # the cached description runs again


def case_a_cached_tensor_changed_on_one_rank_fails_at_once_everywhere(hvd):
    n = hvd.size()

    def allreduce(op):
        return lambda t, name: hvd.allreduce(t, op=op, name=name)

    _cached_then_changed_on_one_rank(
        hvd, "cm.shape", allreduce(hvd.Sum), lambda me: np.ones((n, 2)),
        lambda me: np.ones((n, 2, 1)), "Mismatched shape")
    _cached_then_changed_on_one_rank(
        hvd, "cm.dtype", allreduce(hvd.Sum), lambda me: np.ones(4, np.float32),
        lambda me: np.ones(4, np.float64), "Mismatched dtype")
    _cached_then_changed_on_one_rank(
        hvd, "cm.rs", lambda t, name: hvd.reducescatter(t, op=hvd.Sum, name=name),
        lambda me: np.ones((n, 3)), lambda me: np.ones((n, 3, 1)), "Mismatched shape")
    _cached_then_changed_on_one_rank(
        hvd, "cm.bcast", lambda t, name: hvd.broadcast(t, root_rank=0, name=name),
        lambda me: np.ones(5), lambda me: np.ones(6), "Mismatched shape")
    out = hvd.allreduce(np.ones(3), op=hvd.Sum, name="cm.after")
    assert_equal(out, np.full(3, float(n)))
