"""The stall inspector under HOROVOD_STALL_CHECK_TIME_SECONDS=1 and
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3 (set by tests/test_stalls_mpi.py)."""

import time

import numpy as np

from core_cases import assert_equal, expect_raises


def case_stalled_tensor_fails_on_every_rank_naming_the_missing_rank(hvd):
    last = hvd.size() - 1
    if hvd.rank() == last:
        time.sleep(4.5)  # past the shutdown time: it never submitted in time
        start = time.monotonic()
        exc = expect_raises(hvd.StallError, hvd.allreduce, np.ones(2), name="stalled")
        assert time.monotonic() - start < 2.0
    else:
        start = time.monotonic()
        exc = expect_raises(hvd.StallError, hvd.allreduce, np.ones(2), name="stalled")
        waited = time.monotonic() - start
        assert 2.5 <= waited < 10, waited
    assert f"rank {last} did not submit it" in str(exc), str(exc)
    assert "'stalled'" in str(exc)
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.stall"),
                 np.full(2, float(hvd.size())))
