"""Input refused on one rank only (run by tests/test_refusals_mpi.py, with
the stall shutdown time left at its default, never): the rank that called
gets a ValueError at once, and every other member's copy of the operation
fails promptly, naming that rank and its reason. The job goes on."""

import time

import numpy as np

from core_cases import assert_equal, expect_raises

PROMPT = 10.0  # seconds: far below any stall time, far above a slow machine


def _others_fail(hvd, fn, *fragments):
    start = time.monotonic()
    exc = expect_raises(hvd.HorovodInternalError, fn)
    assert time.monotonic() - start < PROMPT
    for fragment in fragments:
        assert fragment in str(exc), (fragment, str(exc))
    return exc


def _then_the_job_goes_on(hvd, name):
    out = hvd.allreduce(np.ones(3), op=hvd.Sum, name=name)
    assert_equal(out, np.full(3, float(hvd.size())))


def case_an_invalid_root_on_one_rank_fails_the_broadcast_everywhere(hvd):
    me = hvd.rank()
    if me == 1:
        exc = expect_raises(ValueError, hvd.broadcast, np.ones(2), root_rank=5, name="b")
        assert "invalid root rank 5" in str(exc)
    else:
        _others_fail(hvd, lambda: hvd.broadcast(np.ones(2), root_rank=0, name="b"),
                     "rank 1 rejected broadcast of tensor 'b'", "ValueError",
                     "invalid root rank 5")
    _then_the_job_goes_on(hvd, "after.b")
    # The name works again, on every rank.
    out = hvd.broadcast(np.full(2, float(me)), root_rank=0, name="b")
    assert_equal(out, np.zeros(2))


def case_bad_alltoall_splits_on_one_rank_fail_it_everywhere(hvd):
    n, me = hvd.size(), hvd.rank()
    if me == n - 1:
        time.sleep(0.3)  # the others have submitted already
        expect_raises(ValueError, hvd.alltoall, np.ones(n), splits=[5] * n, name="a")
    else:
        _others_fail(hvd, lambda: hvd.alltoall(np.ones(n), name="a"),
                     f"rank {n - 1} rejected alltoall of tensor 'a'", "splits")
    _then_the_job_goes_on(hvd, "after.a")


def case_an_unsupported_dtype_on_one_rank_fails_it_everywhere(hvd):
    me = hvd.rank()
    if me == 0:
        expect_raises(ValueError, hvd.allreduce, np.ones(2, np.complex64), name="d")
    else:
        time.sleep(0.3)  # rank 0 refused before these submit
        _others_fail(hvd, lambda: hvd.allreduce(np.ones(2), name="d"),
                     "rank 0 rejected allreduce of tensor 'd'", "complex64")
    _then_the_job_goes_on(hvd, "after.d")


def case_a_grouped_allreduce_of_different_sizes_fails_on_every_rank(hvd):
    me = hvd.rank()
    count = 2 if me == 0 else 3
    exc = expect_raises(hvd.HorovodInternalError, hvd.grouped_allreduce,
                        [np.ones(2)] * count, name="grp")
    assert "Mismatched group size" in str(exc) and "'grp'" in str(exc), str(exc)
    assert "rank 0 sent group size 2" in str(exc), str(exc)
    _then_the_job_goes_on(hvd, "after.grp")
    out = hvd.grouped_allreduce([np.ones(2)] * 2, op=hvd.Sum, name="grp")
    assert_equal(out[1], np.full(2, float(hvd.size())))


def case_a_refused_group_member_fails_the_group_everywhere(hvd):
    me = hvd.rank()
    if me == 1:
        expect_raises(ValueError, hvd.grouped_allreduce,
                      [np.ones(2), np.ones(2, np.complex128)], name="g2")
    else:
        _others_fail(hvd, lambda: hvd.grouped_allreduce([np.ones(2), np.ones(2)], name="g2"),
                     "rank 1 rejected grouped allreduce 'g2'")
    _then_the_job_goes_on(hvd, "after.g2")


