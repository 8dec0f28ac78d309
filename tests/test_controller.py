"""Rank 0's decisions without MPI: feed request lists, check the plans."""

import pytest

from coordinator import dtypes
from coordinator.controller import Controller
from coordinator.stall_inspector import StallInspector
from coordinator.tensor_queue import Entry
from coordinator.watchdog import InsideText
from coordinator.wire import pb

F32 = pb.FLOAT32


def req(name, shape=(4,), op=pb.ALLREDUCE, dtype=F32, **kw):
    return pb.Request(name=name, op=op, dtype=dtype, shape=shape,
                      reduce_op=kw.pop("reduce_op", pb.SUM), prescale=kw.pop("prescale", 1.0),
                      postscale=kw.pop("postscale", 1.0), **kw)


def submit(ctl, rank, *requests, cached=()):
    rl = pb.RequestList(requests=list(requests))
    for cid in cached:
        rl.cached.add(cache_id=cid)
    ctl.submit(rank, rl)


def names(plan):
    return list(plan.response.names) + [f"#{c}" for c in plan.response.cache_ids]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_tensor_runs_only_once_every_rank_submitted_in_any_order():
    ctl = Controller(3)
    submit(ctl, 2, req("b"), req("a"))
    submit(ctl, 0, req("a"))
    assert ctl.take_plans() == []
    submit(ctl, 1, req("a"))
    plans = ctl.take_plans()
    assert [names(p) for p in plans] == [["a"]]
    assert plans[0].recipients == (0, 1, 2)
    submit(ctl, 0, req("b"))
    submit(ctl, 1, req("b"))
    assert [names(p) for p in ctl.take_plans()] == [["b"]]
    assert not ctl.has_pending()


def test_ready_tensors_fuse_by_dtype_and_op_up_to_the_threshold():
    ctl = Controller(2, fusion_threshold=40)  # 10 float32
    batch = [req("a", (4,)), req("b", (4,)), req("c", (4,), dtype=pb.FLOAT64), req("d", (2,)),
             req("e", (4,), reduce_op=pb.MAX), req("f", (20,))]
    for rank in (0, 1):
        submit(ctl, rank, *batch)
    plans = ctl.take_plans()
    # a, b and d fill exactly 40 bytes; c is float64, e is Max, and f is
    # bigger than the threshold, so it goes alone.
    assert [names(p) for p in plans] == [["a", "b", "d"], ["c"], ["e"], ["f"]]


def test_threshold_zero_disables_fusion():
    ctl = Controller(2, fusion_threshold=0)
    for rank in (0, 1):
        submit(ctl, rank, req("a"), req("b"))
    assert [names(p) for p in ctl.take_plans()] == [["a"], ["b"]]


def test_fused_broadcasts_share_a_buffer_across_dtypes_but_not_roots():
    ctl = Controller(2)
    batch = [req("x", op=pb.BROADCAST, root_rank=0), req("y", op=pb.BROADCAST, root_rank=0,
                                                           dtype=pb.INT64),
             req("z", op=pb.BROADCAST, root_rank=1)]
    for rank in (0, 1):
        submit(ctl, rank, *batch)
    assert [names(p) for p in ctl.take_plans()] == [["x", "y"], ["z"]]


def test_allgather_response_carries_each_ranks_first_dimension():
    ctl = Controller(3)
    for rank in range(3):
        submit(ctl, rank, req("g", (rank + 1, 2), op=pb.ALLGATHER))
    (plan,) = ctl.take_plans()
    assert list(plan.response.sizes) == [1, 2, 3]


def test_mismatched_shapes_name_each_value_and_its_ranks():
    ctl = Controller(3)
    submit(ctl, 0, req("w", (4,)))
    submit(ctl, 1, req("w", (5,)))
    submit(ctl, 2, req("w", (4,)))
    (plan,) = ctl.take_plans()
    assert plan.response.error == ("Mismatched shape for allreduce of tensor 'w': rank 1 sent "
                                   "shape (5,); ranks 0, 2 sent (4,).")
    assert plan.response.error_kind == pb.MISMATCH
    assert plan.recipients == (0, 1, 2)


def test_mismatched_dtype_and_reduce_op_are_both_reported():
    ctl = Controller(2)
    submit(ctl, 0, req("w"))
    submit(ctl, 1, req("w", dtype=pb.INT32, reduce_op=pb.MAX))
    (plan,) = ctl.take_plans()
    err = plan.response.error
    assert "Mismatched dtype" in err and "int32" in err and "float32" in err
    assert "Mismatched reduce op" in err and "Max" in err and "Sum" in err


def test_mismatched_operation_is_reported_alone():
    ctl = Controller(2)
    submit(ctl, 0, req("w"))
    submit(ctl, 1, req("w", op=pb.ALLGATHER))
    (plan,) = ctl.take_plans()
    assert plan.response.error.startswith("Mismatched operation")
    assert "rank 1 sent" in plan.response.error and "allgather" in plan.response.error


def test_same_name_in_two_process_sets_is_two_tensors():
    ctl = Controller(4)
    ctl.register_process_set(1, [0, 1])
    ctl.register_process_set(2, [2, 3])
    submit(ctl, 0, req("w", process_set_id=1))
    submit(ctl, 2, req("w", process_set_id=2))
    submit(ctl, 3, req("w", process_set_id=2))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (2, 3) and not plan.response.error
    assert plan.response.process_set_id == 2
    submit(ctl, 1, req("w", process_set_id=1))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 1) and not plan.response.error


def test_same_name_on_a_subset_and_the_global_set_do_not_collide():
    ctl = Controller(3)
    ctl.register_process_set(1, [0, 1])
    submit(ctl, 0, req("p", process_set_id=1), req("p"))
    submit(ctl, 2, req("p"))
    submit(ctl, 1, req("p"))
    (plan,) = ctl.take_plans()
    assert plan.response.process_set_id == 0 and plan.recipients == (0, 1, 2)
    submit(ctl, 1, req("p", process_set_id=1))
    (plan,) = ctl.take_plans()
    assert plan.response.process_set_id == 1 and plan.recipients == (0, 1)


