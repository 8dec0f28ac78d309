"""Steps under the settings that change how tensors are negotiated and
fused (set by tests/test_negotiation_settings_mpi.py).

With a response cache that holds less than a step
(HOROVOD_CACHE_CAPACITY=2), every step evicts ids the next one uses.
Rank 0 announces evictions in rounds only, so a rank may still describe a
tensor by an id rank 0 has dropped; rank 0 then asks for it in full (a
resend), in the global set's rounds and in a process set's stream alike.
A round that hands out more new ids than the cache holds evicts some of
them at once: those are never stored (stored, they held the cycle's slots
for good); and a tensor waiting in the cycle when its id is evicted goes
to the rounds. A group waits in the cycle whole or not at all.
With none (0), every tensor is described in full in a round, never in a
cycle. With no fusion (HOROVOD_FUSION_THRESHOLD=0) every tensor, a
group's too, runs as a response of its own or rides in a cycle. Results
must stay right throughout, and nothing may wait forever."""

import numpy as np

from core_cases import all_data, assert_equal

PAIR = None  # ranks 0 and 1 of 3: negotiated in a stream, not in the global set's rounds
NAMES = 5  # per step: more than the cache holds
STEPS = 6


def setup(hvd):
    global PAIR
    PAIR = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[PAIR])


def _steps(hvd, prefix, process_set, ranks):
    me = hvd.rank()
    for step in range(STEPS):
        inputs = [all_data(hvd, (3,), np.float32, 10 * step + i) for i in range(NAMES)]
        handles = [hvd.allreduce_async(x[me], op=hvd.Sum, name=f"{prefix}.{i}",
                                       process_set=process_set)
                   for i, x in enumerate(inputs)]
        for handle, x in zip(handles, inputs):
            assert_equal(hvd.synchronize(handle), sum(x[r] for r in ranks))


def case_steps_of_more_tensors_than_the_cache_holds_reduce_right(hvd):
    _steps(hvd, "global", hvd.global_process_set, range(hvd.size()))


def case_a_process_sets_tensors_rank_0_evicted_are_described_again(hvd):
    if hvd.rank() in PAIR.ranks:
        _steps(hvd, "pair", PAIR, PAIR.ranks)


def case_a_groups_tensors_evicted_between_steps_reduce_right(hvd):
    me = hvd.rank()
    for step in range(STEPS):
        seeds = [100 + 10 * step + i for i in range(NAMES)]
        out = hvd.grouped_allreduce([all_data(hvd, (2,), np.float64, s)[me] for s in seeds],
                                    op=hvd.Sum, name="group")
        for got, s in zip(out, seeds):
            assert_equal(got, sum(all_data(hvd, (2,), np.float64, s)))


def case_a_tensor_waiting_in_a_cycle_when_its_id_is_evicted_goes_to_rounds(hvd):
    """The last rank submits 'waiting' (cached: it waits in the cycle for the
    others), then three new tensors with everyone. With a cache of two,
    caching the first two evicts 'waiting' at rank 0, and the third's round
    tells every rank: the last rank's entry leaves the cycle for the rounds
    (its slot may go to another tensor), where the others, no longer
    holding its id, describe it in full too; it must not wait in the cycle
    forever. (Submitted before that round, the others' copies would find
    the id still held and join it in the cycle.)"""
    import os

    from coordinator import runtime

    me, last = hvd.rank(), hvd.size() - 1
    step = lambda seed: all_data(hvd, (1000,), np.float32, seed)  # (no rider)
    first = step(7)
    assert_equal(hvd.allreduce(first[me], op=hvd.Sum, name="waiting"), sum(first))
    bg = runtime.current().background
    unslotted, unslot = [], bg._unslot
    bg._unslot = lambda slot: unslotted.append(bg.fast[slot].name) or unslot(slot)
    try:
        waiting = step(8)
        if me == last:
            handle = hvd.allreduce_async(waiting[me], op=hvd.Sum, name="waiting")
        for i in range(3):
            x = step(20 + i)
            assert_equal(hvd.allreduce(x[me], op=hvd.Sum, name=f"new.{i}"), sum(x))
        if me != last:
            handle = hvd.allreduce_async(waiting[me], op=hvd.Sum, name="waiting")
        assert_equal(hvd.synchronize(handle), sum(waiting))
    finally:
        bg._unslot = unslot
    if me == last and os.environ.get("HOROVOD_CACHE_CAPACITY") == "2":
        assert unslotted == ["waiting"], unslotted


