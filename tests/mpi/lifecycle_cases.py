"""init/shutdown: errors on misuse, re-initialisation, shutdown by one rank."""

import time

import numpy as np

from core_cases import assert_equal, expect_raises


def case_second_init_is_an_error(hvd):
    exc = expect_raises(RuntimeError, hvd.init)
    assert "already" in str(exc) and "shutdown()" in str(exc)


def case_op_after_shutdown_is_a_clear_error_and_init_again_works(hvd):
    hvd.shutdown()
    assert not hvd.is_initialized()
    exc = expect_raises(hvd.NotInitializedError, hvd.allreduce, np.ones(2), name="late")
    assert "shut down" in str(exc) and "'late'" in str(exc)
    assert isinstance(exc, ValueError) and isinstance(exc, hvd.HorovodInternalError)
    expect_raises(ValueError, hvd.rank)
    hvd.shutdown()  # a second shutdown is harmless
    hvd.init()
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="again"),
                 np.full(2, float(hvd.size())))


def case_shutdown_by_one_rank_fails_the_others_pending_ops(hvd):
    last = hvd.size() - 1
    if hvd.rank() == last:
        time.sleep(0.2)
        hvd.shutdown()
    else:
        h = hvd.allreduce_async(np.ones(2), name="orphan")
        exc = expect_raises(hvd.ShutdownError, hvd.synchronize, h)
        assert f"rank {last} called shutdown()" in str(exc), str(exc)
        assert "'orphan'" in str(exc)
        exc = expect_raises(hvd.HorovodInternalError, hvd.allreduce, np.ones(2), name="x")
        # The truth: another rank shut the coordinator down.
        assert not hvd.is_initialized()
        hvd.shutdown()
    hvd.init()
    assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="revived"),
                 np.full(1, float(hvd.size())))