def test_another_sets_gpu_plans_wait_for_a_round_while_its_host_plans_stream():
    """A GPU operation of another set (or a send/recv on a GPU) goes out in
    the next round, where every rank runs it in one order with the global
    set's (NCCL needs one order of calls on every rank); the same set's
    host operation streams out as it is decided."""
    ctl = Controller(3)
    ctl.register_process_set(1, [0, 1])
    for rank in (0, 1):
        submit(ctl, rank, req("gpu", process_set_id=1, device=0),
               req("host", process_set_id=1, device=-1),
               req("p2p", op=pb.P2P, device=0, ranks=[0, 1]))
    assert ctl.has_device_stream_output() and ctl.has_global_output()
    (streamed,) = ctl.take_plans(global_set=False)
    assert names(streamed) == ["host"]
    assert ctl.has_device_stream_output()
    in_round = ctl.take_plans()
    assert sorted(names(p)[0] for p in in_round) == ["gpu", "p2p"]
    assert not ctl.has_device_stream_output() and not ctl.has_global_output()


def test_another_sets_errors_stream_out_on_a_gpu_too():
    """An error runs no collective, so it has no order to keep: it goes out
    as it is decided (an error response names no device)."""
    ctl = Controller(3)
    ctl.register_process_set(1, [0, 1])
    submit(ctl, 0, req("bad", process_set_id=1, device=0))
    submit(ctl, 1, req("bad", process_set_id=1, device=0, shape=(5,)))
    (streamed,) = ctl.take_plans(global_set=False)
    assert "Mismatched" in streamed.response.error
    assert not ctl.has_device_stream_output() and not ctl.has_global_output()


def test_the_global_sets_gpu_plans_need_no_waking():
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, req("g", device=0))
    assert ctl.has_global_output() and not ctl.has_device_stream_output()


def test_process_set_restricts_who_must_submit():
    ctl = Controller(4)
    ctl.register_process_set(1, [1, 3])
    submit(ctl, 1, req("s", process_set_id=1))
    submit(ctl, 3, req("s", process_set_id=1))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (1, 3) and not plan.response.error
    submit(ctl, 0, req("s2", process_set_id=1))
    (bad,) = ctl.take_plans()
    assert bad.recipients == (0,) and "does not include it" in bad.response.error


def test_broadcast_root_outside_the_set_is_an_error():
    ctl = Controller(3)
    ctl.register_process_set(1, [0, 1])
    for rank in (0, 1):
        submit(ctl, rank, req("b", op=pb.BROADCAST, root_rank=2, process_set_id=1))
    (plan,) = ctl.take_plans()
    assert "root rank 2 is not a member" in plan.response.error


def test_steady_state_uses_cache_ids_and_skips_names():
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, req("a"), req("b"))
    (first,) = ctl.take_plans()
    ids = list(first.response.new_cache_ids)
    assert all(ids) and len(set(ids)) == 2
    for rank in (0, 1):
        submit(ctl, rank, cached=ids)
    (second,) = ctl.take_plans()
    assert list(second.response.names) == [] and list(second.response.cache_ids) == ids


def test_one_rank_sending_in_full_falls_back_to_names():
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, req("a"))
    (first,) = ctl.take_plans()
    cid = first.response.new_cache_ids[0]
    submit(ctl, 0, cached=[cid])
    submit(ctl, 1, req("a"))
    (plan,) = ctl.take_plans()
    assert list(plan.response.names) == ["a"] and list(plan.response.new_cache_ids) == [cid]


def test_cache_eviction_is_announced_and_stale_ids_are_resent():
    ctl = Controller(2, cache_capacity=2)
    for name in ("a", "b", "c"):
        for rank in (0, 1):
            submit(ctl, rank, req(name))
    plans = ctl.take_plans()
    ids = [p.response.new_cache_ids[0] for p in plans]
    evicted, seq = ctl.cache.evictions_since(0)
    assert evicted == [ids[0]] and seq == 1
    submit(ctl, 1, cached=[ids[0]])
    assert ctl.take_resends() == {1: [ids[0]]}
    assert ctl.take_plans() == []


def test_changed_shape_replaces_the_cache_entry():
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, req("a", (4,)))
    old = ctl.take_plans()[0].response.new_cache_ids[0]
    for rank in (0, 1):
        submit(ctl, rank, req("a", (8,)))
    new = ctl.take_plans()[0].response.new_cache_ids[0]
    assert new != old and ctl.cache.get(old) is None
    assert ctl.cache.evictions_since(0)[0] == [old]


def test_joined_rank_counts_as_ready_and_gets_specs():
    ctl = Controller(3)
    submit(ctl, 2, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 0, req("j", (3,)))
    submit(ctl, 1, req("j", (3,)))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 1, 2)
    assert list(plan.response.joined_ranks) == [2]
    assert plan.response.specs[0].name == "j" and list(plan.response.specs[0].shape) == [3]
    submit(ctl, 0, pb.Request(name="join", op=pb.JOIN))
    assert ctl.take_plans() == []
    submit(ctl, 1, pb.Request(name="join", op=pb.JOIN))
    (done,) = ctl.take_plans()
    assert done.response.op == pb.JOIN and done.response.value == 1
    assert done.recipients == (0, 1, 2)


def test_an_allreduce_submitted_with_the_last_join_gets_the_joined_ranks_specs():
    """The last rank's allreduce and join in one request list: the allreduce
    is planned before the controller forgets who had joined, so it carries
    them (zeros stand in for their part) and the join's answer follows it."""
    ctl = Controller(3)
    submit(ctl, 0, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 1, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 2, req("j", (3,)), pb.Request(name="join", op=pb.JOIN))
    plan, done = ctl.take_plans()
    assert names(plan) == ["j"] and plan.recipients == (0, 1, 2)
    assert list(plan.response.joined_ranks) == [0, 1]
    assert plan.response.specs[0].name == "j" and list(plan.response.specs[0].shape) == [3]
    assert done.response.op == pb.JOIN and done.response.value == 2
    assert not ctl.joined()


