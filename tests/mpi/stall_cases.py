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


def _steps_in_step(hvd, late_steps, nap, steps=30, name="g"):
    """Every rank allreduces `name` (Sum) once per step, catching errors;
    the last rank sleeps `nap` seconds before the steps in `late_steps`.
    Returns {step: result or the error}."""
    me, n = hvd.rank(), hvd.size()
    last = n - 1
    outcome = {}
    for step in range(steps):
        if me == last and step in late_steps:
            time.sleep(nap)
        try:
            outcome[step] = hvd.allreduce(np.full(4, (step + 1) * (me + 1.0)), op=hvd.Sum,
                                          name=name)
        except hvd.StallError as exc:
            outcome[step] = exc
    return outcome


def _check_in_step(hvd, outcome, late_steps):
    n = hvd.size()
    total = n * (n + 1) / 2
    for step, got in outcome.items():
        if step in late_steps:
            assert isinstance(got, hvd.StallError), (step, got)
            assert f"rank {n - 1} did not submit it" in str(got), str(got)
        else:
            # Never another step's data: this rank's Nth with the others' Nth.
            assert not isinstance(got, Exception), (step, got)
            assert_equal(got, np.full(4, (step + 1) * total), f"step {step}")


def case_after_a_stall_every_rank_stays_in_step(hvd):
    late = {3}
    _check_in_step(hvd, _steps_in_step(hvd, late, nap=5.0, name="g.once"), late)


def case_a_rank_late_again_and_again_stays_in_step(hvd):
    late = {2, 5, 6}
    _check_in_step(hvd, _steps_in_step(hvd, late, nap=4.0, steps=10, name="g.often"), late)


def case_rank_0_late_past_the_report_time_leaves_the_next_steps_whole(hvd):
    """Rank 0 comes to a cached tensor (and group) late enough that the
    others report theirs in full (half the stall time) but before the stall
    shutdown: they run in the cycle, and rank 0 forgets the reports. It
    kept them, and the others' next step was 'submitted twice' once
    reported in turn (with the default stall time, a rank 30 s late: a
    checkpoint written on rank 0)."""
    me, n = hvd.rank(), hvd.size()
    for _ in range(3):
        hvd.allreduce(np.ones(4), name="late0.x")
        hvd.grouped_allreduce([np.ones(4), np.ones(3)], name="late0.g")
    for step in range(3):
        if me == 0:
            time.sleep(1.5)  # past half the stall time (1 s), short of its shutdown (3 s)
        group = hvd.grouped_allreduce_async([np.full(4, step + me + 1.0), np.ones(3)],
                                            op=hvd.Sum, name="late0.g")
        out = hvd.allreduce(np.full(4, step + me + 1.0), op=hvd.Sum, name="late0.x")
        total = float(sum(step + r + 1 for r in range(n)))
        assert_equal(out, np.full(4, total), f"step {step}")
        outs = hvd.synchronize(group)
        assert_equal(outs[0], np.full(4, total), f"group step {step}")
        assert_equal(outs[1], np.full(3, float(n)), f"group step {step}")


def case_a_send_nobody_receives_is_a_stall_naming_the_receiver(hvd):
    if hvd.rank() == 0:
        exc = expect_raises(hvd.StallError, hvd.send, np.ones(2), 1, name="lonely")
        assert "rank 1 did not submit it" in str(exc) and "lonely" in str(exc), str(exc)