def case_a_refused_step_of_a_cached_tensor_fails_that_step_everywhere(hvd):
    """The others' copy waits in the negotiation cycle (the tensor is
    cached); the refusing rank's next step of the same name may set its
    cycle bit before its refusal reaches rank 0 in a round. It must not run
    with the others' refused step: each rank's Nth submission meets the
    others' Nth."""
    me, n = hvd.rank(), hvd.size()
    for step in range(2):
        assert_equal(hvd.allreduce(np.full(3, step + me, np.float64), op=hvd.Sum, name="t3"),
                     np.full(3, float(sum(step + r for r in range(n)))))
    if me == 1:
        expect_raises(ValueError, hvd.allreduce, np.ones(3, np.complex128), name="t3")
    else:
        _others_fail(hvd, lambda: hvd.allreduce(np.full(3, 2.0 + me), op=hvd.Sum, name="t3"),
                     "rank 1 rejected allreduce of tensor 't3'")
    assert_equal(hvd.allreduce(np.full(3, 3.0 + me), op=hvd.Sum, name="t3"),
                 np.full(3, float(sum(3 + r for r in range(n)))))


def case_a_refused_instance_of_a_cached_group_fails_it_everywhere(hvd):
    """The others' members wait in the negotiation cycle (the group is
    cached), where the refusal, which goes to a round, cannot meet them:
    they fail as members owed (rank 0 tells them so), and the next
    instance runs everywhere."""
    me, n = hvd.rank(), hvd.size()
    for _ in range(2):
        out = hvd.grouped_allreduce([np.ones(2), np.ones(3)], op=hvd.Sum, name="g3")
        assert_equal(out[1], np.full(3, float(n)))
    if me == 1:
        expect_raises(ValueError, hvd.grouped_allreduce,
                      [np.ones(2), np.ones(3, np.complex128)], name="g3")
    else:
        _others_fail(hvd, lambda: hvd.grouped_allreduce([np.ones(2), np.ones(3)], op=hvd.Sum,
                                                        name="g3"),
                     "rank 1 rejected grouped allreduce 'g3'")
    out = hvd.grouped_allreduce([np.ones(2), np.ones(3)], op=hvd.Sum, name="g3")
    assert_equal(out[0], np.full(2, float(n)))


def case_a_name_that_cannot_be_encoded_is_refused_and_the_coordinator_lives(hvd):
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(2), name="x\udc80")
    assert "UTF-8" in str(exc)
    _then_the_job_goes_on(hvd, "after.encoding")
    assert hvd.is_initialized()


def case_nan_scale_factors_on_every_rank_agree(hvd):
    nan = float("nan")
    out = hvd.allreduce(np.ones(2), op=hvd.Sum, prescale_factor=nan, name="nan.pre")
    assert np.isnan(out).all()
    outs = hvd.grouped_allreduce([np.ones(2), np.ones(3)], op=hvd.Sum, postscale_factor=nan,
                                 name="nan.post")
    assert all(np.isnan(o).all() for o in outs)
    _then_the_job_goes_on(hvd, "after.nan")


def _owing(hvd):
    """Waits until rank 0's refusal has reached this rank as a debt (its
    background thread holds the notice), as a rank a moment late does."""
    from coordinator import runtime

    bg = runtime.current().background
    deadline = time.monotonic() + PROMPT
    while not bg.owed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert bg.owed, "rank 0's refusal never reached this rank"


def case_every_rank_refusing_a_moment_apart_leaves_the_next_copy_whole(hvd):
    """Rank 0 refuses first and submits the name's next copy at once; the
    others refuse theirs after hearing of rank 0's. Their refusals are
    their copies of the failed operation: they stay here, where they used
    to reach rank 0 and fail rank 0's next copy with their old reason."""
    n, me = hvd.size(), hvd.rank()
    for step in range(3):
        if me:
            _owing(hvd)
        expect_raises(ValueError, hvd.alltoall, np.ones(n + 1), name="late.a")
        out = hvd.alltoall(np.full(n, float(me + step)), name="late.a")
        assert_equal(out, np.arange(n, dtype=np.float64) + step)
    for step in range(3):
        if me:
            _owing(hvd)
        expect_raises(ValueError, hvd.grouped_allreduce,
                      [np.ones(2), np.ones(2, np.complex128)], name="late.g")
        out = hvd.grouped_allreduce([np.ones(2), np.full(3, float(step))], op=hvd.Sum,
                                    name="late.g")
        assert_equal(out[1], np.full(3, float(n * step)))
    _then_the_job_goes_on(hvd, "after.late")


