"""The stall inspector under HOROVOD_STALL_CHECK_TIME_SECONDS=1 and
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=3 (set by tests/test_lifecycle_mpi.py).

A rank late past the shutdown time waits until the stall has failed the
operation without it (its notice is here: core_cases.owing) rather than
sleeping past that time: a loaded machine may run the stall check seconds
late, and the late copy would then meet the others'."""

import time

import numpy as np

from core_cases import assert_equal, expect_raises, owing


def case_stalled_tensor_fails_on_every_rank_naming_the_missing_rank(hvd):
    last = hvd.size() - 1
    waited = 0.0
    if hvd.rank() == last:
        bg = owing(hvd, "'stalled'")  # past the shutdown time: it never submitted in time
        exc = expect_raises(hvd.StallError, hvd.allreduce, np.ones(2), name="stalled")
        assert not bg.owed  # failed here at once, from the notice: it never reached rank 0
    else:
        start = time.monotonic()
        exc = expect_raises(hvd.StallError, hvd.allreduce, np.ones(2), name="stalled")
        waited = time.monotonic() - start
    assert f"rank {last} did not submit it" in str(exc), str(exc)
    assert "'stalled'" in str(exc)
    # The shutdown time counts from the first submission: the rank that
    # submitted first waited that long (the others, a moment late on a
    # loaded machine, less). Not before it, and not for ever.
    waits = hvd.allgather(np.array([waited]), name="stall.waits")
    assert 2.5 <= waits.max() < 30, waits
    assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="after.stall"),
                 np.full(2, float(hvd.size())))


def _steps_in_step(hvd, late_steps, steps=30, name="g"):
    """Every rank allreduces `name` (Sum) once per step, catching errors;
    the last rank submits the steps in `late_steps` only once the others'
    copies have failed without it. Returns {step: result or the error}."""
    me, n = hvd.rank(), hvd.size()
    last = n - 1
    outcome = {}
    for step in range(steps):
        if me == last and step in late_steps:
            owing(hvd, f"step {step}")
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
    _check_in_step(hvd, _steps_in_step(hvd, late, name="g.once"), late)


def case_a_rank_late_again_and_again_stays_in_step(hvd):
    late = {2, 5, 6}
    _check_in_step(hvd, _steps_in_step(hvd, late, steps=10, name="g.often"), late)


def case_rank_0_late_past_the_report_time_leaves_the_next_steps_whole(hvd):
    """Rank 0 comes to a cached tensor (and group) late enough that the
    others report theirs in full (half the stall time) but before the stall
    shutdown: they run in the cycle, and rank 0 forgets the reports. It
    kept them, and the others' next step was 'submitted twice' once
    reported in turn (with the default stall time, a rank 30 s late: a
    checkpoint written on rank 0)."""
    from coordinator import runtime

    me, n = hvd.rank(), hvd.size()
    for _ in range(3):
        hvd.allreduce(np.ones(4), name="late0.x")
        hvd.grouped_allreduce([np.ones(4), np.ones(3)], name="late0.g")
    # Rank 0's stall check (it runs it) has no shutdown time meanwhile: its
    # naps must stay short of it, which a loaded machine could stretch past.
    inspector = runtime.current().background.controller.stall_inspector if me == 0 else None
    if inspector is not None:
        shutdown_time, inspector.shutdown_time = inspector.shutdown_time, 0.0
    try:
        for step in range(3):
            if me == 0:
                time.sleep(1.5)  # past half the stall time (1 s): the others report
            group = hvd.grouped_allreduce_async([np.full(4, step + me + 1.0), np.ones(3)],
                                                op=hvd.Sum, name="late0.g")
            out = hvd.allreduce(np.full(4, step + me + 1.0), op=hvd.Sum, name="late0.x")
            total = float(sum(step + r + 1 for r in range(n)))
            assert_equal(out, np.full(4, total), f"step {step}")
            outs = hvd.synchronize(group)
            assert_equal(outs[0], np.full(4, total), f"group step {step}")
            assert_equal(outs[1], np.full(3, float(n)), f"group step {step}")
    finally:
        if inspector is not None:
            inspector.shutdown_time = shutdown_time


def case_a_send_nobody_receives_is_a_stall_naming_the_receiver(hvd):
    if hvd.rank() == 0:
        exc = expect_raises(hvd.StallError, hvd.send, np.ones(2), 1, name="lonely")
        assert "rank 1 did not submit it" in str(exc) and "lonely" in str(exc), str(exc)
