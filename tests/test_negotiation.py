"""The cycle's slot table without MPI: which cached tensors ride in the
cycle's payload, where, and what the digest covers."""

import types

import numpy as np
import pytest

from coordinator.negotiation import RIDER_ELEMENTS, SlotTable, rider_elements
from coordinator.response_cache import request_signature
from coordinator.wire import pb

F32, F64, I32, I64, F16 = pb.FLOAT32, pb.FLOAT64, pb.INT32, pb.INT64, pb.FLOAT16


def sig(shape=(4,), dtype=F32, op=pb.ALLREDUCE, reduce_op=pb.SUM, prescale=1.0,
        postscale=1.0, pset=0, device=-1, group="", group_size=0):
    return request_signature(op, dtype, shape, reduce_op, 0, prescale, postscale, pset,
                             device, group, group_size)


def test_small_sum_and_average_allreduces_of_exact_dtypes_ride():
    assert rider_elements(sig()) == 4
    assert rider_elements(sig(shape=())) == 1
    assert rider_elements(sig(shape=(4, 4), dtype=F64, reduce_op=pb.AVERAGE)) == 16
    assert rider_elements(sig(dtype=I32, postscale=0.5)) == 4


def test_what_float64_would_change_or_the_cycle_cannot_hold_does_not_ride():
    assert rider_elements(sig(shape=(RIDER_ELEMENTS + 1,))) is None
    assert rider_elements(sig(shape=(0,))) is None
    assert rider_elements(sig(dtype=I64)) is None  # not exact in float64
    assert rider_elements(sig(dtype=F16)) is None  # rounded per rank otherwise
    assert rider_elements(sig(reduce_op=pb.MIN)) is None
    assert rider_elements(sig(reduce_op=pb.ADASUM)) is None
    assert rider_elements(sig(prescale=2.0)) is None
    assert rider_elements(sig(op=pb.BROADCAST)) is None
    assert rider_elements(sig(pset=1)) is None
    assert rider_elements(sig(device=0)) is None
    assert rider_elements(sig(group="g", group_size=2)) is None
    assert rider_elements(sig(prescale=float("nan"))) is None
    assert rider_elements(None) is None


def test_riders_are_laid_out_in_slot_order_as_far_as_the_payload_holds():
    table = SlotTable(8, payload_words=8)
    table.assign(1, ("", "a"), sig(shape=(3,)))  # slot 0
    table.assign(2, ("", "big"), sig(shape=(100,)))  # slot 1: no rider
    table.assign(3, ("", "b"), sig(shape=(4,)))  # slot 2
    table.assign(4, ("", "c"), sig(shape=(2,)))  # slot 3: does not fit
    assert table.layout == {0: (0, 3), 2: (3, 4)}
    assert table.payload_size == 7
    table.release(1)  # slot 0 freed: c moves up
    assert table.layout == {2: (0, 4), 3: (4, 2)}
    assert table.payload_size == 6
    table.assign(5, ("", "d"), sig(shape=(1,)))  # takes slot 0 again
    assert table.layout == {0: (0, 1), 2: (1, 4), 3: (5, 2)}


def test_no_payload_no_riders():
    table = SlotTable(8, payload_words=0)
    table.assign(1, ("", "a"), sig())
    assert table.layout == {} and table.payload_size == 0


def test_the_digest_covers_the_payload_size_and_every_slot():
    a, b = SlotTable(8, payload_words=256), SlotTable(8, payload_words=128)
    assert a.digest != b.digest  # ranks configured differently disagree at once
    c = SlotTable(8, payload_words=256)
    assert a.digest == c.digest
    a.assign(1, ("", "x"), sig())
    assert a.digest != c.digest
    c.assign(1, ("", "x"), sig(shape=(5,)))
    assert a.digest != c.digest
    a.release(1)
    c.release(1)
    assert a.digest == c.digest


def test_slots_agree_when_every_rank_applies_the_same_changes():
    tables = [SlotTable(4, payload_words=16) for _ in range(3)]
    for t in tables:
        for cid, shape in ((1, (2,)), (2, (40,)), (3, ())):
            t.assign(cid, ("", str(cid)), sig(shape=shape))
        t.release(2)
        t.assign(9, ("", "9"), sig(shape=(16,)))
    assert len({(t.digest, tuple(sorted(t.layout.items()))) for t in tables}) == 1
    assert np.all([t.slot(9) == 1 for t in tables])


def test_the_cycles_set_bits_are_found_sparse_or_dense():
    from coordinator.control_channel import _set_bits

    assert _set_bits(0) == []
    for positions in ([0], [63], [64], [0, 63, 64, 127, 1023], list(range(0, 1024, 7)),
                      list(range(200))):
        value = sum(1 << p for p in positions)
        assert _set_bits(value) == positions, positions[:5]