def _with_a_dropped_id(clock=None):
    """Rank 0 has cached "a" of process set 1 ({0, 1}), then dropped its id
    for "b" and "c" (a cache of two): the id rank 1 sends next, as it has
    not heard, is one rank 0 no longer knows."""
    ctl = Controller(3, cache_capacity=2, **({"clock": clock} if clock else {}))
    pid = _add_set(ctl, [0, 1])
    for name in ("a", "b", "c"):
        for rank in (0, 1):
            submit(ctl, rank, req(name, process_set_id=pid))
    plans = ctl.take_plans()
    stale = plans[0].response.new_cache_ids[0]
    assert ctl.cache.get(stale) is None
    return ctl, pid, stale


def _add_set(ctl, ranks):
    for rank in range(ctl.size):
        submit(ctl, rank, req("add", op=pb.ADD_PROCESS_SET, ranks=ranks))
    (added,) = ctl.take_plans()
    return added.response.value


def test_a_join_waits_for_the_requests_its_rank_was_asked_to_send_again():
    """Rank 1 sends another set's allreduce by an id rank 0 had dropped, then
    joins as the last rank: the join waits until the allreduce comes again
    in full, so it runs with rank 0's zeros before the join completes. (The
    join completed first, and the allreduce waited for rank 0, which had
    gone on: random_join.py with a cache of one hung 2 jobs in 111.)"""
    ctl, pid, stale = _with_a_dropped_id()
    submit(ctl, 0, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 2, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 1, cached=[stale])
    assert ctl.take_resends() == {1: [stale]}
    submit(ctl, 1, pb.Request(name="join", op=pb.JOIN))
    assert ctl.take_plans() == [] and ctl.has_pending()
    submit(ctl, 1, req("a", process_set_id=pid))
    plan, done = ctl.take_plans()
    assert names(plan) == ["a"] and list(plan.response.joined_ranks) == [0]
    assert done.response.op == pb.JOIN and done.response.value == 1


def test_a_held_join_counts_once_the_resend_is_long_overdue():
    """A request the rank can no longer send (its tensor failed meanwhile)
    holds its join back RESEND_WAIT_SECONDS at most."""
    from coordinator.controller import RESEND_WAIT_SECONDS

    clock = FakeClock()
    ctl, pid, stale = _with_a_dropped_id(clock)
    submit(ctl, 0, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 2, pb.Request(name="join", op=pb.JOIN))
    submit(ctl, 1, cached=[stale])
    submit(ctl, 1, pb.Request(name="join", op=pb.JOIN))
    clock.now += RESEND_WAIT_SECONDS / 2
    assert ctl.take_plans() == []
    clock.now += RESEND_WAIT_SECONDS
    (done,) = ctl.take_plans()
    assert done.response.op == pb.JOIN and done.response.value == 1
    assert not ctl.has_pending()


def test_a_join_is_not_held_for_requests_already_sent_again():
    ctl, pid, stale = _with_a_dropped_id()
    submit(ctl, 1, cached=[stale])
    submit(ctl, 1, req("a", process_set_id=pid))
    for rank in (0, 2, 1):
        submit(ctl, rank, pb.Request(name="join", op=pb.JOIN))
    plans = ctl.take_plans()
    assert plans[-1].response.op == pb.JOIN and plans[-1].response.value == 1


def test_grouped_tensors_wait_for_the_whole_group():
    ctl = Controller(2)
    g1 = req("g_1", group="g", group_size=2)
    g2 = req("g_2", group="g", group_size=2)
    submit(ctl, 0, g1, g2)
    submit(ctl, 1, g1)
    assert ctl.take_plans() == []
    submit(ctl, 1, g2)
    assert [names(p) for p in ctl.take_plans()] == [["g_1", "g_2"]]


def test_stall_warning_names_missing_ranks_and_expiry_fails_them():
    clock = FakeClock()
    inspector = StallInspector(check_time=5, shutdown_time=10)
    ctl = Controller(3, stall_inspector=inspector, clock=clock)
    submit(ctl, 0, req("slow"))
    submit(ctl, 2, req("slow"))
    clock.now += 6
    (warning,) = ctl.inspect_stalls()
    assert "'slow'" in warning and "rank 1 did not submit it" in warning and "6.0 s" in warning
    assert "ranks 0, 2 have waited" in warning
    assert ctl.inspect_stalls() == []  # not repeated within the check period
    clock.now += 5
    assert ctl.inspect_stalls() == []
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 2) and plan.response.error_kind == pb.STALL
    assert "rank 1 did not submit it" in plan.response.error
    # Rank 1 owes it: its own copy fails on its side when it submits it.
    (late,) = ctl.take_notices()[1]
    assert list(late.names) == ["slow"] and late.error_kind == pb.STALL


def test_a_stall_says_which_long_collective_a_missing_rank_is_inside():
    """Rank 1 cannot submit 'next' while it is inside another collective:
    the warning and the error say so (the watchdog's reports tell)."""
    clock = FakeClock()
    ctl = Controller(3, stall_inspector=StallInspector(check_time=5, shutdown_time=10),
                     clock=clock)
    submit(ctl, 0, req("next"))
    submit(ctl, 2, req("next"))
    clock.now += 6
    inside = {1: "allreduce of tensor 'a' in process set 1 for 7.0 s"}.get
    (warning,) = ctl.inspect_stalls(inside=inside)
    assert ("rank 1 did not submit it; rank 1 has been inside allreduce of tensor 'a' in "
            "process set 1 for 7.0 s; ranks 0, 2 have waited 6.0 s") in warning, warning
    clock.now += 5
    ctl.inspect_stalls(inside=inside)
    (plan,) = ctl.take_plans()
    assert "rank 1 has been inside allreduce of tensor 'a'" in plan.response.error


