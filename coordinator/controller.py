"""Rank 0's decisions: what runs next, everywhere, in which order.

The controller never touches tensor bytes. It is fed the requests every rank
submitted (`submit`) and produces `Plan`s: wire `Response`s, each with the
ranks that must run it, in the one order every rank follows. Along the way it

- keys negotiation by (process set, tensor name), so ranks may submit in any
  order and the same name in two process sets is two tensors, as in Horovod;
- checks that the ranks agree on a tensor (op, dtype, shape, reduce op, root,
  scale factors, device) and otherwise fails it on every rank with an error
  naming each distinct value and the ranks that sent it;
- fails an operation on every member when one member refused it
  (`Request.rejected`), when it stalled, or when its group cannot complete;
  members that had not submitted it yet *owe* it, and their next
  submission of that name (their copy of the failed operation) fails with
  the same error, so every rank's Nth submission of a name is only ever
  combined with the others' Nth. In the global set the ranks are sent a
  notice (`take_notices`) and fail their copy themselves (it may never reach
  rank 0: see negotiation.py); in other sets rank 0 answers their copy;
- counts joined ranks as ready (they take part in allreduces with zeros; any
  other collective fails while a rank has joined, as in Horovod);
- fuses ready tensors that can share one buffer, up to the fusion threshold;
- hands out response-cache ids so later steps can skip the descriptions.

It is plain Python over wire messages so it can be tested without MPI.
"""

import collections
import time

from coordinator import dtypes
from coordinator.ops_names import (JOIN_NAME, describe, display_name, format_ranks, op_name,
                                    reduce_op_name)
from coordinator.negotiation import answered_in_rounds, in_rounds
from coordinator.response_cache import CoordinatorCache, float_key
from coordinator.stall_inspector import StallInspector
from coordinator.wire import pb

FUSABLE = frozenset({pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.REDUCESCATTER})
CACHEABLE = frozenset({pb.ALLREDUCE, pb.BROADCAST, pb.REDUCESCATTER})
# Operations negotiated among all ranks whatever process set they name.
GLOBAL_OPS = frozenset({pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET, pb.JOIN})
# Operations Horovod refuses while a rank has joined: only allreduce can
# take zeros in place of a joined rank's tensor.
NOT_WITH_JOIN = frozenset({pb.ALLGATHER, pb.BROADCAST, pb.ALLTOALL, pb.REDUCESCATTER,
                           pb.P2P})
# Operations every rank calls itself, a joined one too once its join returns:
# they fail while a rank has joined, and it owes the error (where they ran
# without it, its own call later found the set it asked for already there,
# or already gone).
EVERY_RANK_OPS = frozenset({pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET})
# How many removed sets' members rank 0 keeps for their operations still in
# flight (a set is removed once its operations have been negotiated; they
# may still run for a while).
REMEMBERED_SETS = 256
# How long rank 0 holds a rank's join back for requests it asked that rank
# to send again in full (Controller._hold_join); past it, the join counts
# as it came (a request the rank could no longer send, its tensor failed).
RESEND_WAIT_SECONDS = 10.0


def negotiation_set(op, process_set_id):
    """The process set an operation is negotiated in (its name's scope)."""
    return 0 if op in GLOBAL_OPS else process_set_id


class Plan:
    """A response, the global ranks that must run it, and for the autotuner
    the bytes it moves and its tensors' names."""

    __slots__ = ("response", "recipients", "nbytes", "names")

    def __init__(self, response, recipients, nbytes=0, names=()):
        self.response = response
        self.recipients = tuple(recipients)
        self.nbytes = nbytes
        self.names = names

    def __repr__(self):
        r = self.response
        what = list(r.names) + [f"#{i}" for i in r.cache_ids]
        return f"Plan({op_name(r.op)} {what} -> {self.recipients}{' ERROR' if r.error else ''})"


class _Negotiation:
    __slots__ = ("name", "process_set_id", "members", "first", "requests", "cached",
                 "arrivals", "nbytes", "group")

    def __init__(self, name, process_set_id, members, now, group=None):
        self.name = name
        self.process_set_id = process_set_id
        self.members = members
        self.first = now
        self.requests = {}  # rank -> Request
        self.cached = {}  # rank -> cache id the rank used (0: sent in full)
        self.arrivals = {}  # rank -> submit time the rank reported
        self.nbytes = 0  # bytes the operation moves, once ready
        self.group = group  # (process set, group key) of a grouped operation

    @property
    def key(self):
        return (self.process_set_id, self.name)

    def representative(self):
        return self.requests[min(self.requests)]


class _Group:
    """One instance of a grouped operation: its members run together or fail
    together. Every rank submits all its members at once (one RequestList)."""

    __slots__ = ("sizes", "done", "op")

    def __init__(self, op):
        self.op = op
        self.sizes = {}  # rank -> how many tensors its group holds
        self.done = []  # negotiations that completed, waiting for the rest


def _round_bound(resp):
    if resp.error:  # runs no collective: no order to keep (and names no device)
        return in_rounds(resp.op, resp.process_set_id)
    return answered_in_rounds(resp.op, resp.process_set_id, resp.device)


