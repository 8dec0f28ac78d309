"""Steps under the settings that change how tensors are negotiated and
fused (set by tests/test_negotiation_settings_mpi.py).

With a response cache that holds less than a step
(HOROVOD_CACHE_CAPACITY=2), every step evicts ids the next one uses.
Rank 0 announces evictions in rounds only, so a rank may still describe a
tensor by an id rank 0 has dropped; rank 0 then asks for it in full (a
resend), in the global set's rounds and in a process set's stream alike.
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
