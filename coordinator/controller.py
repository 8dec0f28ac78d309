"""Rank 0's decisions: what runs next, everywhere, in which order.

The controller never touches tensor bytes. It is fed the requests every rank
submitted (`submit`) and produces `Plan`s: wire `Response`s, each with the
ranks that must run it, in the one order every rank follows. Along the way it

- keys negotiation by tensor name, so ranks may submit in any order;
- checks that the ranks agree on a tensor (op, dtype, shape, reduce op, root,
  scale factors, device, process set) and otherwise fails it on every rank with
  an error naming each distinct value and the ranks that sent it;
- counts joined ranks as ready (they take part with zeros);
- fuses ready tensors that can share one buffer, up to the fusion threshold;
- hands out response-cache ids so later steps can skip the descriptions.

It is plain Python over wire messages so it can be tested without MPI.
"""

import time

from coordinator import dtypes
from coordinator.ops_names import (device_name, format_ranks, op_name, reduce_op_name)
from coordinator.response_cache import CoordinatorCache
from coordinator.stall_inspector import StallInspector
from coordinator.wire import pb

FUSABLE = frozenset({pb.ALLREDUCE, pb.ALLGATHER, pb.BROADCAST, pb.REDUCESCATTER})
CACHEABLE = frozenset({pb.ALLREDUCE, pb.BROADCAST, pb.REDUCESCATTER})
# Operations negotiated among all ranks whatever process set they name.
GLOBAL_OPS = frozenset({pb.ADD_PROCESS_SET, pb.REMOVE_PROCESS_SET})
JOIN_NAME = "join"


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
                 "arrivals", "nbytes")

    def __init__(self, name, process_set_id, members, now):
        self.name = name
        self.process_set_id = process_set_id
        self.members = members
        self.first = now
        self.requests = {}  # rank -> Request
        self.cached = {}  # rank -> cache id the rank used (0: sent in full)
        self.arrivals = {}  # rank -> submit time the rank reported
        self.nbytes = 0  # bytes the operation moves, once ready

    def representative(self):
        return self.requests[min(self.requests)]


def _shape(req):
    return tuple(req.shape)


def _fmt_shape(shape):
    return str(tuple(shape))


# (label, extract, render) of the fields ranks must agree on, by op.
_COMMON_FIELDS = [
    ("dtype", lambda r: r.dtype, dtypes.wire_name),
    ("device", lambda r: r.device, device_name),
]
_REDUCE_FIELDS = [
    ("shape", _shape, _fmt_shape),
    ("reduce op", lambda r: r.reduce_op, reduce_op_name),
    ("prescale factor", lambda r: r.prescale, repr),
    ("postscale factor", lambda r: r.postscale, repr),
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
    pb.REMOVE_PROCESS_SET: [],
}
_GROUP_FIELD = ("group size", lambda r: r.group_size, str)


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
    return f"Mismatched {field} for {op_name(op)} of tensor '{name}': " + "; ".join(parts) + "."