def _streamed_to_round(item):
    """Whether a request or response (not an error) streams to rank 0 but
    is answered in a round (negotiation.answered_in_rounds)."""
    return (not in_rounds(item.op, item.process_set_id)
            and answered_in_rounds(item.op, item.process_set_id, item.device))


def _shape(req):
    return tuple(req.shape)


def _fmt_shape(shape):
    return str(tuple(shape))


def _fmt_float(value):
    return "nan" if isinstance(value, tuple) else repr(value)


# (label, extract, render) of the fields ranks must agree on, by op. Floats
# are compared through float_key, so NaN equals NaN.
# Ranks may hold the same tensor on different GPUs (each its local one): they
# must agree on where it lives, CPU or GPU, not on the ordinal.
_COMMON_FIELDS = [
    ("dtype", lambda r: r.dtype, dtypes.wire_name),
    ("device", lambda r: r.device >= 0, lambda on_gpu: "GPU" if on_gpu else "CPU"),
]
_REDUCE_FIELDS = [
    ("shape", _shape, _fmt_shape),
    ("reduce op", lambda r: r.reduce_op, reduce_op_name),
    ("prescale factor", lambda r: float_key(r.prescale), _fmt_float),
    ("postscale factor", lambda r: float_key(r.postscale), _fmt_float),
]
_TRAILING = ("trailing dimensions (shape[1:])", lambda r: tuple(r.shape[1:]), _fmt_shape)
_NDIM = ("number of dimensions", lambda r: len(r.shape), str)
_OP_FIELDS = {
    pb.ALLREDUCE: _COMMON_FIELDS + _REDUCE_FIELDS,
    pb.REDUCESCATTER: _COMMON_FIELDS + _REDUCE_FIELDS,
    pb.BROADCAST: _COMMON_FIELDS + [("shape", _shape, _fmt_shape),
                                    ("root rank", lambda r: r.root_rank, str)],
    pb.ALLGATHER: _COMMON_FIELDS + [_NDIM, _TRAILING],
    pb.ALLTOALL: _COMMON_FIELDS + [_NDIM, _TRAILING],
    pb.BARRIER: [],
    pb.ADD_PROCESS_SET: [("ranks", lambda r: tuple(r.ranks), lambda v: str(list(v)))],
    pb.REMOVE_PROCESS_SET: [("process set", lambda r: r.process_set_id, str)],
    pb.P2P: [("sender and receiver", lambda r: tuple(r.ranks), lambda v: str(list(v)))],
}


