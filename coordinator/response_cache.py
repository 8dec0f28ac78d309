"""The response cache: lets steady-state training skip describing tensors.

The coordinator gives each negotiated tensor description a cache id. A rank
that submits the same name with the same description again sends only that id,
and when every rank did so the coordinator answers with the id alone: no names,
shapes or dtypes cross the wire and nothing needs validating.

Ids are never reused. When the coordinator drops an entry (least recently
used, past `capacity`) it tells every rank; a rank that used a dropped id
before hearing of it is asked to send that request in full (`resend`).
"""

import collections
import math


NAN_KEY = ("nan",)


def float_key(value):
    """A float as a comparable key: NaN equals NaN (as a scale factor, NaN on
    every rank is agreement, not a mismatch)."""
    return NAN_KEY if math.isnan(value) else value


def request_signature(op, dtype, shape, reduce_op, root_rank, prescale, postscale,
                      process_set_id, device, group, group_size):
    """Everything about a request that must match for the cache to apply.
    The device counts as CPU or GPU: ranks hold a tensor on their own GPUs."""
    return (op, dtype, tuple(shape), reduce_op, root_rank, float_key(prescale),
            float_key(postscale), process_set_id, device >= 0, group, group_size)


def signature_of(req):
    """The signature of a wire Request."""
    return request_signature(req.op, req.dtype, req.shape, req.reduce_op, req.root_rank,
                             req.prescale, req.postscale, req.process_set_id, req.device,
                             req.group, req.group_size)


DROPPED_KEYS = 4096


class CoordinatorCache:
    """Rank 0's table: cache id -> the request it stands for."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._by_id = collections.OrderedDict()  # id -> (signature, template Request)
        self._by_name = {}  # (process set, name) -> id
        self._next_id = 1
        self._evicted = []  # ids dropped, in order; ranks hear of them by sequence
        self._evicted_base = 0  # sequence number of _evicted[0]
        # id -> (process set, name) of the last DROPPED_KEYS ids dropped: a
        # rank that sends one before it hears is asked for its request in
        # full, and rank 0 knows which tensor it waits for (dropped_key).
        self._dropped = collections.OrderedDict()

    @property
    def enabled(self):
        return self.capacity > 0

    def __len__(self):
        return len(self._by_id)

    def get(self, cache_id):
        """The template request of a live id (and marks it used), else None."""
        item = self._by_id.get(cache_id)
        if item is None:
            return None
        self._by_id.move_to_end(cache_id)
        return item[1]

    def id_for(self, process_set_id, req):
        """The id under which `req` (negotiated in `process_set_id`) is cached,
        assigning one if needed."""
        if not self.enabled:
            return 0
        sig = signature_of(req)
        key = (process_set_id, req.name)
        cache_id = self._by_name.get(key)
        if cache_id is not None:
            item = self._by_id[cache_id]
            if item[0] == sig:
                self._by_id.move_to_end(cache_id)
                return cache_id
            self._drop(cache_id)
        cache_id = self._next_id
        self._next_id += 1
        template = type(req)()
        template.CopyFrom(req)
        template.submit_time = 0.0
        self._by_id[cache_id] = (sig, template, key)
        self._by_name[key] = cache_id
        while len(self._by_id) > self.capacity:
            self._drop(next(iter(self._by_id)))
        return cache_id

    def holds(self, process_set_id, name):
        """Whether a tensor of that name is cached, under whatever
        description (without assigning an id or marking it used)."""
        return (process_set_id, name) in self._by_name

    def _drop(self, cache_id):
        _, _, key = self._by_id.pop(cache_id)
        if self._by_name.get(key) == cache_id:
            del self._by_name[key]
        self._evicted.append(cache_id)
        self._dropped[cache_id] = key
        while len(self._dropped) > DROPPED_KEYS:
            self._dropped.popitem(last=False)

    def dropped_key(self, cache_id):
        """(process set, name) of a recently dropped id, or None."""
        return self._dropped.get(cache_id)

    def evictions_since(self, seq):
        """(ids dropped since sequence number `seq`, the new sequence number)."""
        end = self._evicted_base + len(self._evicted)
        start = max(seq, self._evicted_base)
        return self._evicted[start - self._evicted_base:], end

    def trim_evictions(self, seq):
        """Forget evictions every rank has been told of (all before `seq`)."""
        drop = seq - self._evicted_base
        if drop > 0:
            del self._evicted[:drop]
            self._evicted_base = seq


class WorkerCache:
    """A rank's view: (process set, name) -> (signature, cache id)."""

    def __init__(self):
        self._by_name = {}
        self._by_id = {}

    def lookup(self, name, sig):
        item = self._by_name.get(name)
        if item is not None and item[0] == sig:
            return item[1]
        return 0

    def store(self, name, sig, cache_id):
        old = self._by_name.get(name)
        if old is not None:
            self._by_id.pop(old[1], None)
        self._by_name[name] = (sig, cache_id)
        self._by_id[cache_id] = name

    def evict(self, cache_id):
        name = self._by_id.pop(cache_id, None)
        if name is not None and self._by_name.get(name, (None, None))[1] == cache_id:
            del self._by_name[name]

    def __len__(self):
        return len(self._by_name)