def _itemsize(req):
    info = dtypes.BY_WIRE.get(req.dtype)
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
        self._next_process_set_id = 1
        self._pending = {}  # name -> _Negotiation
        self._ready = []  # negotiations that passed validation, in readiness order
        self._ready_since = None
        self._ready_bytes = 0
        self._groups = {}  # group key -> [negotiations done, ...]
        self._tombstones = {}  # name -> [error Response, ranks still to tell]
        self._joined = {}  # rank -> order of joining
        self._plans = []
        self._resend = {}  # rank -> [cache ids to send in full]
        self.shutdown_reason = ""

    # ------------------------------------------------------------------ input
    def register_process_set(self, process_set_id, ranks):
        self.process_sets[process_set_id] = tuple(sorted(ranks))
        self._next_process_set_id = max(self._next_process_set_id, process_set_id + 1)

    def submit(self, rank, request_list):
        """Everything one RequestList from `rank` asks for."""
        for cached in request_list.cached:
            template = self.cache.get(cached.cache_id)
            if template is None:
                self._resend.setdefault(rank, []).append(cached.cache_id)
            else:
                self.submit_request(rank, template, cached.submit_time, cached.cache_id)
        for req in request_list.requests:
            self.submit_request(rank, req, req.submit_time)
        if request_list.shutdown:
            self.request_shutdown(rank, request_list.shutdown_reason)

    def request_shutdown(self, rank, why=""):
        if not self.shutdown_reason:
            self.shutdown_reason = f"rank {rank} {why or 'called shutdown()'}"

    def submit_request(self, rank, req, submit_time=0.0, cache_id=0):
        if req.op == pb.JOIN:
            self._join(rank, req)
            return
        name = req.name
        tomb = self._tombstones.get(name)
        if tomb is not None:
            self._plans.append(Plan(tomb[0], (rank,)))
            tomb[1].discard(rank)
            if not tomb[1]:
                del self._tombstones[name]
            return
        pset = 0 if req.op in GLOBAL_OPS else req.process_set_id
        members = self.process_sets.get(pset)
        if members is None:
            self._fail((rank,), req, f"{op_name(req.op)} of tensor '{name}' names process set "
                                     f"{pset}, which is not registered (was it removed?)")
            return
        neg = self._pending.get(name)
        if neg is None:
            neg = _Negotiation(name, pset, members, self.clock())
            self._pending[name] = neg
            if self.timeline is not None and self.timeline.enabled:
                self.timeline.negotiate_start(name, req.op, req, submit_time)
        elif neg.process_set_id != pset:
            self._process_set_mismatch(neg, rank, req, pset)
            return
        if rank in neg.requests:
            self._fail((rank,), req, f"{op_name(req.op)} of tensor '{name}' was submitted twice "
                                     f"by rank {rank} before it completed")
            return
        if rank not in members:
            self._fail((rank,), req, f"rank {rank} submitted {op_name(req.op)} of tensor "
                                     f"'{name}' on process set {pset}, which does not "
                                     f"include it (members: {list(members)})")
            return
        neg.requests[rank] = req
        neg.cached[rank] = cache_id
        neg.arrivals[rank] = submit_time
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.negotiate_rank_ready(name, rank, submit_time)
        if self._complete(neg):
            self._finish(neg)

    # ---------------------------------------------------------------- output
    def take_plans(self, now=None):
        """The plans decided since the last call, in the order to run them."""
        if self._ready and not self._holding(now):
            self._plans.extend(self._fuse(self._ready))
            self._ready = []
            self._ready_since = None
            self._ready_bytes = 0
        plans, self._plans = self._plans, []
        return plans

    def take_resends(self):
        resend, self._resend = self._resend, {}
        return resend

    def next_deadline(self):
        """When a held fusion (HOROVOD_CYCLE_TIME) must go out, or None."""
        if self._ready and self.cycle_time > 0 and self._ready_since is not None:
            return self._ready_since + self.cycle_time
        return None

    def has_pending(self):
        return bool(self._pending or self._ready or self._plans)

    # ------------------------------------------------------------ stalls
    def inspect_stalls(self, now=None):
        """Stall warnings (texts) to log now; fails the stalls that expired."""
        now = self.clock() if now is None else now
        inspector = self.stall_inspector
        if inspector.disabled or not self._pending:
            return []
        joined = self._joined
        rows = []
        for neg in self._pending.values():
            missing = [m for m in neg.members if m not in neg.requests and m not in joined]
            rows.append((neg.name, neg.representative().op, neg.first, list(neg.requests),
                         missing))
        warnings, expired = inspector.inspect(now, rows)
        for stall in expired:
            neg = self._pending.pop(stall.name)
            text = inspector.error_text(stall, inspector.shutdown_time)
            resp = self._error_response(neg.representative(), text, pb.STALL)
            self._plans.append(Plan(resp, sorted(neg.requests)))
            self._tombstones[stall.name] = [resp, set(stall.missing)]
        if warnings:
            return [inspector.warning_text(warnings, inspector.shutdown_time)]
        return []

    # ------------------------------------------------------------ internals
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
        del self._pending[neg.name]
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.negotiate_end(neg.name)
        error, kind = self._validate(neg)
        req = neg.representative()
        if error:
            self._plans.append(Plan(self._error_response(req, error, kind),
                                    sorted(neg.requests)))
        if req.group and req.group_size > 1:
            done = self._groups.setdefault(req.group, [])
            done.append(None if error else neg)
            if len(done) < req.group_size:
                return
            del self._groups[req.group]
            for member in done:
                if member is not None:
                    self._make_ready(member)
        elif not error:
            self._make_ready(neg)

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
        fields = list(_OP_FIELDS.get(req.op, []))
        if req.group:
            fields.append(_GROUP_FIELD)
        errors = []
        for label, extract, render in fields:
            values = {r: extract(q) for r, q in reqs.items()}
            if len(set(values.values())) > 1:
                errors.append(mismatch_text(label, req.op, neg.name, values, render))
        if errors:
            return " ".join(errors), pb.MISMATCH
        return self._check_op(neg, req), pb.INVALID

    def _check_op(self, neg, req):
        members = neg.members
        if req.op == pb.BROADCAST:
            if req.root_rank not in members:
                return (f"broadcast of tensor '{neg.name}': root rank {req.root_rank} is not a "
                        f"member of process set {neg.process_set_id} ({list(members)})")
            if req.root_rank in self._joined:
                return (f"broadcast of tensor '{neg.name}': root rank {req.root_rank} has "
                        "already joined and cannot send")
        elif req.op == pb.ALLTOALL:
            for rank, q in neg.requests.items():
                if len(q.splits) != len(members):
                    return (f"alltoall of tensor '{neg.name}': rank {rank} sent "
                            f"{len(q.splits)} splits for a process set of {len(members)}")
            if any(m in self._joined for m in members):
                return (f"alltoall of tensor '{neg.name}' cannot run while "
                        f"{format_ranks([m for m in members if m in self._joined])} "
                        "have joined")
        elif req.op == pb.ADD_PROCESS_SET:
            ranks = tuple(sorted(req.ranks))
            if not ranks or len(set(ranks)) != len(ranks) or not all(
                    0 <= r < self.size for r in ranks):
                return f"add_process_set: invalid ranks {list(req.ranks)} for {self.size} ranks"
            for pid, existing in self.process_sets.items():
                if existing == ranks:
                    return (f"add_process_set: a process set with ranks {list(ranks)} "
                            f"already exists (id {pid})")
        elif req.op == pb.REMOVE_PROCESS_SET:
            if req.process_set_id == 0:
                return "remove_process_set: the global process set cannot be removed"
            if req.process_set_id not in self.process_sets:
                return f"remove_process_set: process set {req.process_set_id} is not registered"
        return ""

    def _process_set_mismatch(self, neg, rank, req, pset):
        del self._pending[neg.name]
        values = {r: neg.process_set_id for r in neg.requests}
        values[rank] = pset
        text = mismatch_text("process set", req.op, neg.name, values, str)
        told = set(values)
        others = set(neg.members) | set(self.process_sets.get(pset, ()))
        resp = self._error_response(req, text, pb.MISMATCH)
        self._plans.append(Plan(resp, sorted(told)))
        remaining = others - told
        if remaining:
            self._tombstones[neg.name] = [resp, remaining]

    def _error_response(self, req, text, kind=pb.INVALID):
        return pb.Response(op=req.op, process_set_id=req.process_set_id, names=[req.name],
                           error=text, error_kind=kind)

    def _fail(self, ranks, req, text):
        self._plans.append(Plan(self._error_response(req, text), ranks))

    def _join(self, rank, req):
        if rank not in self._joined:
            self._joined[rank] = len(self._joined)
        for neg in list(self._pending.values()):
            if self._complete(neg):
                self._finish(neg)
        if len(self._joined) == self.size:
            last = max(self._joined, key=self._joined.get)
            self._joined = {}
            self._plans.extend(self._fuse(self._ready))
            self._ready = []
            self._plans.append(Plan(pb.Response(op=pb.JOIN, names=[JOIN_NAME], value=last),
                                    range(self.size)))

    def _process_set_plan(self, neg):
        req = neg.representative()
        members = tuple(range(self.size))
        if req.op == pb.ADD_PROCESS_SET:
            pid = self._next_process_set_id
            self._next_process_set_id += 1
            ranks = tuple(sorted(req.ranks))
            self.process_sets[pid] = ranks
            resp = pb.Response(op=pb.ADD_PROCESS_SET, names=[neg.name], value=pid, ranks=ranks)
        else:
            pid = req.process_set_id
            self.process_sets.pop(pid, None)
            for other in [n for n in self._pending.values() if n.process_set_id == pid]:
                del self._pending[other.name]
                self._plans.append(Plan(self._error_response(
                    other.representative(),
                    f"process set {pid} was removed before {op_name(other.representative().op)}"
                    f" of tensor '{other.name}' could run"), sorted(other.requests)))
            resp = pb.Response(op=pb.REMOVE_PROCESS_SET, names=[neg.name], value=pid)
        return Plan(resp, members)

    # -------------------------------------------------------------- fusion
    def _fusion_key(self, req):
        op = req.op
        if op == pb.BROADCAST:
            return (op, req.process_set_id, req.root_rank, req.device)
        if op == pb.ALLGATHER:
            return (op, req.process_set_id, req.dtype, req.device)
        return (op, req.process_set_id, req.dtype, req.reduce_op, req.prescale, req.postscale,
                req.device)

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
        if req.op == pb.ALLGATHER:
            rows = sum(q.shape[0] for q in neg.requests.values())
            return row_nbytes(req) * rows
        return tensor_nbytes(req)

    def _plan(self, negs):
        req = negs[0].representative()
        members = negs[0].members
        joined = [m for m in members if m in self._joined]
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
            resp.new_cache_ids.append(self.cache.id_for(neg.representative()) if cacheable else 0)
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
                shape = list(q.shape)
                if q.op == pb.ALLGATHER and shape:
                    shape[0] = 0
                resp.specs.add(name=neg.name, dtype=q.dtype, shape=shape)
        return Plan(resp, members, sum(neg.nbytes for neg in negs), [neg.name for neg in negs])

