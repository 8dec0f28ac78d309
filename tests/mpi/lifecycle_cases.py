"""init/shutdown: errors on misuse, re-initialisation, shutdown by one rank."""

import numpy as np

from core_cases import assert_equal, expect_raises, shared_dir, wait_for_marks
from peers import leave_mark


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
    marks = shared_dir(hvd, "orphans")
    if hvd.rank() == last:
        # Once the others' operations are pending, not after a time: one
        # submitted after the shutdown (a loaded machine may run a rank that
        # late) raises at its submission, as it should, not in synchronize.
        wait_for_marks(marks, [f"submitted.{r}" for r in range(last)], remove=True)
        hvd.shutdown()
    else:
        h = hvd.allreduce_async(np.ones(2), name="orphan")
        leave_mark(marks, f"submitted.{hvd.rank()}")
        exc = expect_raises(hvd.ShutdownError, hvd.synchronize, h)
        assert f"rank {last} called shutdown(); its program is done" in str(exc), str(exc)
        assert exc.peer_finished  # an elastic job cannot re-form past it
        assert "'orphan'" in str(exc)
        exc = expect_raises(hvd.HorovodInternalError, hvd.allreduce, np.ones(2), name="x")
        # The truth: another rank shut the coordinator down.
        assert not hvd.is_initialized()
        hvd.shutdown()
    hvd.init()
    assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="revived"),
                 np.full(1, float(hvd.size())))


def case_a_collective_every_rank_started_completes_through_a_shutdown(hvd):
    """The last rank has not yet seen its allreduce finish when another rank's
    shutdown reaches it: the result still arrives (it used to wait forever:
    shutting down dropped the tensors it kept running from the queue, so
    their completion went unrecognised)."""
    from coordinator import runtime
    from coordinator.executor import Operation

    last = hvd.size() - 1
    if hvd.rank() != last:
        assert_equal(hvd.allreduce(np.ones(2), op=hvd.Sum, name="deferred"),
                     np.full(2, float(hvd.size())))
        hvd.shutdown()
    else:
        bg = runtime.current().background
        advance = Operation.advance
        held, seen_late = [], []

        def advance_until_shutdown(op):
            # The collective runs; its completion is noticed only once the
            # shutdown has begun here (held until then, or first seen then
            # where this thread ran again only after the shutdown came).
            if op in held:
                finished = bg.stopping
            else:
                finished = advance(op)
                if finished and not bg.stopping:
                    held.append(op)
                    return False
            if finished:
                seen_late.append(op)
            return finished

        Operation.advance = advance_until_shutdown
        try:
            h = hvd.allreduce_async(np.ones(2), op=hvd.Sum, name="deferred")
            assert_equal(hvd.synchronize(h), np.full(2, float(hvd.size())))
        finally:
            Operation.advance = advance
        assert seen_late, "the allreduce was never seen to finish during the shutdown"
        hvd.shutdown()
    hvd.init()
    assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="revived"),
                 np.full(1, float(hvd.size())))


def case_an_answered_round_completes_through_a_shutdown(hvd):
    """Rank 0 finishes a barrier (a round) and shuts down before the last
    rank has read the round's answer: the last rank's barrier still
    completes (it used to fail with a ShutdownError, in 1 suite run of 6)."""
    from coordinator import runtime
    from coordinator.control_channel import TAG_ROUND_RESPONSE

    last = hvd.size() - 1
    if hvd.rank() != last:
        hvd.barrier()
        hvd.shutdown()
    else:
        bg = runtime.current().background
        receive = bg.channel.receive
        read_late = []

        def receive_after_shutdown(tag):
            # The answer is read only once the shutdown has begun here.
            if tag != TAG_ROUND_RESPONSE:
                return receive(tag)
            if not bg.stopping:
                return []
            got = list(receive(tag))
            read_late.extend(got)
            return got

        bg.channel.receive = receive_after_shutdown
        try:
            hvd.barrier()
        finally:
            bg.channel.receive = receive
        assert read_late, "the answer was not read during the shutdown: nothing was tested"
        hvd.shutdown()
    hvd.init()
    assert_equal(hvd.allreduce(np.ones(1), op=hvd.Sum, name="after.round"),
                 np.full(1, float(hvd.size())))


def case_the_communicators_a_process_holds_are_found_to_be_released(hvd):
    """control_channel._held_comms (what Transport.release revokes when a
    rank stops answering) finds a communicator the program made and told
    nobody of, and a copy of it; not a freed one, nor one of a single rank,
    nor one over ranks beyond those it is asked about."""
    from mpi4py import MPI

    from coordinator.control_channel import _held_comms

    world = MPI.COMM_WORLD
    split = world.Split(0, world.rank)
    copy = split.Dup()
    freed = split.Dup()
    freed_handle = MPI._handleof(freed)
    freed.Free()
    alone = world.Split(world.rank, 0)
    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)

    def handles(within):
        return {MPI._handleof(c) for c in _held_comms(within)}

    held = handles(world)
    assert {MPI._handleof(c) for c in (world, split, copy)} <= held, held
    assert MPI._handleof(alone) not in held and freed_handle not in held, held
    assert MPI._handleof(MPI.COMM_SELF) not in held, held
    if world.rank < 2:
        assert MPI._handleof(pair) in held, held
        within_pair = handles(pair)
        assert MPI._handleof(pair) in within_pair, within_pair
        if world.size > 2:
            assert not {MPI._handleof(c) for c in (world, split, copy)} & within_pair
    for comm in (split, copy, alone) + ((pair,) if world.rank < 2 else ()):
        comm.Free()