def case_a_group_waiting_in_the_cycle_leaves_it_whole_when_one_id_is_evicted(hvd):
    """As above with a group of two: caching one new tensor evicts the id of
    the group's first member alone. Both members leave the cycle for the
    rounds, where the others describe the whole group too (the second
    member, left in the cycle, would wait there for ranks that never set
    its bit)."""
    import os

    from coordinator import runtime

    me, last = hvd.rank(), hvd.size() - 1
    step = lambda seed: [all_data(hvd, (1000,), np.float32, seed + i) for i in range(2)]
    first = step(50)
    for got, x in zip(hvd.grouped_allreduce([x[me] for x in first], op=hvd.Sum, name="wg"),
                      first):
        assert_equal(got, sum(x))
    bg = runtime.current().background
    unslotted, unslot = [], bg._unslot

    def unslot_and_see(slot):  # (what left the cycle, what is still in it)
        name = bg.fast[slot].name
        unslot(slot)
        unslotted.append((name, sorted(e.name for e in bg.fast.values())))

    bg._unslot = unslot_and_see
    try:
        waiting = step(60)
        if me == last:
            handle = hvd.grouped_allreduce_async([x[me] for x in waiting], op=hvd.Sum,
                                                 name="wg")
        x = all_data(hvd, (1000,), np.float32, 70)
        assert_equal(hvd.allreduce(x[me], op=hvd.Sum, name="new.wg"), sum(x))
        if me != last:
            handle = hvd.grouped_allreduce_async([x[me] for x in waiting], op=hvd.Sum,
                                                 name="wg")
        for got, x in zip(hvd.synchronize(handle), waiting):
            assert_equal(got, sum(x))
    finally:
        bg._unslot = unslot
    if me == last and os.environ.get("HOROVOD_CACHE_CAPACITY") == "2":
        # The member whose id was evicted, and its sibling with it.
        assert unslotted == [("wg_1of2", [])], unslotted


def case_after_a_round_of_more_new_tensors_than_the_cache_holds_cycles_still_run(hvd):
    """One round hands out more new cache ids than the cache holds (five
    tensors submitted together, a cache of two), so it also evicts some of
    them. Those are never stored: stored, they held both cycle slots for
    good, and the two tensors every later step reduces never ran in a
    cycle again, each step going through a round."""
    import os

    from coordinator import runtime

    me = hvd.rank()
    step = lambda seed: all_data(hvd, (1000,), np.float32, seed)  # (no riders)
    many = [step(30 + i) for i in range(NAMES)]
    handles = [hvd.allreduce_async(x[me], op=hvd.Sum, name=f"many.{i}")
               for i, x in enumerate(many)]
    for handle, x in zip(handles, many):
        assert_equal(hvd.synchronize(handle), sum(x))
    stats = runtime.current().background.stats
    runs = None
    for k in range(STEPS + 2):
        if k == 2:  # both named, both given ids: cached from here on
            runs = stats["cycle_runs"]
        pair = [step(40 + 2 * k), step(41 + 2 * k)]
        handles = [hvd.allreduce_async(x[me], op=hvd.Sum, name=f"every_step.{i}")
                   for i, x in enumerate(pair)]
        for handle, x in zip(handles, pair):
            assert_equal(hvd.synchronize(handle), sum(x))
    if os.environ.get("HOROVOD_CACHE_CAPACITY") != "0":
        assert stats["cycle_runs"] - runs >= STEPS, (stats, runs)


def case_the_setting_was_in_force(hvd):
    """(After the cases above.) With no cache no tensor was described by an
    id or rode in a cycle; with one, ids were used. With no fusion, each of
    the global set's tensors (a group's too) ran as a response of its own,
    or rode in a cycle (riders: small ones, summed in the cycle itself)."""
    import os

    from coordinator import runtime

    stats = runtime.current().background.stats
    if os.environ.get("HOROVOD_CACHE_CAPACITY") == "0":
        assert stats["cached_requests"] == 0 and stats["cycle_runs"] == 0, stats
        assert stats["riders"] == 0, stats
    else:
        assert stats["cached_requests"] + stats["cycle_runs"] > 0, stats
    if os.environ.get("HOROVOD_FUSION_THRESHOLD") == "0":
        assert stats["responses"] + stats["riders"] >= 2 * STEPS * NAMES, stats