def test_a_stall_names_the_ranks_that_stopped_answering_wherever_they_are():
    """Rank 1 never submits 'next' because it waits in another set's
    collective on rank 2, which stopped: the error about 'next' named only
    rank 1 (its report may not have told yet what it is inside); it names
    rank 2 too, once, where the inside text has not."""
    clock = FakeClock()
    ctl = Controller(3, stall_inspector=StallInspector(check_time=5, shutdown_time=10),
                     clock=clock)
    submit(ctl, 0, req("next"))
    clock.now += 6
    (warning,) = ctl.inspect_stalls(silent={2: 4.5})
    assert ("ranks 1, 2 did not submit it; rank 2 has not answered for 4.5 s; rank 0 has "
            "waited 6.0 s") in warning, warning
    said = InsideText("broadcast of tensor 'b' in process set 2 for 7.0 s, waiting for "
                      "rank 2, which has not answered for 5.5 s")
    said.waiting_for = frozenset({2})
    inside = {1: said}.get
    clock.now += 5
    ctl.inspect_stalls(inside=inside, silent={2: 5.5})
    (plan,) = ctl.take_plans()
    assert plan.response.error.count("rank 2, which has not answered for 5.5 s") == 1, \
        plan.response.error
    assert "rank 2 has not answered" not in plan.response.error


def test_a_deadlock_is_said_in_the_warning_and_fails_every_wait_after_the_deadlock_time():
    """Rank 0 waits on 'a' (rank 1 never submits it), rank 1 on 'b' (rank 0
    never does), every rank blocked: the warning says it is a deadlock,
    and once every rank has been blocked for the deadlock time both fail,
    each naming the other, with no stall shutdown time (Horovod's default)."""
    clock = FakeClock()
    inspector = StallInspector(check_time=5, shutdown_time=0, deadlock_time=20)
    ctl = Controller(2, stall_inspector=inspector, clock=clock)
    submit(ctl, 0, req("a"))
    submit(ctl, 1, req("b"))
    clock.now += 6
    (warning,) = ctl.inspect_stalls(blocked={0: 6.0, 1: 7.0})
    assert "Ranks 0, 1 have been waiting for 6.0 s with nothing in flight" in warning, warning
    assert "a deadlock" in warning and "fail after 20 s of this" in warning, warning
    clock.now += 13
    ctl.inspect_stalls(blocked={0: 19.0, 1: 30.0})
    assert ctl.take_plans() == []
    clock.now += 1
    ctl.inspect_stalls(blocked={0: 20.0, 1: 30.0})
    plans = {tuple(p.response.names): p for p in ctl.take_plans()}
    a, b = plans[("a",)].response, plans[("b",)].response
    assert plans[("a",)].recipients == (0,) and a.error_kind == b.error_kind == pb.DEADLOCK
    assert a.error.startswith("Deadlocked allreduce of tensor 'a': rank 1 did not submit it")
    assert "the others wait on: allreduce of tensor 'b': rank 0 did not submit it" in a.error
    assert b.error.startswith("Deadlocked allreduce of tensor 'b'") and "'a'" in b.error
    assert a.error.endswith("failed after 20 s (COORDINATOR_DEADLOCK_SECONDS)"), a.error


def test_ranks_that_are_not_all_blocked_are_only_warned_about():
    """A rank that is computing (stuck 0) or blocked for less than the
    deadlock time: no deadlock, whatever the stall's age; with stall checks
    disabled the deadlock limit still holds, without warnings."""
    clock = FakeClock()
    ctl = Controller(2, stall_inspector=StallInspector(5, 0, deadlock_time=20), clock=clock)
    submit(ctl, 0, req("a"))
    clock.now += 100
    (warning,) = ctl.inspect_stalls(blocked={1: 50.0})
    assert "deadlock" not in warning
    ctl.inspect_stalls(blocked={0: 19.9, 1: 50.0})
    assert ctl.take_plans() == []
    quiet = Controller(2, stall_inspector=StallInspector(5, 0, disabled=True, deadlock_time=20),
                       clock=clock)
    submit(quiet, 0, req("a"))
    submit(quiet, 1, req("b"))
    clock.now += 100
    assert quiet.inspect_stalls(blocked={0: 19.0, 1: 50.0}) == [] and quiet.take_plans() == []
    assert quiet.inspect_stalls(blocked={0: 21.0, 1: 21.0}) == []
    plans = quiet.take_plans()
    assert sorted(p.response.names[0] for p in plans) == ["a", "b"]
    assert all(p.response.error.startswith("Deadlocked allreduce") for p in plans)
    off = Controller(2, stall_inspector=StallInspector(5, 0, deadlock_time=0), clock=clock)
    submit(off, 0, req("a"))
    clock.now += 1000
    off.inspect_stalls(blocked={0: 1000.0, 1: 1000.0})
    assert off.take_plans() == []  # 0: wait, as Horovod does


def test_ranks_waiting_on_each_other_deadlock_while_others_run_on():
    """Ranks 0 and 1 wait on each other in process set 1: deadlocked,
    whatever rank 3 (running) does. Rank 2, blocked on 'g', which rank 3
    could still submit, is not part of it; once rank 3 is blocked too, on
    'h', which only ranks of the deadlock could submit, all four are."""
    from coordinator.stall_inspector import waiting_on_each_other

    clock = FakeClock()
    ctl = Controller(4, stall_inspector=StallInspector(5, 0, deadlock_time=20), clock=clock)
    ctl.register_process_set(1, (0, 1))
    submit(ctl, 0, req("x", process_set_id=1))
    submit(ctl, 1, req("y", process_set_id=1))
    submit(ctl, 2, req("g"))
    submit(ctl, 3, req("h"))
    rows = [(n.key, n.representative().op, n.first, list(n.requests),
             [m for m in n.members if m not in n.requests]) for n in ctl._pending.values()]
    blocked = {0: 30.0, 1: 30.0, 2: 30.0}
    assert waiting_on_each_other(rows, blocked, 20) == {0, 1}
    blocked[3] = 25.0
    assert waiting_on_each_other(rows, blocked, 20) == {0, 1, 2, 3}
    assert waiting_on_each_other(rows, blocked, 26) == {0, 1}
    assert waiting_on_each_other(rows, {0: 30.0}, 20) == set()
    clock.now += 30
    ctl.inspect_stalls(blocked=blocked)
    failed = sorted(p.response.names[0] for p in ctl.take_plans())
    assert failed == ["g", "h", "x", "y"], failed


