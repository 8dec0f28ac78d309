"""How the ranks agree on what runs next: cycles, and rounds when needed.

Steady state (every tensor of a step already in the response cache): no
message to rank 0 at all. Every rank holds the same cache, with each global
set's cached tensor in the same *slot* (rank 0 assigns ids in responses that
every rank runs, and every rank gives slots the same way: `SlotTable`). A
*cycle* is one non-blocking bitwise-AND allreduce (control_channel.Cycle):
each rank sets the bits of the slots it has submitted and not yet run, and
raises flags. When it completes every rank knows the same set of slots
submitted everywhere, and plans them the same way (`plan_ready`), in slot
order; so rank 0's work per step does not grow with the number of ranks,
and the traffic is one small collective per cycle.

The flags (set on any rank, so every rank sees them):
- CLASSIC: a *round* follows. Every rank sends rank 0 its RequestList (the
  tensors the cycle cannot carry: uncached or changed ones, other process
  sets, allgather, alltoall, send/recv, barrier, join, refusals), possibly
  empty; rank 0 runs the Controller over all of them and answers each rank
  with the plans it runs, the notices of what it owes, and the parameters
  the cycle plans with. Rank 0 raises it whenever it has something to tell.
- PENDING: someone waits for something the slots do not show (a round's
  answer, or rank 0's controller holding requests): everyone posts the next
  cycle (after a short back-off if nothing moved). A slot set on some ranks
  but not all does the same (the cycle carries the complement of the bits
  too, so every rank sees the OR beside the AND). With nothing pending
  anywhere, nobody cycles (an idle job sends only the watchdog's
  heartbeats, one message each way a second); a step whose
  tensors all arrive before the cycle costs that one cycle.
- REPORT: someone's steady-state tensor has waited for half the stall check
  time: in the next round every rank describes its waiting tensors in full,
  so rank 0's stall inspector sees who is missing (and can fail them, at a
  round, the same way on every rank).
- FRESH: someone submitted since its last cycle: post the next at once.

A rank that is idle (nothing submitted) does not post; a cycle it holds up
completes when it submits, or when rank 0's watchdog pings it (a ping makes
an idle rank post). When rank 0 posts a cycle for a round that carries
another set's GPU plans (answered_in_rounds), which the ranks outside that
set know nothing about, it asks every rank to post it (ResponseList.cycle).
"""

import heapq
import math
import zlib

import numpy as np

from coordinator import dtypes
from coordinator.response_cache import NAN_KEY
from coordinator.wire import pb

def in_rounds(op, process_set_id):
    """Whether an operation is negotiated in cycles and rounds: the global
    set's, where every rank takes part. Other sets' and send/recv (two
    ranks) stream to rank 0 and back, so that ranks outside them never hold
    them up."""
    return process_set_id == 0 and op != pb.P2P


def answered_in_rounds(op, process_set_id, device):
    """Whether rank 0 sends an operation's plan out in a round, where every
    rank runs it in one order with the global set's: the global set's, and
    every operation on a GPU. Other sets' and send/recv requests stream to
    rank 0 as they come (in_rounds), but on a GPU their plans wait for the
    next round: each rank queues its NCCL calls in the order it starts its
    operations, a call may block until its peers make it (connection
    set-up on first use), and its kernels wait for their peers on the
    device, so two ranks queuing two sets' operations in opposite orders
    would wait on each other forever. Horovod negotiates every set in every
    cycle for the same reason. MPI calls do not wait that way (a
    communicator per set, non-blocking), so host operations of other sets
    still go out as soon as they are decided, and ranks outside them never
    hold them up."""
    return in_rounds(op, process_set_id) or device >= 0


FLAG_CLASSIC = 1
FLAG_PENDING = 2
FLAG_REPORT = 4
FLAG_FRESH = 8


# Riders: tiny allreduces whose data travels in the cycle itself (see
# `SlotTable.layout`): at most this many elements each, of these dtypes, all
# exact in float64.
RIDER_ELEMENTS = 16
RIDER_DTYPES = frozenset(
    dtypes.BY_DTYPE[np.dtype(t)].wire
    for t in ("float32", "float64", "int8", "int16", "int32", "uint8", "uint16"))


def rider_elements(signature):
    """The element count of a cached tensor that can ride in the cycle: a
    Sum or Average allreduce of the global set, on the CPU, ungrouped,
    without a prescale, of a dtype that float64 holds exactly, with at most
    RIDER_ELEMENTS elements. None for any other tensor."""
    if signature is None:
        return None
    (op, dtype, shape, reduce_op, _root, prescale, _post, pset, on_gpu, group,
     _group_size) = signature
    if (op != pb.ALLREDUCE or reduce_op not in (pb.SUM, pb.AVERAGE) or pset != 0 or on_gpu
            or group or prescale != 1.0 or dtype not in RIDER_DTYPES):
        return None
    count = math.prod(shape)
    return count if 0 < count <= RIDER_ELEMENTS else None