def mismatch_text(field, op, name, values_by_rank, render):
    """`Mismatched shape for allreduce of tensor 'x': rank 1 sent shape (5,);
    ranks 0, 2 sent (4,).` Groups are listed smallest first."""
    groups = {}
    for rank, value in values_by_rank.items():
        groups.setdefault(value, []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    parts = []
    for i, (value, ranks) in enumerate(ordered):
        label = f"{field} " if i == 0 else ""
        parts.append(f"{format_ranks(ranks)} sent {label}{render(value)}")
    return f"Mismatched {field} for {describe(op, name)}: " + "; ".join(parts) + "."


def _itemsize(req):
    info = dtypes.info_for_wire(req.dtype)
    return info.dtype.itemsize if info is not None else 1


def tensor_nbytes(req):
    n = _itemsize(req)
    for d in req.shape:
        n *= d
    return n


def row_nbytes(req):
    """Bytes per unit of the first dimension."""
    n = _itemsize(req)
    for d in req.shape[1:]:
        n *= d
    return n


def _have(ranks):
    return "has" if len(ranks) == 1 else "have"


class Controller:
    def __init__(self, size, fusion_threshold=128 * 1024 * 1024, cache_capacity=1024,
                 stall_inspector=None, timeline=None, cycle_time=0.0, clock=time.monotonic,
                 pack_limit=0):
        self.size = size
        self.fusion_threshold = fusion_threshold
        # Allreduce tensors this big (bytes) are reduced where they are rather
        # than copied through the fusion buffer; sent to every rank in each
        # response (0: copy every fused tensor).
        self.pack_limit = pack_limit
        self.cycle_time = cycle_time
        self.cache = CoordinatorCache(cache_capacity)
        self.stall_inspector = stall_inspector or StallInspector(0, 0, disabled=True)
        self.timeline = timeline
        self.clock = clock
        self.process_sets = {0: tuple(range(size))}
        # Removed sets' members, for their operations still running on some
        # rank (members_of); the most recent REMEMBERED_SETS of them.
        self._removed_sets = collections.OrderedDict()
        self._next_process_set_id = 1
        self._pending = {}  # (process set, name) -> _Negotiation
        self._ready = []  # negotiations that passed validation, in readiness order
        self._ready_since = None
        self._ready_bytes = 0
        self._groups = {}  # (process set, group key) -> _Group
        # Global set: rank -> error Responses for operations that failed
        # before the rank submitted them (a group's: `group` set, no names).
        self._notices = {}
        # Other sets: (set, name) -> {rank: deque of error Responses}, and
        # (set, group) -> {rank: deque of (text, kind)}: answered on arrival.
        self._owed = {}
        self._owed_groups = {}
        # While one RequestList is processed (from rank `_reading`):
        # (group, rank) -> (text, kind) for a failed group instance whose
        # other members may still follow in it.
        self._batch_failed = {}
        self._reading = None
        self._joined = {}  # rank -> order of joining
        self._plans = []
        self._resend = {}  # rank -> [cache ids to send in full]
        # rank -> {(process set, name): when asked} of those ids, until the
        # rank sends the request; and rank -> its join, held while rank 0
        # waits for them (_hold_join).
        self._awaiting = {}
        self._held_joins = {}
        self.shutdown_reason = ""
        self.shutdown_finished = False

    # ------------------------------------------------------------------ input
    def register_process_set(self, process_set_id, ranks):
        self.process_sets[process_set_id] = tuple(sorted(ranks))
        self._next_process_set_id = max(self._next_process_set_id, process_set_id + 1)

    def submit(self, rank, request_list):
        """Everything one RequestList from `rank` asks for."""
        self._reading = rank
        try:
            for cached in request_list.cached:
                template = self.cache.get(cached.cache_id)
                if template is None:
                    self._resend.setdefault(rank, []).append(cached.cache_id)
                    self._await_resend(rank, cached.cache_id)
                else:
                    self.submit_request(rank, template, cached.submit_time, cached.cache_id)
            for req in request_list.requests:
                if rank in self._awaiting:
                    self._resent(rank, req)
                self.submit_request(rank, req, req.submit_time)
            if self._held_joins:
                self._release_joins()
        finally:
            self._reading = None
            self._batch_failed.clear()
        if request_list.shutdown:
            self.request_shutdown(rank, request_list.shutdown_reason, request_list.finished)

    def request_shutdown(self, rank, why="", finished=False):
        """`rank` shuts down for `why`; `finished`: its program is done. The
        first request is the job's."""
        if not self.shutdown_reason:
            self.shutdown_reason = f"rank {rank} {why or 'called shutdown()'}"
            self.shutdown_finished = finished

    def submit_request(self, rank, req, submit_time=0.0, cache_id=0):
        if req.op == pb.JOIN:
            if not self._hold_join(rank, req):
                self._join(rank, req)
            return
        name = req.name
        pset = negotiation_set(req.op, req.process_set_id)
        key = (pset, name)
        gkey = (pset, req.group) if req.group else None
        if gkey is not None and self._in_failed_group(rank, gkey, req):
            return
        if self._pay_owed(rank, key, req) or self._pay_notice(rank, key, gkey, req):
            return
        members = self.process_sets.get(pset)
        if members is None:
            if not req.rejected:
                self._fail((rank,), pset, req,
                           f"{describe(req.op, name)} names process set {pset}, "
                           "which is not registered (was it removed?)")
            return
        if rank not in members:
            if not req.rejected:
                self._fail((rank,), pset, req,
                           f"rank {rank} submitted {describe(req.op, name)} on "
                           f"process set {pset}, which does not include it (members: "
                           f"{list(members)})")
            return
        if req.op == pb.P2P:
            members = self._pair(rank, pset, req, members)
            if members is None:
                return
        elif req.op == pb.ADD_PROCESS_SET and req.among_members:
            members = self._among(rank, req)
            if members is None:
                return
        if req.rejected:
            self._reject(rank, pset, req, members)
            return
        neg = self._pending.get(key)
        if neg is None:
            neg = _Negotiation(name, pset, members, self._since(submit_time), gkey)
            self._pending[key] = neg
            if self._tracing():
                self.timeline.negotiate_start(display_name(pset, name), req.op, req,
                                              submit_time)
        if rank in neg.requests:
            self._fail((rank,), pset, req,
                       f"{describe(req.op, name)} was submitted twice by rank "
                       f"{rank} before it completed")
            return
        neg.requests[rank] = req
        neg.cached[rank] = cache_id
        neg.arrivals[rank] = submit_time
        if self._tracing():
            self.timeline.negotiate_rank_ready(display_name(pset, name), rank, submit_time)
        if gkey is not None and not self._join_group(rank, gkey, neg, req):
            return
        if self._complete(neg):
            self._finish(neg)

    def _pair(self, rank, pset, req, members):
        """The two ranks of a send/recv, or None (and an error to `rank`)."""
        pair = tuple(req.ranks)
        if len(pair) == 2 and pair[0] != pair[1] and rank in pair and all(
                r in members for r in pair):
            return pair
        if not req.rejected:
            self._fail((rank,), pset, req,
                       f"send/recv of tensor '{req.name}': ranks {list(pair)} are not a sender "
                       f"and a receiver of process set {pset} ({list(members)}) that include "
                       f"rank {rank}")
        return None

    def _among(self, rank, req):
        """The ranks that negotiate a set added by its own members (the
        valid ranks it lists, with a refusing rank's own), or None (and an
        error to `rank`)."""
        ranks = tuple(sorted(set(req.ranks)))
        valid = tuple(r for r in ranks if 0 <= r < self.size)
        if req.rejected:
            return tuple(sorted(set(valid) | {rank}))
        if valid == ranks and rank in ranks and len(ranks) == len(req.ranks):
            return ranks
        self._fail((rank,), 0, req, f"add_process_set: ranks {list(req.ranks)} are not valid "
                                    f"for {self.size} ranks with rank {rank} among them")
        return None

    def _since(self, submit_time):
        """When (on this clock) a request submitted at `submit_time` (seconds
        since the epoch, on the submitting rank) was submitted: a tensor may
        have waited in a negotiation cycle before it was described here, and
        the stall inspector counts from the submission."""
        now = self.clock()
        if submit_time <= 0:
            return now
        return now - min(max(time.time() - submit_time, 0.0), 3600.0)

    # ---------------------------------------------------------------- output
    def take_plans(self, now=None, global_set=True):
        """The plans decided since the last call, in the order to run them.
        With global_set=False, the global set's stay for a later call (they
        go out at negotiation rounds; see negotiation.py)."""
        if self._held_joins:
            self._release_joins(now)
        if self._ready and not self._holding(now):
            self._plans.extend(self._fuse(self._ready))
            self._ready = []
            self._ready_since = None
            self._ready_bytes = 0
        if global_set:
            plans, self._plans = self._plans, []
        else:
            plans = [p for p in self._plans if not _round_bound(p.response)]
            self._plans = [p for p in self._plans if _round_bound(p.response)]
        return plans

    # ------------------------------------------------------------- resends
    def _await_resend(self, rank, cache_id):
        key = self.cache.dropped_key(cache_id)
        if key is not None:
            self._awaiting.setdefault(rank, {})[key] = self.clock()

    def _resent(self, rank, req):
        waits = self._awaiting[rank]
        waits.pop((negotiation_set(req.op, req.process_set_id), req.name), None)
        if not waits:
            del self._awaiting[rank]

    def _still_awaited(self, rank, now):
        """Whether rank 0 still waits for `rank` to send again in full a
        request it sent by an id rank 0 had dropped (not for longer than
        RESEND_WAIT_SECONDS)."""
        waits = self._awaiting.get(rank)
        if not waits:
            return False
        for key in [k for k, since in waits.items() if now - since > RESEND_WAIT_SECONDS]:
            del waits[key]
        if not waits:
            del self._awaiting[rank]
            return False
        return True

    def _hold_join(self, rank, req):
        """A rank's join waits for the requests rank 0 asked it to send again:
        sent by an id rank 0 had dropped just before (another set's new
        tensors evicted it before the rank heard), they come in a later
        list, and a join that completed first would have let the other
        ranks go on, leaving them to wait for ranks that never come (a
        joined rank stands in with zeros only until every rank has
        joined). Whether it is held."""
        if not self._still_awaited(rank, self.clock()):
            return False
        self._held_joins[rank] = req
        return True

    def _release_joins(self, now=None):
        now = self.clock() if now is None else now
        for rank in [r for r in self._held_joins if not self._still_awaited(r, now)]:
            self._join(rank, self._held_joins.pop(rank))

    def take_resends(self):
        resend, self._resend = self._resend, {}
        return resend

    def next_deadline(self):
        """When a held fusion (HOROVOD_CYCLE_TIME) must go out, or None."""
        if self._ready and self.cycle_time > 0 and self._ready_since is not None:
            return self._ready_since + self.cycle_time
        return None

    def has_pending(self):
        return bool(self._pending or self._ready or self._plans or self._held_joins)

    def take_notices(self):
        """rank -> error Responses of operations the rank owes (see above),
        decided since the last call."""
        notices, self._notices = self._notices, {}
        return notices

    def has_global_output(self):
        """Something for the next round: global-set plans or notices."""
        return bool(self._notices or any(_round_bound(p.response) for p in self._plans)
                    or any(answered_in_rounds(n.representative().op, n.process_set_id,
                                              n.representative().device)
                           for n in self._ready))

    def has_device_stream_output(self):
        """Something for the next round that ranks outside its set do not
        wait for: another set's (or a send/recv's) plan on a GPU
        (negotiation.answered_in_rounds)."""
        return (any(not p.response.error and _streamed_to_round(p.response)
                    for p in self._plans)
                or any(_streamed_to_round(n.representative()) for n in self._ready))

    def has_stream_pending(self):
        """Open negotiations of other sets or send/recv (streamed)."""
        return any(not in_rounds(n.representative().op, n.process_set_id)
                   for n in self._pending.values())

    def has_global_pending(self):
        return any(in_rounds(n.representative().op, n.process_set_id)
                   for n in self._pending.values())

    def waits_on_cycles(self):
        """Whether a global-set negotiation waits for ranks while its tensor
        is cached. Those ranks may hold it in the negotiation cycle: ranks
        take a cached tensor for the cycle or for a round by the parameters
        they hold at that moment, so when cycles are switched back on (the
        timeline stopped, every rank joined), a rank that took it just
        before the switch describes it in a round and a rank that took it
        just after sets its cycle bit, and neither path can complete. And a
        rank that submits it with another description (a shape, dtype or
        reduction that changed on that rank alone) describes it in a round
        while the others set their bits for the cached one: without a
        report, the mismatch waited for the stall check's report (30 s by
        default; for ever with stall checks off), instead of failing at
        once. A report round brings the cycle's copies here.

        So too for a group's members; and for a group that every rank has
        split, describing some members here and holding the others in the
        cycle, where the cycle never runs them: its negotiations complete
        here and wait for members no rank described. Ranks keep a group
        whole, in the cycle or out of it (Background._whole_groups and
        _unslot); should one still split it, this asks for a report every
        few milliseconds instead of leaving it to wait for ever."""
        if not self.cache.enabled:
            return False
        for neg in self._pending.values():
            if neg.process_set_id != 0:
                continue
            req = neg.representative()
            if req.op in CACHEABLE and self.cache.holds(0, req.name):
                return True
        # (Each rank describes the members it takes for rounds at once.)
        if not self._groups:
            return False
        waiting = {n.group for n in self._pending.values()}
        return any(gkey[0] == 0 and group.done and gkey not in waiting
                   for gkey, group in self._groups.items())

    def joined(self):
        """Whether some rank has joined (and not every rank yet)."""
        return bool(self._joined)

    def forget(self, key, group=""):
        """Drops an open negotiation, or a complete one not planned yet: the
        ranks ran the operation another way (the steady-state path, after
        some of them had reported it). A group member's whole group goes
        with it (the cycle runs a group whole): members it had completed
        too, which would otherwise wait for the next instance's and keep
        asking for reports."""
        neg = self._pending.pop(key, None)
        if neg is not None:
            self._negotiation_over(neg)
        gkey = (key[0], group) if group else None
        if gkey:
            self._groups.pop(gkey, None)
        if not self._ready:  # (the steady state: called for every tensor a cycle runs)
            return
        # Complete, it may wait in _ready for the cycle time (HOROVOD_CYCLE_TIME):
        # planned, it would run again, with the ranks' next copies.
        kept = [n for n in self._ready if n.key != key and (gkey is None or n.group != gkey)]
        if len(kept) < len(self._ready):
            self._ready = kept
            self._ready_bytes = sum(n.nbytes for n in kept)
            if not kept:
                self._ready_since = None

    # ------------------------------------------------------------ stalls
    def inspect_stalls(self, now=None, inside=None, blocked=None, silent=None):
        """Stall warnings (texts) to log now; fails the stalls that expired.
        `inside(rank)`: the long collective a rank is in (or None), which the
        texts name; `blocked`: {rank: how long it has been blocked waiting
        with nothing in flight} (deadlocks, stall_inspector.py); `silent`:
        {rank: how long it has not answered rank 0}, which the texts name."""
        now = self.clock() if now is None else now
        inspector = self.stall_inspector
        if inspector.idle or not self._pending:
            return []
        joined = self._joined
        rows = []
        for neg in self._pending.values():
            missing = [m for m in neg.members if m not in neg.requests and m not in joined]
            rows.append((neg.key, neg.representative().op, neg.first, list(neg.requests),
                         missing))
        warnings, expired = inspector.inspect(now, rows, inside, blocked, silent)
        for stall in expired:
            neg = self._pending.get(stall.key)
            if neg is None:  # failed with its group earlier in this loop
                continue
            self._fail_negotiation(neg, inspector.error_text(stall, expired),
                                   pb.DEADLOCK if stall.deadlocked else pb.STALL)
        if warnings:
            return [inspector.warning_text(warnings)]
        return []

    # ------------------------------------------------------- failure paths
    def _pay_owed(self, rank, key, req):
        """True when this submission is `rank`'s copy of an operation that
        already failed (outside the global set): it gets that error (a
        refusal needs no answer)."""
        owed = self._owed.get(key)
        if not owed or rank not in owed:
            return False
        queue = owed[rank]
        resp = queue.popleft()
        if not queue:
            del owed[rank]
            if not owed:
                del self._owed[key]
        if not req.rejected:
            self._plans.append(Plan(resp, (rank,)))
        return True

    def _pay_notice(self, rank, key, gkey, req):
        """True when `rank` was to be told it owes this operation but has
        submitted it before hearing so (the same round): it is answered
        here, and the notice is withdrawn."""
        notices = self._notices.get(rank)
        if not notices:
            return False
        for i, notice in enumerate(notices):
            if (notice.group and (notice.process_set_id, notice.group) == gkey) \
                    or (not notice.group and (notice.process_set_id, notice.names[0]) == key):
                break
        else:
            return False
        if notice.group:
            self._batch_failed[(gkey, rank)] = (notice.error, notice.error_kind)
        del notices[i]
        if not notices:
            del self._notices[rank]
        if not req.rejected:
            self._plans.append(Plan(self._error_response(key[0], req, notice.error,
                                                         notice.error_kind), (rank,)))
        return True

    def _in_failed_group(self, rank, gkey, req):
        """True for the members of a group instance that failed (in this
        rank's RequestList being read, or that the rank owes outside the
        global set): they fail too."""
        failed = self._batch_failed.get((gkey, rank))
        if failed is None:
            owed = self._owed_groups.get(gkey)
            if not owed or rank not in owed:
                return False
            queue = owed[rank]
            failed = queue.popleft()
            if not queue:
                del owed[rank]
                if not owed:
                    del self._owed_groups[gkey]
            self._batch_failed[(gkey, rank)] = failed
        if not req.rejected:
            text, kind = failed
            self._plans.append(Plan(self._error_response(gkey[0], req, text, kind), (rank,)))
        return True

    def _owe(self, ranks, resp):
        """`ranks` owe the failed operation `resp` describes."""
        for rank in ranks:
            if in_rounds(resp.op, resp.process_set_id):
                self._notices.setdefault(rank, []).append(resp)
            elif resp.group:
                owed = self._owed_groups.setdefault((resp.process_set_id, resp.group), {})
                owed.setdefault(rank, collections.deque()).append((resp.error,
                                                                   resp.error_kind))
            else:
                owed = self._owed.setdefault((resp.process_set_id, resp.names[0]), {})
                owed.setdefault(rank, collections.deque()).append(resp)

    def _fail_negotiation(self, neg, text, kind, excused=()):
        """Fails an open negotiation on the ranks that submitted it; the other
        members (but `excused` and joined ranks) owe it."""
        if neg.group is not None and neg.group in self._groups:
            self._fail_group(neg.group, text, kind, excused)
            return
        self._pending.pop(neg.key, None)
        self._negotiation_over(neg)
        resp = self._error_response(neg.process_set_id, neg.representative(), text, kind)
        self._plans.append(Plan(resp, sorted(neg.requests)))
        every = resp.op in EVERY_RANK_OPS
        self._owe([m for m in neg.members if m not in neg.requests
                   and m not in excused and (every or m not in self._joined)], resp)

    def _fail_group(self, gkey, text, kind, excused=(), whole=False):
        """Fails every member of a group instance on the ranks that submitted
        it; members of the set that have not submitted the group owe it.
        `whole`: the failing request stands for the whole instance of the
        rank whose list is being read (a refusal), so none of it follows."""
        group = self._groups.pop(gkey)
        negs = list(group.done) + [n for n in self._pending.values() if n.group == gkey]
        for neg in negs:
            self._pending.pop(neg.key, None)
            self._negotiation_over(neg)
            resp = self._error_response(neg.process_set_id, neg.representative(), text, kind)
            self._plans.append(Plan(resp, sorted(neg.requests)))
        if self._reading in group.sizes and not whole:
            # The rest of this instance in the list being read fails too.
            # Other lists hold none of it, as each rank describes a group's
            # members together (a member whose cache id rank 0 did not know,
            # to be resent, fails on its rank with the others: Background.
            # _fail_rest_of_group). Recorded for other ranks, or outside a
            # list (a stall), it failed their next instance as well.
            self._batch_failed[(gkey, self._reading)] = (text, kind)
        notice = pb.Response(op=group.op, process_set_id=gkey[0], group=gkey[1], error=text,
                             error_kind=kind)
        self._owe([m for m in self.process_sets.get(gkey[0], ())
                   if m not in group.sizes and m not in excused and m not in self._joined],
                  notice)

    def _reject(self, rank, pset, req, members):
        """`rank` refused this operation (bad input on that rank): it fails on
        every member, naming the rank and its reason."""
        what = (f"grouped {op_name(req.op)} '{req.group}'" if req.group
                else describe(req.op, req.name))
        text = f"rank {rank} rejected {what}: {req.rejected}"
        if req.group:
            gkey = (pset, req.group)
            group = self._groups.get(gkey)
            if group is None:
                group = self._groups[gkey] = _Group(req.op)
            group.sizes[rank] = req.group_size
            # Members of that group later in its list are its next instance.
            self._fail_group(gkey, text, pb.INVALID, whole=True)
            return
        key = (pset, req.name)
        neg = self._pending.get(key)
        if neg is not None:
            self._fail_negotiation(neg, text, pb.INVALID, excused=(rank,))
            return
        resp = self._error_response(pset, req, text, pb.INVALID)
        self._owe([m for m in members if m != rank and m not in self._joined], resp)

    def _join_group(self, rank, gkey, neg, req):
        """Records a group member; False when the group has failed (its
        negotiations are already answered)."""
        group = self._groups.get(gkey)
        if group is None:
            group = self._groups[gkey] = _Group(req.op)
        group.sizes.setdefault(rank, req.group_size)
        if len(set(group.sizes.values())) > 1:
            text = mismatch_text("group size", req.op, req.group, group.sizes, str)
            text = text.replace(f"of tensor '{req.group}'", f"group '{req.group}'")
            self._fail_group(gkey, text, pb.MISMATCH)
            return False
        return True

    # ------------------------------------------------------------ internals
    def _tracing(self):
        return self.timeline is not None and self.timeline.enabled

    def _negotiation_over(self, neg):
        if self._tracing():
            self.timeline.negotiate_end(display_name(neg.process_set_id, neg.name))

    def _holding(self, now):
        if self.cycle_time <= 0 or self._ready_since is None:
            return False
        if 0 < self.fusion_threshold <= self._ready_bytes:
            return False
        now = self.clock() if now is None else now
        return now - self._ready_since < self.cycle_time

    def _complete(self, neg):
        if not self._joined:
            return len(neg.requests) == len(neg.members)
        return all(m in neg.requests or m in self._joined for m in neg.members)

    def _finish(self, neg):
        error, kind = self._validate(neg)
        if error:
            self._fail_negotiation(neg, error, kind)
            return
        del self._pending[neg.key]
        self._negotiation_over(neg)
        if neg.group is None:
            self._make_ready(neg)
            return
        group = self._groups[neg.group]
        group.done.append(neg)
        size = neg.representative().group_size
        if len(group.done) < size:
            return
        del self._groups[neg.group]
        for member in group.done:
            self._make_ready(member)

    def _make_ready(self, neg):
        req = neg.representative()
        if req.op in (pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET):
            self._plans.extend(self._fuse(self._ready))
            self._ready = []
            self._plans.append(self._process_set_plan(neg))
            return
        if not self._ready:
            self._ready_since = self.clock()
        neg.nbytes = self._fused_nbytes(neg, req)
        self._ready.append(neg)
        self._ready_bytes += neg.nbytes

    def _validate(self, neg):
        cached = set(neg.cached.values())
        if len(cached) == 1 and 0 not in cached and len(neg.cached) == len(neg.requests):
            # Every rank sent the same cache id: the same, already valid,
            # description; only checks that depend on joined ranks remain.
            return (self._check_op(neg, neg.representative()) if self._joined else ""), \
                pb.INVALID
        reqs = neg.requests
        req = neg.representative()
        ops = {r: q.op for r, q in reqs.items()}
        if len(set(ops.values())) > 1:
            return mismatch_text("operation", req.op, neg.name, ops, op_name), pb.MISMATCH
        errors = []
        for label, extract, render in _OP_FIELDS.get(req.op, []):
            values = {r: extract(q) for r, q in reqs.items()}
            if len(set(values.values())) > 1:
                errors.append(mismatch_text(label, req.op, neg.name, values, render))
        if errors:
            return " ".join(errors), pb.MISMATCH
        return self._check_op(neg, req), pb.INVALID

    def _check_op(self, neg, req):
        members = neg.members
        joined = [m for m in members if m in self._joined]
        if joined and req.op in NOT_WITH_JOIN:
            return (f"{describe(req.op, neg.name)} cannot run while "
                    f"{format_ranks(joined)} {_have(joined)} joined: only allreduce takes "
                    "part with a joined rank (Horovod raises here too)")
        if joined and req.op in EVERY_RANK_OPS:
            return (f"{op_name(req.op)} ({neg.name}) cannot run while "
                    f"{format_ranks(joined)} {_have(joined)} joined: every rank calls it, "
                    "the joined ones too once join() returns, so it goes before join() or "
                    f"after every rank's join() has returned ({format_ranks(joined)} "
                    "will get this error when calling it)")
        if req.op == pb.BROADCAST:
            if req.root_rank not in members:
                return (f"broadcast of tensor '{neg.name}': root rank {req.root_rank} is not a "
                        f"member of process set {neg.process_set_id} ({list(members)})")
        elif req.op == pb.ALLTOALL:
            for rank, q in neg.requests.items():
                if len(q.splits) != len(members):
                    return (f"alltoall of tensor '{neg.name}': rank {rank} sent "
                            f"{len(q.splits)} splits for a process set of {len(members)}")
        elif req.op == pb.ADD_PROCESS_SET:
            ranks = tuple(sorted(req.ranks))
            if not ranks or len(set(ranks)) != len(ranks) or not all(
                    0 <= r < self.size for r in ranks):
                return f"add_process_set: invalid ranks {list(req.ranks)} for {self.size} ranks"
            pid = self._set_of(ranks)
            if pid is not None and not req.among_members:  # (theirs: its id)
                return (f"add_process_set: a process set with ranks {list(ranks)} "
                        f"already exists (id {pid})")
        elif req.op == pb.REMOVE_PROCESS_SET:
            if req.process_set_id == 0:
                return "remove_process_set: the global process set cannot be removed"
            if req.process_set_id not in self.process_sets:
                return f"remove_process_set: process set {req.process_set_id} is not registered"
        return ""

    def _error_response(self, pset, req, text, kind=pb.INVALID):
        return pb.Response(op=req.op, process_set_id=pset, names=[req.name], error=text,
                           error_kind=kind)

    def _fail(self, ranks, pset, req, text):
        self._plans.append(Plan(self._error_response(pset, req, text), ranks))

    def _join(self, rank, req):
        if rank not in self._joined:
            self._joined[rank] = len(self._joined)
        for neg in list(self._pending.values()):
            if neg.key in self._pending and self._complete(neg):
                self._finish(neg)
        if len(self._joined) == self.size:
            last = max(self._joined, key=self._joined.get)
            # Planned while the joined ranks are still known: an allreduce
            # made ready by this last join carries them, and zeros stand in
            # for their part.
            self._plans.extend(self._fuse(self._ready))
            self._ready = []
            self._joined = {}
            self._plans.append(Plan(pb.Response(op=pb.JOIN, names=[JOIN_NAME], value=last),
                                    range(self.size)))

    def _process_set_plan(self, neg):
        req = neg.representative()
        members = tuple(range(self.size))
        if req.op == pb.ADD_PROCESS_SET:
            ranks = tuple(sorted(req.ranks))
            pid = self._set_of(ranks)
            if pid is not None:  # added by its own members, and there already
                resp = pb.Response(op=pb.ADD_PROCESS_SET, names=[neg.name], value=pid,
                                   ranks=ranks)
                return Plan(resp, neg.members)
            pid = self._next_process_set_id
            self._next_process_set_id += 1
            self.process_sets[pid] = ranks
            # Every rank registers it, its own ranks' add or not: every
            # table holds the same sets.
            resp = pb.Response(op=pb.ADD_PROCESS_SET, names=[neg.name], value=pid, ranks=ranks)
        else:
            pid = req.process_set_id
            removed = self.process_sets.pop(pid, None)
            if removed is not None:
                self._removed_sets[pid] = removed
                while len(self._removed_sets) > REMEMBERED_SETS:
                    self._removed_sets.popitem(last=False)
            for other in [n for n in self._pending.values() if n.process_set_id == pid]:
                self._pending.pop(other.key, None)
                self._negotiation_over(other)
                rep = other.representative()
                self._plans.append(Plan(self._error_response(
                    pid, rep, f"process set {pid} was removed before "
                              f"{describe(rep.op, other.name)} could run"), sorted(other.requests)))
            for table in (self._owed, self._owed_groups, self._groups):
                for key in [k for k in table if k[0] == pid]:
                    del table[key]
            resp = pb.Response(op=pb.REMOVE_PROCESS_SET, names=[neg.name], value=pid)
        return Plan(resp, members)

    def _set_of(self, ranks):
        """The id of the registered set whose ranks are `ranks` (sorted), or
        None."""
        return next((pid for pid, existing in self.process_sets.items() if existing == ranks),
                    None)

    def members_of(self, process_set_id):
        """A set's ranks, also for a set removed while its operations still
        ran (the watchdog asks about those), or None."""
        ranks = self.process_sets.get(process_set_id)
        return ranks if ranks is not None else self._removed_sets.get(process_set_id)

    # -------------------------------------------------------------- fusion
    def _fusion_key(self, req):
        op = req.op
        if op == pb.BROADCAST:
            return (op, req.process_set_id, req.root_rank, req.device)
        if op == pb.ALLGATHER:
            return (op, req.process_set_id, req.dtype, req.device)
        return (op, req.process_set_id, req.dtype, req.reduce_op, float_key(req.prescale),
                float_key(req.postscale), req.device)

    def _fuse(self, ready):
        """Group ready negotiations into responses, keeping first-ready order."""
        threshold = self.fusion_threshold
        groups = []
        open_buckets = {}
        for neg in ready:
            req = neg.representative()
            if threshold <= 0 or req.op not in FUSABLE:
                groups.append([neg])
                continue
            nbytes = neg.nbytes
            key = self._fusion_key(req)
            bucket = open_buckets.get(key)
            if bucket is not None and bucket[1] + nbytes <= threshold:
                bucket[0].append(neg)
                bucket[1] += nbytes
            else:
                bucket = [[neg], nbytes]
                open_buckets[key] = bucket
                groups.append(bucket[0])
        return [self._plan(group) for group in groups]

    def _fused_nbytes(self, neg, req):
        if req.op == pb.P2P:
            return tensor_nbytes(neg.requests.get(neg.members[0], req))
        if req.op == pb.ALLGATHER:
            rows = sum(q.shape[0] for q in neg.requests.values())
            return row_nbytes(req) * rows
        return tensor_nbytes(req)

    def _plan(self, negs):
        if negs[0].representative().op == pb.P2P:
            return self._p2p_plan(negs[0])
        req = negs[0].representative()
        members = negs[0].members
        # (A rank that submitted these before joining takes part with them.)
        joined = [m for m in members
                  if m in self._joined and any(m not in neg.requests for neg in negs)]
        resp = pb.Response(op=req.op, process_set_id=negs[0].process_set_id, dtype=req.dtype,
                           reduce_op=req.reduce_op, prescale=req.prescale,
                           postscale=req.postscale, root_rank=req.root_rank, device=req.device)
        if req.op == pb.ALLREDUCE:
            resp.pack_limit = self.pack_limit
        cacheable = self.cache.enabled and req.op in CACHEABLE
        named, by_id = [], []
        for neg in negs:
            if cacheable and not joined and all(neg.cached.get(m, 0) for m in members):
                by_id.append(neg)
            else:
                named.append(neg)
        for neg in named:
            resp.names.append(neg.name)
            resp.new_cache_ids.append(self.cache.id_for(neg.process_set_id,
                                                        neg.representative())
                                      if cacheable else 0)
        for neg in by_id:
            resp.cache_ids.append(next(iter(neg.cached.values())))
        ordered = named + by_id
        if req.op == pb.ALLGATHER:
            for neg in ordered:
                resp.sizes.extend(neg.requests[m].shape[0] if m in neg.requests else 0
                                  for m in members)
        elif req.op == pb.ALLTOALL:
            neg = ordered[0]
            for m in members:
                resp.sizes.extend(neg.requests[m].splits)
        if joined:
            resp.joined_ranks.extend(joined)
            for neg in ordered:
                q = neg.representative()
                resp.specs.add(name=neg.name, dtype=q.dtype, shape=list(q.shape),
                               group=q.group, group_size=q.group_size)
        return Plan(resp, members, sum(neg.nbytes for neg in negs), [neg.name for neg in negs])

    def _p2p_plan(self, neg):
        """A send/recv: the receiver learns the tensor's dtype and shape from
        the sender's request (its spec)."""
        sender, receiver = neg.members
        req = neg.requests[sender]
        resp = pb.Response(op=pb.P2P, process_set_id=neg.process_set_id, names=[neg.name],
                           dtype=req.dtype, device=req.device, ranks=[sender, receiver])
        resp.specs.add(name=neg.name, dtype=req.dtype, shape=list(req.shape))
        return Plan(resp, neg.members, neg.nbytes, [neg.name])