def test_a_pair_deadlocks_in_a_set_while_the_rank_outside_it_trains():
    clock = FakeClock()
    ctl = Controller(3, stall_inspector=StallInspector(5, 0, deadlock_time=20), clock=clock)
    ctl.register_process_set(1, (0, 1))
    submit(ctl, 0, req("x", process_set_id=1))
    submit(ctl, 1, req("y", process_set_id=1))
    clock.now += 30
    (warning,) = ctl.inspect_stalls(blocked={0: 10.0, 1: 12.0})
    assert "Ranks 0, 1 have been waiting for 10.0 s" in warning, warning
    ctl.inspect_stalls(blocked={0: 21.0, 1: 22.0})  # rank 2 is not blocked: no matter
    plans = {p.response.names[0]: p for p in ctl.take_plans()}
    assert sorted(plans) == ["x", "y"] and plans["x"].recipients == (0,)
    assert "ranks 0, 1 have been waiting for 21.0 s" in plans["x"].response.error


def test_a_deadlock_error_names_the_other_ranks_waits_first_and_counts_the_rest():
    """Rank 0 waits on a step's ten gradients, rank 1 on its accuracy: rank
    1's error names four of the gradients and counts the others; rank 0's
    names rank 1's wait first."""
    clock = FakeClock()
    ctl = Controller(2, stall_inspector=StallInspector(5, 0, deadlock_time=20), clock=clock)
    for i in range(10):
        submit(ctl, 0, req(f"grad.{i}"))
    submit(ctl, 1, req("zz.accuracy"))
    clock.now += 30
    ctl.inspect_stalls(blocked={0: 25.0, 1: 25.0})
    errors = {p.response.names[0]: p.response.error for p in ctl.take_plans()}
    assert len(errors) == 11
    acc = errors["zz.accuracy"]
    assert acc.count("allreduce of tensor 'grad.") == 4 and "; and 6 more; failed" in acc, acc
    first_other = errors["grad.0"].split("the others wait on: ")[1]
    assert first_other.startswith("allreduce of tensor 'zz.accuracy'"), first_other


def test_cycle_time_holds_ready_tensors_to_fuse_more():
    clock = FakeClock()
    ctl = Controller(2, cycle_time=0.005, clock=clock)
    for rank in (0, 1):
        submit(ctl, rank, req("a"))
    assert ctl.take_plans() == []
    assert ctl.next_deadline() == pytest.approx(100.005)
    for rank in (0, 1):
        submit(ctl, rank, req("b"))
    clock.now += 0.006
    assert [names(p) for p in ctl.take_plans()] == [["a", "b"]]


def test_a_tensor_the_cycle_ran_while_held_for_the_cycle_time_is_not_planned_again():
    """With HOROVOD_CYCLE_TIME, a complete negotiation waits to fuse with
    more. Where the ranks ran it in the negotiation cycle meanwhile (some
    had reported it in a round), forget() drops it from there too, a whole
    group with it: it was planned anyway, and ran again with the ranks'
    next copies of the name (a tensor run twice, helper-26's probe)."""
    clock = FakeClock()
    ctl = Controller(2, cycle_time=0.005, clock=clock)
    for rank in (0, 1):
        submit(ctl, rank, req("a"), req("g_1of2", group="g", group_size=2),
               req("g_2of2", group="g", group_size=2))
    assert ctl.take_plans() == []
    ctl.forget((0, "a"))
    ctl.forget((0, "g_2of2"), "g")
    assert ctl.next_deadline() is None  # nothing held now
    for rank in (0, 1):
        submit(ctl, rank, req("b"))
    clock.now += 0.006
    assert [names(p) for p in ctl.take_plans()] == [["b"]]


def test_shutdown_request_is_recorded_with_the_rank():
    ctl = Controller(2)
    ctl.submit(1, pb.RequestList(shutdown=True))
    assert ctl.shutdown_reason == "rank 1 called shutdown()"


def test_add_process_set_is_planned_for_every_rank_with_a_new_id():
    ctl = Controller(3)
    for rank in range(3):
        submit(ctl, rank, pb.Request(name="ps", op=pb.ADD_PROCESS_SET, ranks=[0, 2]))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 1, 2)
    assert plan.response.value == 1 and list(plan.response.ranks) == [0, 2]
    assert ctl.process_sets[1] == (0, 2)


def test_a_set_added_by_its_own_members_needs_only_them_and_every_rank_learns_of_it():
    """ChainerMN's communicator over part of the job: ranks 0 and 2 add the
    set; rank 1 never asks, and still registers it (every table holds the
    same sets). Their next add of it gives them its id; a set added by
    every rank is there for their add too; a whole-job add of it is still
    refused as Horovod's is."""
    ctl = Controller(3)

    def among(rank, ranks, name="coordinator.add_process_set.0,2", **kw):
        submit(ctl, rank, pb.Request(name=name, op=pb.ADD_PROCESS_SET, ranks=ranks,
                                     among_members=True, **kw))

    among(0, [0, 2])
    assert ctl.take_plans() == []
    among(2, [0, 2])
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 1, 2) and plan.response.value == 1 and not plan.response.error
    assert ctl.process_sets[1] == (0, 2)
    for rank in (2, 0):
        among(rank, [0, 2])
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0, 2) and plan.response.value == 1 and not plan.response.error
    for rank in range(3):
        submit(ctl, rank, pb.Request(name="add", op=pb.ADD_PROCESS_SET, ranks=[1, 2]))
    (plan,) = ctl.take_plans()
    assert plan.response.value == 2
    for rank in (1, 2):
        among(rank, [1, 2], name="coordinator.add_process_set.1,2")
    (plan,) = ctl.take_plans()
    assert plan.recipients == (1, 2) and plan.response.value == 2
    for rank in range(3):
        submit(ctl, rank, pb.Request(name="add", op=pb.ADD_PROCESS_SET, ranks=[0, 2]))
    (plan,) = ctl.take_plans()
    assert "already exists (id 1)" in plan.response.error
    assert ctl.process_sets == {0: (0, 1, 2), 1: (0, 2), 2: (1, 2)}