def _steps_stay_in_step(hvd, name, bad_step_call):
    """Rank 1 fails step 0 locally (bad_step_call); every later step of the
    name must combine every rank's value of that step, not rank 1's step k+1
    with the others' step k."""
    n, me = hvd.size(), hvd.rank()
    for step in range(3):
        value = np.full(2, 100.0 * step + me)
        if step == 0 and me == 1:
            expect_raises(ValueError, bad_step_call, value)
            continue
        if step == 0:
            _others_fail(hvd, lambda: hvd.allreduce(value, op=hvd.Sum, name=name),
                         f"rank 1 rejected allreduce of tensor '{name}'")
            continue
        out = hvd.allreduce(value, op=hvd.Sum, name=name)
        assert_equal(out, np.full(2, 100.0 * step * n + n * (n - 1) / 2))


def case_a_process_set_one_rank_cannot_use_is_its_refusal_and_later_steps_stay_in_step(hvd):
    # The bad set was refused on that rank alone, before anything was sent:
    # the others waited, and that rank's next copy of the name met their
    # copy of this step.
    _steps_stay_in_step(hvd, "ps.c", lambda v: hvd.allreduce(v, op=hvd.Sum, name="ps.c",
                                                             process_set="x"))
    unregistered = hvd.ProcessSet([0, 1])
    _steps_stay_in_step(hvd, "ps.u", lambda v: hvd.allreduce(v, op=hvd.Sum, name="ps.u",
                                                             process_set=unregistered))
    _then_the_job_goes_on(hvd, "after.ps")


def case_an_empty_group_on_one_rank_fails_the_group_everywhere(hvd):
    # An empty group returned [] at once on its rank, without a word to the
    # others, whose copy then met that rank's next one.
    n, me = hvd.size(), hvd.rank()
    for step in range(3):
        tensors = [np.full(2, 100.0 * step + me), np.ones(3)]
        if step == 0 and me == 1:
            exc = expect_raises(ValueError, hvd.grouped_allreduce, [], name="empty.g")
            assert "no tensors" in str(exc), str(exc)
        elif step == 0:
            _others_fail(hvd, lambda: hvd.grouped_allreduce(tensors, op=hvd.Sum, name="empty.g"),
                         "rank 1 rejected grouped allreduce 'empty.g'", "no tensors")
        else:
            out = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="empty.g")
            assert_equal(out[0], np.full(2, 100.0 * step * n + n * (n - 1) / 2))
    for call in (hvd.grouped_allreduce, hvd.grouped_allgather, hvd.grouped_reducescatter):
        expect_raises(ValueError, call, [], name=f"empty.{call.__name__}")  # on every rank
    _then_the_job_goes_on(hvd, "after.empty")


def case_an_object_one_rank_cannot_pickle_fails_the_exchange_everywhere(hvd):
    import threading

    n, me = hvd.size(), hvd.rank()
    for step in range(3):
        if step == 0 and me == 1:
            expect_raises(TypeError, hvd.allgather_object, threading.Lock(), name="pk")
        elif step == 0:
            _others_fail(hvd, lambda: hvd.allgather_object((step, me), name="pk"),
                         "rank 1 rejected allgather_object 'pk'", "pickle")
        else:
            assert hvd.allgather_object((step, me), name="pk") == [(step, r) for r in range(n)]
    if me == 0:
        expect_raises(TypeError, hvd.broadcast_object, threading.Lock(), name="pkb")
    else:
        _others_fail(hvd, lambda: hvd.broadcast_object(None, name="pkb"),
                     "rank 0 rejected broadcast_object 'pkb'")
    assert hvd.broadcast_object(me + 7, name="pkb") == 7
    _then_the_job_goes_on(hvd, "after.pk")


def case_tensors_named_like_the_coordinators_own_operations_meet_none_of_them(hvd):
    # A tensor named 'join' met join()'s entry on a joined rank, which took
    # it for the tensor and stopped the job; one named 'barrier.0' met
    # barrier(). The coordinator's own names are now its own.
    n, me = hvd.size(), hvd.rank()
    if me == n - 1:
        out = hvd.allreduce(np.full(2, 5.0), op=hvd.Sum, name="join")
        assert_equal(out, np.full(2, 5.0))  # the joined ranks gave zeros
    assert hvd.join() == n - 1
    handle = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="barrier.0")
    hvd.barrier()
    assert_equal(hvd.synchronize(handle), np.full(2, float(n)))
    exc = expect_raises(ValueError, hvd.allreduce, np.ones(2), name="coordinator.join")
    assert "the coordinator's own" in str(exc), str(exc)
    _then_the_job_goes_on(hvd, "after.names")
