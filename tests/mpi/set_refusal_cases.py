"""Input refused on one member of a process set of two of three ranks (run
by tests/test_refusals_mpi.py at np=3). A set other than the global one is
negotiated in a stream of request lists, never in the cycle; a refusal and
the refusing rank's next step of the same name can go in one list."""

import numpy as np

from core_cases import assert_equal, expect_raises

PAIR = None  # ranks 0 and 1


def setup(hvd):
    global PAIR
    PAIR = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[PAIR])


def case_a_refused_step_and_the_next_in_one_list_stay_in_step(hvd):
    """Rank 1 refuses step 2 of a cached tensor and submits step 3 at once,
    often into the same list as the refusal: rank 0's step 2 fails with
    the refusal and its step 3 runs with rank 1's. (Described by its cache
    id, rank 1's step 3 was read before the refusal and ran with rank 0's
    step 2, whose step 3 then failed.)"""
    me = hvd.rank()
    if me not in PAIR.ranks:
        return
    total = lambda step: np.full(3, float(sum(step + r for r in PAIR.ranks)))
    for rep in range(20):
        name = f"t{rep % 2}"
        for step in range(2):
            got = hvd.allreduce(np.full(3, step + me, np.float64), op=hvd.Sum, name=name,
                                process_set=PAIR)
            assert_equal(got, total(step))
        if me == 1:
            expect_raises(ValueError, hvd.allreduce, np.ones(3, np.complex128), name=name,
                          process_set=PAIR)
        else:
            exc = expect_raises(hvd.HorovodInternalError, hvd.allreduce,
                                np.full(3, 2.0 + me), op=hvd.Sum, name=name, process_set=PAIR)
            assert f"rank 1 rejected allreduce of tensor '{name}'" in str(exc), (rep, str(exc))
        got = hvd.allreduce(np.full(3, 3.0 + me), op=hvd.Sum, name=name, process_set=PAIR)
        assert_equal(got, total(3), f"rep {rep}")
