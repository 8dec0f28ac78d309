"""Python objects between ranks, as Horovod's broadcast_object and
allgather_object (and ChainerMN's `_obj` methods) move them.

Each operation is one allgather of bytes on the coordinator: every rank
contributes a small header and its pickle (the root alone for a broadcast),
so the exchange is negotiated like a tensor. It is named, it shows in the
timeline, and a rank that never comes, stops or dies fails it on every rank
with the job's error, where a raw MPI call would wait for good. The headers
carry what each rank asked for (the root of a broadcast), so ranks that
disagree all raise the same TensorMismatchError, naming every rank's value.

The allgather is named in the coordinator's own namespace
(`coordinator.broadcast_object.<name>`), where a program's tensors cannot
go: an allgather of a tensor named 'broadcast_object.x' in flight with
broadcast_object(name='x') used to meet it, and both failed. Errors name
the object operation ("broadcast_object 'x'"), not the allgather under it.

A default name does not depend on the object: Horovod names a broadcast
after the object's type, so the common `broadcast_object(state if rank == 0
else None)` gave the root and the others different names, and the job hung.
"""

import struct

import numpy as np

from coordinator import basics, collectives
from coordinator.errors import TensorMismatchError
from coordinator.ops_names import object_exchange_name
from coordinator.process_sets import global_process_set

import cloudpickle as _pickle  # lambdas and local classes too, as Horovod

# Per rank: the root it names (-1: none) and the length of its pickle.
_HEADER = struct.Struct("<qq")


def dumps(obj):
    return _pickle.dumps(obj)


def loads(data):
    return _pickle.loads(data)


def _exchange(kind, name, process_set, root, obj):
    """Every member's (root, payload bytes), in process-set order: one
    allgather of `header + pickle of obj` from each (an empty payload for
    `_NOTHING`), for `kind` ('broadcast_object', 'allgather_object') named
    `name`."""
    return _exchange_async(kind, name, process_set, root, obj)()


_NOTHING = object()  # (a broadcast's non-root ranks send no pickle)


def _exchange_async(kind, name, process_set, root, obj):
    """Submits the exchange; returns the function that waits for it. An
    object that cannot be pickled is this rank's refusal of the exchange:
    the others' copies fail naming it, as for a bad tensor, where they used
    to wait, and this rank's next exchange of the name met their copy of
    this one."""
    try:
        payload = b"" if obj is _NOTHING else dumps(obj)
    except Exception as exc:
        collectives.refuse("allgather", object_exchange_name(kind, name), exc, process_set)
        raise
    mine = np.frombuffer(_HEADER.pack(root, len(payload)) + payload, np.uint8)
    handle = collectives.object_exchange_async(kind, mine, name, process_set)
    return lambda: _parts(collectives.synchronize(handle))


def _parts(flat):
    raw, out, start = flat.tobytes(), [], 0
    while start < len(raw):
        their_root, length = _HEADER.unpack_from(raw, start)
        start += _HEADER.size
        out.append((their_root, raw[start:start + length]))
        start += length
    return out


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` on every rank of `process_set` (root_rank is a
    global rank, as for broadcast); the root gets its own object back."""
    name = name or "broadcast_object"
    is_root = basics.rank() == root_rank
    parts = _exchange("broadcast_object", name, process_set, int(root_rank),
                      obj if is_root else _NOTHING)
    ranks = process_set.ranks
    roots = [r for r, _ in parts]
    if len(set(roots)) > 1:
        listing = ", ".join(f"rank {g}: {r}" for g, r in zip(ranks, roots))
        raise TensorMismatchError(f"broadcast_object {name!r}: the ranks named different "
                                  f"roots ({listing})")
    if root_rank not in ranks:
        raise ValueError(f"broadcast_object {name!r}: root rank {root_rank} is not a member "
                         f"of the process set (ranks {ranks})")
    if is_root:
        return obj
    return loads(parts[ranks.index(root_rank)][1])


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every member's `obj`, in the process set's rank order."""
    return allgather_object_async(obj, name, process_set)()


def allgather_object_async(obj, name=None, process_set=global_process_set):
    """Submits allgather_object; returns the function that waits for it and
    returns its result. An operation submitted before that wait is
    negotiated with it (a frontend's shapes and their data: one round)."""
    name = name or "allgather_object"
    wait = _exchange_async("allgather_object", name, process_set, -1, obj)
    return lambda: [loads(data) for _, data in wait()]