def test_an_add_by_its_members_that_does_not_include_the_rank_fails_there_alone():
    ctl = Controller(3)
    submit(ctl, 1, pb.Request(name="s", op=pb.ADD_PROCESS_SET, ranks=[0, 2], among_members=True))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (1,)
    assert "ranks [0, 2] are not valid for 3 ranks with rank 1 among them" in plan.response.error
    # A member that refuses it fails the others of its set, not rank 1.
    submit(ctl, 0, pb.Request(name="s", op=pb.ADD_PROCESS_SET, ranks=[0, 2], among_members=True,
                              rejected="ValueError: no"))
    assert ctl.take_plans() == []  # (it raised there already)
    submit(ctl, 2, pb.Request(name="s", op=pb.ADD_PROCESS_SET, ranks=[0, 2], among_members=True))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (2,) and "rank 0 rejected" in plan.response.error
    assert 1 not in ctl.process_sets


def test_allreduce_responses_carry_the_pack_limit():
    ctl = Controller(2, pack_limit=4096)
    for rank in (0, 1):
        submit(ctl, rank, req("a"), req("g", op=pb.ALLGATHER))
    plans = {p.response.op: p.response for p in ctl.take_plans()}
    assert plans[pb.ALLREDUCE].pack_limit == 4096
    assert plans[pb.ALLGATHER].pack_limit == 0


def test_cached_requests_skip_validation_but_stay_correct():
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, req("a"))
    cid = ctl.take_plans()[0].response.new_cache_ids[0]
    for rank in (0, 1):
        submit(ctl, rank, cached=[cid])
    (plan,) = ctl.take_plans()
    assert not plan.response.error and list(plan.response.cache_ids) == [cid]


def _stalling(size, check=5, shutdown=10):
    clock = FakeClock()
    inspector = StallInspector(check_time=check, shutdown_time=shutdown)
    return Controller(size, stall_inspector=inspector, clock=clock), clock


def test_after_a_stall_the_late_rank_owes_the_failed_step_and_the_next_meets():
    ctl, clock = _stalling(2)
    submit(ctl, 0, req("g"))  # step 1 of rank 0; rank 1 is late
    clock.now += 11
    ctl.inspect_stalls()
    (failed,) = ctl.take_plans()
    assert failed.recipients == (0,) and failed.response.error_kind == pb.STALL
    assert [list(r.names) for r in ctl.take_notices()[1]] == [["g"]]
    submit(ctl, 0, req("g"))  # rank 0's step 2 opens a new negotiation
    assert ctl.take_plans() == []
    submit(ctl, 1, req("g"))  # rank 1's step 2 (its step 1 failed on its side)
    (step2,) = ctl.take_plans()
    assert step2.recipients == (0, 1) and not step2.response.error
    assert not ctl.has_pending()


def test_a_rank_late_again_and_again_owes_every_stalled_step_in_order():
    ctl, clock = _stalling(2)
    for _ in range(3):
        submit(ctl, 0, req("g"))
        clock.now += 11
        ctl.inspect_stalls()
        (failed,) = ctl.take_plans()
        assert failed.recipients == (0,)
    owed = ctl.take_notices()[1]
    assert [list(r.names) for r in owed] == [["g"]] * 3
    submit(ctl, 0, req("g"))
    submit(ctl, 1, req("g"))
    (ok,) = ctl.take_plans()
    assert ok.recipients == (0, 1) and not ok.response.error


def test_a_refusal_fails_the_operation_on_every_member_naming_the_rank():
    ctl = Controller(3)
    submit(ctl, 0, req("x", op=pb.BROADCAST, root_rank=0))
    submit(ctl, 1, pb.Request(name="x", op=pb.BROADCAST,
                              rejected="ValueError: invalid root rank 5"))
    (plan,) = ctl.take_plans()
    assert plan.recipients == (0,)
    assert plan.response.error == ("rank 1 rejected broadcast of tensor 'x': ValueError: "
                                   "invalid root rank 5")
    (late,) = ctl.take_notices()[2]  # rank 2 owes its copy of the refused op
    assert "rank 1 rejected" in late.error
    for rank in range(3):  # the next one works
        submit(ctl, rank, req("x", op=pb.BROADCAST, root_rank=0))
    (ok,) = ctl.take_plans()
    assert not ok.response.error and ok.recipients == (0, 1, 2)


def test_a_refusal_before_anyone_submitted_is_owed_by_the_others():
    ctl = Controller(2)
    submit(ctl, 1, pb.Request(name="x", rejected="ValueError: bad"))
    assert ctl.take_plans() == []
    (owed,) = ctl.take_notices()[0]
    assert "rank 1 rejected allreduce of tensor 'x'" in owed.error


def test_group_size_mismatch_fails_every_member_on_every_rank():
    ctl = Controller(3)
    two = [req(f"g_{i}of2", group="g", group_size=2) for i in (1, 2)]
    three = [req(f"g_{i}of3", group="g", group_size=3) for i in (1, 2, 3)]
    submit(ctl, 0, *two)
    submit(ctl, 1, *three)
    plans = ctl.take_plans()
    assert plans and all("Mismatched group size" in p.response.error for p in plans)
    told = {(r, n) for p in plans for r in p.recipients for n in p.response.names}
    assert told == {(0, "g_1of2"), (0, "g_2of2"), (1, "g_1of3"), (1, "g_2of3"), (1, "g_3of3")}
    (owed,) = ctl.take_notices()[2]  # rank 2 had not submitted the group: it owes it
    assert owed.group == "g" and "Mismatched group size" in owed.error
    for rank in range(3):  # the next group works
        submit(ctl, rank, *two)
    (ok,) = ctl.take_plans()
    assert names(ok) == ["g_1of2", "g_2of2"] and not ok.response.error
    assert not ctl.has_pending()


