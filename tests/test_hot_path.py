"""The per-tensor path's shortcuts keep the long way's behaviour: names
checked once are still refused when bad, an entry's signature is the cache's
request_signature, a completed handle's result and error come back as
before, and completing an operation's entries together lets the first
outcome of each stand. No MPI."""

import math

import numpy as np
import pytest

from coordinator import collectives
from coordinator.dtypes import info_for
from coordinator.handles import HandleTable
from coordinator.ops_names import INTERNAL_PREFIX
from coordinator.response_cache import request_signature
from coordinator.tensor_queue import Entry, TensorQueue
from coordinator.wire import pb


@pytest.mark.parametrize("bad", ["x\udc80", INTERNAL_PREFIX + "mine", "", 7])
def test_a_bad_name_is_refused_every_time_beside_a_good_one_checked_before(bad):
    for _ in range(3):
        assert collectives._name("allreduce", "good.name") == "good.name"
        with pytest.raises(ValueError, match="allreduce"):
            collectives._name("allreduce", bad)


def test_unnamed_operations_still_get_a_fresh_name_each():
    first = collectives._name("allreduce", None)
    assert collectives._name("allreduce", None) != first


@pytest.mark.parametrize("pre,post", [(1.0, 1.0), (0.5, 2.0), (math.nan, 1.0),
                                      (1.0, math.nan), (math.inf, -0.0)])
@pytest.mark.parametrize("op", [pb.ALLREDUCE, pb.BROADCAST])
def test_an_entrys_signature_is_the_request_signature_of_its_description(pre, post, op):
    arr = np.ones((2, 3), np.float32)
    e = Entry("t", op, arr, None, info_for(arr.dtype), arr.shape, pb.AVERAGE, 1, pre, post, 0,
              -1, (), "g", 2)
    expected = request_signature(op, info_for(arr.dtype).wire, [2, 3], pb.AVERAGE, 1, pre, post,
                                 0, -1, "g", 2)
    assert e.signature() == expected
    assert e.signature() == Entry("t", op, arr, None, info_for(arr.dtype), arr.shape,
                                  pb.AVERAGE, 1, pre, post, 0, -1, (), "g", 2).signature()
    other = Entry("t", op, arr, None, info_for(arr.dtype), arr.shape, pb.AVERAGE, 1, 3.0,
                  post, 0, -1, (), "g", 2)
    assert other.signature() != e.signature()
    assert Entry("barrier", pb.BARRIER).signature()[1] == 0  # no dtype


def test_the_positional_allreduce_entry_fills_the_fields_it_names():
    class Set:
        process_set_id = 3

    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    e = collectives._allreduce_entry(None, arr, "t", pb.SUM, 2, 0.5, Set(), None,
                                     group="g", group_size=4)
    assert (e.name, e.op, e.tensor is arr, e.output, e.shape) == ("t", pb.ALLREDUCE, True,
                                                                   None, (2, 3))
    assert (e.reduce_op, e.root_rank, e.prescale, e.postscale) == (pb.SUM, 0, 2.0, 0.5)
    assert (e.process_set_id, e.device, e.splits, e.group, e.group_size) == (3, -1, (), "g", 4)
    assert e.dtype_info.dtype == np.float64 and e.key == (3, "t")


def test_a_completed_handle_gives_its_result_once_and_a_failed_one_its_error():
    table = HandleTable()
    good, bad = Entry("a", 1), Entry("b", 1)
    hg, hb = table.add(good), table.add(bad)
    good.finish("result")
    bad.fail(RuntimeError("it failed"))
    assert table.wait(hg) == "result"
    with pytest.raises(ValueError, match="unknown"):
        table.wait(hg)
    with pytest.raises(RuntimeError, match="it failed"):
        table.wait(hb)
    with pytest.raises(ValueError, match="unknown"):
        table.wait(hb)


def test_a_completed_handle_with_a_device_result_orders_the_callers_stream():
    class Event:
        ordered = 0

        def order_current_stream(self):
            self.ordered += 1

    table = HandleTable()
    e = Entry("a", 1)
    e.done_event = Event()
    handle = table.add(e)
    e.finish("r")
    assert table.wait(handle) == "r" and e.done_event.ordered == 1


def test_completing_entries_together_lets_the_first_outcome_stand():
    queue = TensorQueue()
    a, b, c = Entry("a", 1), Entry("b", 1), Entry("c", 1)
    queue.push_all([a, b, c])
    queue.drain()
    b.fail(RuntimeError("first"))
    called = []
    c.callback = called.append
    queue.complete_all([(a, 1), (b, 2), (c, 3)])
    assert (a.done, a.result, a.tensor) == (True, 1, None)
    assert b.result is None and str(b.error) == "first"
    assert c.result == 3 and called == [c]
    assert queue.inflight_count() == 0
    assert all(e.wait(0) for e in (a, b, c))
    assert not a.finish(5) and a.result == 1


def _cached(name, cache_id, n=32, dtype=np.float32, device=-1, op=pb.AVERAGE):
    arr = np.ones(n, dtype)
    e = Entry(name, pb.ALLREDUCE, arr, None, info_for(arr.dtype), arr.shape, op, 0, 1.0, 1.0,
              0, device, (), "", 0)
    e.cache_id = cache_id
    return e


def _planner(threshold=1 << 20, pack_limit=1 << 16):
    from coordinator.background import Background

    bg = Background.__new__(Background)
    bg._plans = {}
    bg.params = {"fusion_threshold": threshold, "pack_limit": pack_limit}
    return bg


def _shape_of(planned):
    return [(resp.SerializeToString(deterministic=True), [e.name for e in group])
            for resp, group in planned]


def test_a_cycles_plan_is_made_once_per_list_of_cache_ids_and_is_plan_readys():
    from coordinator.negotiation import plan_ready

    bg = _planner(threshold=300)
    make = lambda: [_cached("a", 1), _cached("b", 2, dtype=np.float64), _cached("c", 3),
                    _cached("d", 4, op=pb.SUM), _cached("e", 5, n=64)]
    first, second = make(), make()
    want = plan_ready(first, 300, 1 << 16)
    assert _shape_of(bg._plan(first)) == _shape_of(want)
    again = bg._plan(second)
    assert len(bg._plans) == 1
    assert _shape_of(again) == _shape_of(want)
    # This step's entries, not the last step's, in the plan's groups.
    assert [e for _, group in again for e in group] == [second[i] for i in (0, 2, 1, 3, 4)]
    # Other ids, another order, other settings or a tensor on a device: planned anew.
    for entries, planner in (([_cached("a", 1), _cached("c", 3)], bg),
                             (make()[::-1], bg),
                             (make(), _planner(threshold=10 ** 6)),
                             ([_cached("a", 1), _cached("c", 3, device=0)], bg)):
        assert _shape_of(planner._plan(entries)) == _shape_of(
            plan_ready(entries, planner.params["fusion_threshold"], 1 << 16))
    assert len(bg._plans) == 4


def test_the_kept_plans_are_bounded():
    from coordinator import background

    bg = _planner()
    for i in range(background.PLANS_KEPT + 5):
        bg._plan([_cached(f"t{i}", 1000 + i)])
    assert len(bg._plans) <= background.PLANS_KEPT