def _mpi():
    """mpi4py's MPI, started in this process if nothing has started it
    (tests/test_gpu_fallback.py, collected in the same process, asks mpi4py
    not to start MPI on import)."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init()
    return MPI


def test_a_cycle_reads_back_what_one_rank_posted():
    """The cycle's words on one rank (MPI's AND of one contribution is the
    contribution): the bits, the OR through the complement, the digest check
    and the flags survive the encoding."""
    from coordinator.control_channel import Cycle

    MPI = _mpi()

    cycle = Cycle(MPI.COMM_SELF.Dup(), 1024, MPI.COMM_SELF.Dup())
    for slot in (0, 5, 64, 1000, 1023):
        cycle.set(slot)
    cycle.clear(5)
    cycle.payload_out(0)
    cycle.post(flags=0b1011, now=0.0, digest=0xFEDCBA9876543210)
    result = None
    while result is None:
        result = cycle.test()
    ready, flags, agree, partial = result
    assert ready == [0, 64, 1000, 1023]
    assert flags == 0b1011 and agree and not partial


def test_payload_size_classes_double_from_8_words_up_to_the_capacity():
    from coordinator.control_channel import _size_classes

    assert _size_classes(0) == []
    assert _size_classes(8) == [8]
    assert _size_classes(256) == [8, 16, 32, 64, 128, 256]
    assert _size_classes(300) == [8, 16, 32, 64, 128, 256, 300]


def _one_cycle(cycle, payload):
    cycle.set(3)
    cycle.payload_out(len(payload))[:] = payload
    cycle.post(flags=0b10, now=0.0, digest=7)
    result = None
    while result is None:
        result = cycle.test()
    return result


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "iallreduce"])
def test_a_cycle_runs_again_and_again_with_or_without_persistent_collectives(persistent):
    """Where the MPI library has MPI-4's persistent collectives the cycle
    restarts requests made once; an MPI-3 library gets fresh Iallreduces
    (the GPU machine's Open MPI 4.1): both read back the same."""
    from coordinator.control_channel import Cycle

    MPI = _mpi()

    class Mpi3(MPI.Intracomm):
        def Allreduce_init(self, *args, **kwargs):
            raise NotImplementedError("MPI_Allreduce_init")

    make = MPI.Intracomm if persistent else Mpi3
    cycle = Cycle(make(MPI.COMM_SELF.Dup()), 64, make(MPI.COMM_SELF.Dup()), payload_capacity=20)
    assert (cycle._bits_request is not None) == persistent
    assert sorted(cycle._payload_requests) == [8, 16, 20]
    for step in range(3):
        before = cycle.bytes
        payload = np.arange(step * 5 + 3, dtype=np.float64) + step  # 3, 8, 13 words
        ready, flags, agree, partial = _one_cycle(cycle, payload)
        assert ready == [3] and flags == 0b10 and agree and not partial
        np.testing.assert_array_equal(cycle.payload, payload)
        size_class = [8, 8, 16][step]  # 3 and 8 words travel in 8, 13 in 16
        assert cycle.bytes - before == cycle._send.nbytes + 8 * size_class
    with pytest.raises(ValueError, match="capacity of 20"):
        cycle.payload_out(21)
    cycle.close()
    assert cycle._bits_request is None and not cycle._payload_requests


class _Bits:
    """A cycle's bits (control_channel.Cycle.set/clear), without MPI."""

    def __init__(self):
        self.bits = 0

    def set(self, slot):
        self.bits |= 1 << slot

    def clear(self, slot):
        self.bits &= ~(1 << slot)


def test_a_tensor_a_round_runs_leaves_its_cycle_slot_at_once():
    """A round may run a tensor that waits in a cycle slot (a report described
    it); it leaves the slot as its operation starts, not once it completes.
    Else the next cycle posts its bit and data again while it runs, and
    where the other ranks' next tensors of that name had set theirs, a rank
    mixed one step's data with the next (seen at np=3 with a rank late past
    the stall shutdown time, again and again)."""
    from coordinator.background import Background
    from coordinator.executor import Executor
    from coordinator.tensor_queue import Entry, TensorQueue

    class Never:
        def ready(self):
            return False

    def running(resp, entries, shown, **kwargs):
        yield Never()  # the operation stays in flight
        return [None]

    e = Entry("k", pb.ALLREDUCE, tensor=np.ones(4))
    queue = TensorQueue()
    queue.push(e)
    queue.drain()
    e.cache_id = 7
    bg = Background.__new__(Background)
    bg.stats = {"responses": 0}
    bg.queue, bg.executor, bg.lane_counts = queue, Executor(), {}
    bg.slots = types.SimpleNamespace(slot=lambda cache_id: 3 if cache_id == 7 else None)
    bg.fast, bg.cycle = {3: e}, _Bits()
    bg.cycle.set(3)
    bg._collect = lambda resp, dead: [e]
    bg.timeline = types.SimpleNamespace(enabled=False)
    bg.ops = types.SimpleNamespace(run=running)
    bg.config = types.SimpleNamespace(async_completion=False)
    bg._execute(pb.Response(op=pb.ALLREDUCE, names=["k"], device=-1))  # a host tensor
    assert bg.executor and not e.done  # running
    assert bg.fast == {} and bg.cycle.bits == 0  # and out of the cycle already


def test_a_group_waits_in_the_cycle_whole_or_not_at_all():
    """A group one of whose members has no cycle slot goes to a round whole:
    split, neither the cycle nor the round could run it."""
    from coordinator.background import _whole_groups
    from coordinator.tensor_queue import Entry

    def entry(name, group="", pset=0):
        return Entry(name, pb.ALLREDUCE, group=group, group_size=2 if group else 0,
                     process_set_id=pset)

    g1, g2, h1, h2, solo, other = (entry("g1", "g"), entry("g2", "g"), entry("h1", "h"),
                                   entry("h2", "h"), entry("solo"), entry("other"))
    taken = [(g1, 0), (g2, None), (h1, 1), (h2, 2), (solo, 3), (other, None)]
    assert _whole_groups(taken) == [(g1, None), (g2, None), (h1, 1), (h2, 2), (solo, 3),
                                    (other, None)]
    assert _whole_groups(taken[2:5]) == taken[2:5]


def test_cycles_switched_off_send_a_waiting_group_to_rounds_whole():
    """A round's answer turns cycles off (a timeline starts) while a group
    and a tensor wait in the cycle: every one goes to the rounds, the group
    whole (its first member took its siblings along, and the loop over the
    slots then met their emptied slots: the background thread died of a
    KeyError, seen once at np=3)."""
    from coordinator.background import Background
    from coordinator.tensor_queue import Entry

    def entry(name, group=""):
        return Entry(name, pb.ALLREDUCE, group=group, group_size=2 if group else 0)

    g1, g2, solo = entry("g_1of2", "g"), entry("g_2of2", "g"), entry("solo")
    bg = Background.__new__(Background)
    bg._refusing, bg.sent, bg.classic = {}, {}, []
    bg.fast, bg.cycle = {4: g1, 2: solo, 9: g2}, _Bits()
    for slot in bg.fast:
        bg.cycle.set(slot)
    bg._apply_round(pb.ResponseList(round=3, fast=False))
    assert bg.fast == {} and bg.cycle.bits == 0
    assert sorted(e.name for e in bg.classic) == ["g_1of2", "g_2of2", "solo"]
    assert bg.params["fast"] is False


@pytest.mark.parametrize("pset", [0, 1])
def test_a_failed_group_takes_its_members_waiting_to_be_resent_along(pset):
    """Rank 0 answers a group's instance with an error (a mismatch) for the
    member it knew, and asks for the other in full: this rank had described
    it by a cache id rank 0 had evicted. The other fails with it and is not
    sent: rank 0 would take it for a member of the group's next instance."""
    from coordinator.background import Background
    from coordinator.errors import TensorMismatchError
    from coordinator.executor import Executor
    from coordinator.response_cache import WorkerCache
    from coordinator.tensor_queue import Entry, TensorQueue

    g1, g2 = (Entry(f"g_{i}of2", pb.ALLREDUCE, tensor=np.ones(2), group="g", group_size=2,
                    process_set_id=pset) for i in (1, 2))
    other = Entry("h_1of1", pb.ALLREDUCE, tensor=np.ones(2), group="h", group_size=1,
                  process_set_id=pset)
    queue = TensorQueue()
    queue.push_all([g1, g2, other])
    queue.drain()
    bg = Background.__new__(Background)
    bg.stats = {"responses": 0}
    bg.queue, bg.executor, bg.cache = queue, Executor(), WorkerCache()
    bg.slots = SlotTable(4)
    bg.fast, bg.resend, bg._completed, bg._streamed = {}, [], False, 0 if pset == 0 else 3
    g1.cache_id = 5
    bg.sent_by_id = {5: g1}
    bg.sent = {g1.key: g1, g2.key: g2} if pset == 0 else {}
    error = "Mismatched shape for allreduce of tensor 'g_2of2': ..."
    bg._execute(pb.Response(op=pb.ALLREDUCE, process_set_id=pset, names=["g_2of2"],
                            error=error, error_kind=pb.MISMATCH))
    assert g2.done and g1.done and not other.done
    assert isinstance(g1.error, TensorMismatchError) and str(g1.error) == error
    bg._resend_ids([5])
    assert bg.resend == []