def test_a_refused_group_fails_on_the_other_ranks():
    ctl = Controller(2)
    submit(ctl, 0, *[req(f"g_{i}", group="g", group_size=3) for i in (1, 2, 3)])
    submit(ctl, 1, pb.Request(name="g", group="g", group_size=2,
                              rejected="ValueError: dtype object is not supported"))
    plans = ctl.take_plans()
    assert sorted(n for p in plans for n in p.response.names) == ["g_1", "g_2", "g_3"]
    assert all(p.recipients == (0,) and "rank 1 rejected grouped allreduce 'g'"
               in p.response.error for p in plans)
    assert not ctl.has_pending()


def test_a_stalled_group_member_fails_the_whole_group():
    ctl, clock = _stalling(2)
    submit(ctl, 0, req("g_1", group="g", group_size=2), req("g_2", group="g", group_size=2))
    submit(ctl, 1, req("g_1", group="g", group_size=2))  # g_2 never comes in time
    clock.now += 11
    ctl.inspect_stalls()
    plans = ctl.take_plans()
    told = {(r, n) for p in plans for r in p.recipients for n in p.response.names}
    assert told == {(0, "g_1"), (1, "g_1"), (0, "g_2")}
    assert not ctl.has_pending()


def test_collectives_other_than_allreduce_fail_while_a_rank_has_joined():
    ctl = Controller(2)
    submit(ctl, 1, pb.Request(name="join", op=pb.JOIN))
    for op in (pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER):
        submit(ctl, 0, req(f"t{op}", (2, 2), op=op, splits=[1, 1]))
        (plan,) = ctl.take_plans()
        assert plan.recipients == (0,)
        assert "cannot run while rank 1 has joined" in plan.response.error, plan.response.error
    submit(ctl, 0, req("a"))
    (plan,) = ctl.take_plans()
    assert not plan.response.error and list(plan.response.joined_ranks) == [1]


def test_nan_scale_factors_on_every_rank_are_agreement():
    ctl = Controller(2)
    nan = float("nan")
    for rank in (0, 1):
        submit(ctl, rank, req("n", prescale=nan), req("m", prescale=nan))
    (plan,) = ctl.take_plans()
    assert not plan.response.error and names(plan) == ["n", "m"]
    submit(ctl, 0, req("k", postscale=nan))
    submit(ctl, 1, req("k", postscale=2.0))
    (bad,) = ctl.take_plans()
    assert "Mismatched postscale factor" in bad.response.error and "nan" in bad.response.error


def test_ranks_on_different_gpus_agree_but_cpu_and_gpu_do_not():
    ctl = Controller(3)
    for rank in range(3):
        submit(ctl, rank, req("g", device=rank))  # each rank's local GPU
    (plan,) = ctl.take_plans()
    assert not plan.response.error
    submit(ctl, 0, req("h", device=0))
    submit(ctl, 1, req("h", device=-1))
    submit(ctl, 2, req("h", device=1))
    (bad,) = ctl.take_plans()
    assert bad.response.error == ("Mismatched device for allreduce of tensor 'h': rank 1 sent "
                                  "device CPU; ranks 0, 2 sent GPU.")


def test_a_rank_that_submits_before_hearing_it_owes_gets_the_error_not_a_notice():
    ctl = Controller(3)
    submit(ctl, 0, req("b", op=pb.BROADCAST))
    submit(ctl, 1, pb.Request(name="b", op=pb.BROADCAST, rejected="ValueError: bad root"))
    submit(ctl, 2, req("b", op=pb.BROADCAST))  # same round, after rank 1's refusal
    plans = ctl.take_plans()
    assert sorted(p.recipients for p in plans) == [(0,), (2,)]
    assert all("rank 1 rejected" in p.response.error for p in plans)
    assert ctl.take_notices() == {} and not ctl.has_pending()


def test_a_late_rank_in_a_process_set_gets_the_error_when_it_submits():
    ctl, clock = _stalling(3)
    ctl.register_process_set(1, [1, 2])
    submit(ctl, 1, req("s", process_set_id=1))
    clock.now += 11
    ctl.inspect_stalls()
    (failed,) = ctl.take_plans()
    assert failed.recipients == (1,)
    assert ctl.take_notices() == {}  # outside the global set rank 0 answers the copy
    submit(ctl, 2, req("s", process_set_id=1))
    (late,) = ctl.take_plans()
    assert late.recipients == (2,) and late.response.error_kind == pb.STALL



F32, I64, F16, F64 = (dtypes.BY_WIRE[w] for w in (pb.FLOAT32, pb.INT64, pb.FLOAT16, pb.FLOAT64))


@pytest.mark.parametrize("entry, wire", [
    (Entry("g", pb.ALLREDUCE, dtype_info=F32, shape=(3, 2), reduce_op=pb.AVERAGE,
           prescale=0.5, postscale=2.0, device=0, group="grads", group_size=3),
     pb.Request(name="g", op=pb.ALLREDUCE, dtype=pb.FLOAT32, shape=(3, 2), device=0,
                reduce_op=pb.AVERAGE, prescale=0.5, postscale=2.0, group="grads",
                group_size=3)),
    (Entry("b", pb.BROADCAST, dtype_info=I64, shape=(4,), root_rank=1, process_set_id=2,
           prescale=3.0),
     pb.Request(name="b", op=pb.BROADCAST, dtype=pb.INT64, shape=(4,), device=-1,
                root_rank=1, process_set_id=2)),
    (Entry("a", pb.ALLTOALL, dtype_info=F16, shape=(5,), splits=(2, 3), root_rank=1),
     pb.Request(name="a", op=pb.ALLTOALL, dtype=pb.FLOAT16, shape=(5,), device=-1,
                splits=(2, 3))),
    (Entry("r", pb.REDUCESCATTER, dtype_info=F64, shape=(8,), reduce_op=pb.MAX,
           rejected="rank 1 refused it"),
     pb.Request(name="r", op=pb.REDUCESCATTER, dtype=pb.FLOAT64, shape=(8,), device=-1,
                reduce_op=pb.MAX, prescale=1.0, postscale=1.0, rejected="rank 1 refused it")),
    (Entry("set", pb.ADD_PROCESS_SET, ranks=(0, 2), splits=(1,)),
     pb.Request(name="set", op=pb.ADD_PROCESS_SET, device=-1, ranks=(0, 2))),
    (Entry("set.0,2", pb.ADD_PROCESS_SET, ranks=(0, 2), among_members=True),
     pb.Request(name="set.0,2", op=pb.ADD_PROCESS_SET, device=-1, ranks=(0, 2),
                among_members=True)),
], ids=["allreduce", "broadcast", "alltoall", "reducescatter", "add_process_set",
        "add_process_set_of_members"])