class SlotTable:
    """Cache id -> slot for the global set's cached tensors. Every rank
    applies the same evictions and assignments in the same order (at rounds)
    and takes the lowest free slot, so slots agree everywhere.

    `digest` sums up what sits in which slot (XOR of a 64-bit value per slot,
    from the slot, the tensor's name and its description, and of the
    payload's capacity). Every cycle checks that it is the same on every rank
    before running anything: a disagreement would reduce different tensors
    together.

    `layout` places the riders (`rider_elements`) in the cycle's payload:
    slot -> (offset, count) in float64 words, in slot order, as many as fit
    in `payload_words`. It follows from what sits in which slot, so it is the
    same wherever the digest is."""

    def __init__(self, capacity, payload_words=0):
        self.capacity = capacity
        self.payload_words = payload_words
        self._free = list(range(capacity))
        self._by_id = {}  # cache id -> (slot, its digest value)
        self._xor = 0
        self._riders = {}  # slot -> element count, for every rider in a slot
        self.layout = {}
        self.payload_size = 0  # words of the payload in use

    @property
    def digest(self):
        return self._xor ^ (self.payload_words * 0x9E3779B97F4A7C15 & (2 ** 64 - 1))

    def assign(self, cache_id, key=None, signature=None):
        item = self._by_id.get(cache_id)
        if item is not None:
            return item[0]
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        text = repr((key, signature)).encode("utf-8", "backslashreplace")
        value = (zlib.crc32(text) << 32 | zlib.crc32(text[::-1]) ^ slot) & (2 ** 64 - 1)
        self._by_id[cache_id] = (slot, value)
        self._xor ^= value
        count = rider_elements(signature) if self.payload_words else None
        if count is not None:
            self._riders[slot] = count
            self._lay_out()
        return slot

    def release(self, cache_id):
        item = self._by_id.pop(cache_id, None)
        if item is None:
            return None
        heapq.heappush(self._free, item[0])
        self._xor ^= item[1]
        if self._riders.pop(item[0], None) is not None:
            self._lay_out()
        return item[0]

    def _lay_out(self):
        layout, offset = {}, 0
        for slot in sorted(self._riders):
            count = self._riders[slot]
            if offset + count <= self.payload_words:
                layout[slot] = (offset, count)
                offset += count
        self.layout, self.payload_size = layout, offset

    def slot(self, cache_id):
        item = self._by_id.get(cache_id)
        return item[0] if item is not None else None

    def __len__(self):
        return len(self._by_id)


def _fusion_key(e):
    op = e.op
    if op == pb.BROADCAST:
        return (op, e.process_set_id, e.root_rank, e.device >= 0)
    # float_key's, inline (it runs for every tensor planned): only NaN != NaN.
    pre, post = e.prescale, e.postscale
    return (op, e.process_set_id, e.dtype_info.wire, e.reduce_op,
            pre if pre == pre else NAN_KEY, post if post == post else NAN_KEY, e.device >= 0)


def complete_groups(entries):
    """The entries whose group (if any) is complete among `entries`: a group
    runs all together or waits."""
    counts = {}
    for e in entries:
        if e.group:
            counts[e.group] = counts.get(e.group, 0) + 1
    return [e for e in entries if not e.group or counts[e.group] == e.group_size]


def plan_ready(entries, fusion_threshold, pack_limit):
    """[(response, its entries)] for cached entries ready on every rank, in
    the given (slot) order, fused as the Controller fuses: the same on every
    rank, since every rank's entry in a slot has the same description."""
    buckets, order = {}, []
    for e in entries:
        nbytes = e.tensor.nbytes
        if fusion_threshold <= 0:
            order.append([e])
            continue
        key = _fusion_key(e)
        bucket = buckets.get(key)
        if bucket is not None and bucket[1] + nbytes <= fusion_threshold:
            bucket[0].append(e)
            bucket[1] += nbytes
        else:
            bucket = buckets[key] = [[e], nbytes]
            order.append(bucket[0])
    responses = []
    for group in order:
        first = group[0]
        resp = pb.Response(op=first.op, process_set_id=first.process_set_id,
                           dtype=first.wire_dtype, reduce_op=first.reduce_op,
                           prescale=first.prescale, postscale=first.postscale,
                           root_rank=first.root_rank, device=first.device,
                           names=[e.name for e in group])
        if first.op == pb.ALLREDUCE:
            resp.pack_limit = pack_limit
        responses.append((resp, group))
    return responses