def test_an_entry_is_described_to_rank_0_by_the_fields_its_op_uses(entry, wire):
    """Entry.request: what a worker sends rank 0 in full, every field its
    op uses, none it does not."""
    assert entry.request() == wire


def _group(prefix, size=3):
    return [req(f"{prefix}_{i}of{size}", group=prefix, group_size=size) for i in range(size)]


def test_a_cached_group_waiting_for_a_rank_asks_for_the_cycle():
    """Rank 1 may hold its members in the cycle (it took the group while
    cycles were on, rank 0 while they were off): a report brings them."""
    ctl = Controller(2)
    for rank in (0, 1):
        submit(ctl, rank, *_group("g"))
    assert len(ctl.take_plans()) == 1 and not ctl.waits_on_cycles()
    submit(ctl, 0, *_group("g"))
    assert ctl.waits_on_cycles()
    submit(ctl, 1, *_group("g"))
    assert ctl.take_plans() and not ctl.waits_on_cycles()


def test_a_group_whose_other_members_no_rank_described_asks_for_the_cycle():
    """Every rank described two of the three members and the group cannot
    run: each rank describes all its members at once, so the third waits
    in the cycle everywhere. Not so while a rank has yet to describe any."""
    ctl = Controller(2, cache_capacity=2)
    two = _group("g")[:2]
    submit(ctl, 0, *two)
    assert not ctl.waits_on_cycles()
    submit(ctl, 1, *two)
    assert ctl.take_plans() == [] and ctl.waits_on_cycles()
    assert not Controller(2, cache_capacity=0).waits_on_cycles()


@pytest.mark.parametrize("pset", [0, 1])
def test_after_a_stalled_group_fails_the_next_instance_runs_and_the_late_rank_owes_one(pset):
    """Rank 1 is late with a group past the stall shutdown time: the group
    fails on rank 0, and rank 0's next instance of it then runs with rank
    1's late one, which fails instead (rank 1 owes it: a notice for the
    global set, an answer on arrival for another set). Rank 0's next
    instance used to fail too, with the same error, when it arrived before
    any other RequestList: the failure was still recorded as one of the
    list being read."""
    ctl, clock = _stalling(3)
    if pset:
        ctl.register_process_set(1, [0, 1])
    group = lambda: [req(f"g_{i}of2", group="g", group_size=2, process_set_id=pset)
                     for i in (1, 2)]
    submit(ctl, 0, *group())
    if not pset:
        submit(ctl, 2, *group())
    clock.now += 11
    ctl.inspect_stalls()
    failed = ctl.take_plans()
    assert {p.recipients for p in failed} == ({(0,)} if pset else {(0, 2)})
    assert all("rank 1 did not submit it" in p.response.error for p in failed)
    submit(ctl, 0, *group())  # the next instance, first of any list
    assert ctl.take_plans() == []
    if not pset:
        owed = ctl.take_notices()[1]
        assert [n.group for n in owed] == ["g"]
    submit(ctl, 1, *group())  # its late instance
    if pset:
        late = ctl.take_plans()
        assert len(late) == 2 and {p.recipients for p in late} == {(1,)}
        assert all("rank 1 did not submit it" in p.response.error for p in late)
    else:
        assert ctl.take_plans() == []  # (it was told: its first instance is owed)
        submit(ctl, 2, *group())
    submit(ctl, 1, *group())  # in step with rank 0's next instance
    (run,) = [p for p in ctl.take_plans() if not p.response.error]
    assert sorted(run.response.names) == ["g_1of2", "g_2of2"]


def test_a_group_refused_then_submitted_again_in_one_list_is_two_instances():
    """Rank 1 refused its instance of the group, then submitted the next
    one, both in one RequestList: the refusal fails rank 0's instance, and
    rank 1's next one waits for rank 0's next (it used to fail as part of
    the refused instance, and rank 0's next waited for ever)."""
    ctl = Controller(2)
    group = lambda: [req(f"g_{i}of2", group="g", group_size=2) for i in (1, 2)]
    submit(ctl, 1, pb.Request(name="g", group="g", group_size=2,
                              rejected="ValueError: bad dtype"), *group())
    assert ctl.take_plans() == []  # nothing of rank 1's next instance fails
    (owed,) = ctl.take_notices()[0]
    assert owed.group == "g" and "rank 1 rejected grouped allreduce 'g'" in owed.error
    submit(ctl, 0, *group())  # its next instance (its refused one failed as owed)
    (run,) = ctl.take_plans()
    assert not run.response.error and sorted(run.response.names) == ["g_1of2", "g_2of2"]


def test_a_removed_sets_members_are_still_known_for_its_operations_in_flight():
    """remove_process_set may come while the set's operations still run on
    its members: the watchdog asks for their ranks (members_of), to ping
    them and name a silent one; the set itself is gone."""
    ctl = Controller(3)
    for rank in range(3):
        submit(ctl, rank, req("add", op=pb.ADD_PROCESS_SET, ranks=[1, 2]))
    (added,) = ctl.take_plans()
    pid = added.response.value
    assert ctl.members_of(pid) == (1, 2)
    for rank in range(3):
        submit(ctl, rank, req("remove", op=pb.REMOVE_PROCESS_SET, process_set_id=pid))
    (removed,) = ctl.take_plans()
    assert removed.response.op == pb.REMOVE_PROCESS_SET and not removed.response.error
    assert pid not in ctl.process_sets
    assert ctl.members_of(pid) == (1, 2)
    assert ctl.members_of(pid + 1) is None
