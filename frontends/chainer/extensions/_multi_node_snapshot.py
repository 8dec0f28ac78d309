"""multi_node_snapshot: Chainer's snapshot extension across ranks, with
replica sets.

Ranks are grouped into replica sets: within a set every rank holds the same
state (e.g. rank 0, which alone has LogReport and PrintReport, is a set of
its own; the other ranks are another). The lowest rank of each set, its
master, writes the snapshots, with its rank appended to the file name; on
`initialize` with autoload, each master loads its newest snapshot and sends
the loaded state to the other ranks of its set.

Unlike ChainerMN, the ranks agree before anyone waits: every rank takes part
in one allgather (through the coordinator) saying whether its master
loaded, which snapshot, or failed, and then every rank decides the same
thing. A master that fails to load raises its error, and every other rank
raises an error naming it, where ChainerMN left the rest of the set waiting
for a message that never came. Masters that resume from different snapshots
(e.g. one set kept a newer one than another) raise on every rank instead of
resuming the sets at different iterations. The state goes to the set
through the coordinator's send/recv.
"""

import io
import json

import numpy as np

from chainer.serializers import load_npz, save_npz
from chainer.training.extension import Extension
from chainer.training.extensions._snapshot import _find_latest_snapshot
from frontends.chainer._checks import InvalidArgument

# The tag of the state a master sends to its set (apart from the users' tags).
_TAG = "multi_node_snapshot"


def multi_node_snapshot(comm, snapshot, replica_sets):
    """A trainer extension that saves `snapshot` (from
    chainer.training.extensions.snapshot()) on each replica set's master.

    Args:
        comm: the ChainerMN communicator.
        snapshot: the snapshot extension to wrap; its file name gets
            '.<rank>' appended.
        replica_sets: a list of replica sets, each a rank or an iterable of
            ranks; the ranks left out form one more set. With [0] and 4
            ranks the sets are {0} and {1, 2, 3}; with [] every rank is in
            one set.
    """
    return _MultiNodeSnapshot(comm, snapshot, replica_sets)


def _parse_replica_sets(replica_sets, size):
    """The replica sets as a list of sets of ranks, the ranks not named
    forming one more set at the end. Raises InvalidArgument (a ValueError)
    for ranks out of range or named twice."""
    sets = []
    for replica_set in replica_sets:
        ranks = {replica_set} if isinstance(replica_set, int) else set(replica_set)
        bad = sorted(r for r in ranks if not 0 <= r < size)
        if bad:
            raise InvalidArgument(f"multi_node_snapshot: replica set {sorted(ranks)} names "
                                  f"ranks {bad}, outside 0..{size - 1}")
        sets.append(ranks)
    named = [r for s in sets for r in s]
    twice = sorted({r for r in named if named.count(r) > 1})
    if twice:
        raise InvalidArgument(f"multi_node_snapshot: ranks {twice} are in more than one "
                              "replica set")
    rest = set(range(size)) - set(named)
    if rest:
        sets.append(rest)
    return sets


def _with_rank(filename, rank):
    if callable(filename):
        def with_rank(trainer):
            return f"{filename(trainer)}.{rank}"
        return with_rank
    return f"{filename}.{rank}"


class _MultiNodeSnapshot(Extension):
    def __init__(self, comm, snapshot, replica_sets):
        if comm is None or snapshot is None:
            raise InvalidArgument("multi_node_snapshot needs a communicator and a snapshot "
                                  "extension")
        self.comm = comm
        self.snapshot = snapshot
        snapshot.filename = _with_rank(snapshot.filename, comm.rank)
        self.sets = _parse_replica_sets(replica_sets, comm.size)
        self.replica_set = next(s for s in self.sets if comm.rank in s)
        self.master = min(self.replica_set)

    @property
    def is_master(self):
        return self.master == self.comm.rank

    # Every rank of the communicator calls initialize (Trainer.run does).
    def initialize(self, trainer):
        status, failure = {"error": None, "loaded": None}, None
        if self.is_master:
            try:
                self.snapshot.initialize(trainer)
                if self.snapshot.autoload:
                    status["loaded"] = self._loaded_name(trainer)
            except Exception as exc:
                failure = exc
                status["error"] = f"{type(exc).__name__}: {exc}"
        if not self.snapshot.autoload:
            if failure is not None:
                raise failure
            return
        statuses = self._allgather(status)
        if failure is not None:
            raise failure
        self._check_agreement(statuses)
        if statuses[self.master]["loaded"] is not None:
            self._share_state(trainer)

    def _loaded_name(self, trainer):
        """The snapshot the wrapped extension just loaded, without the
        rank suffix (None if there was none)."""
        found = _find_latest_snapshot(self.snapshot.filename, trainer.out)
        suffix = f".{self.comm.rank}"
        if found is not None and found.endswith(suffix):
            found = found[:-len(suffix)]
        return found

    def _allgather(self, status):
        raw = np.frombuffer(json.dumps(status).encode(), np.uint8)
        return [json.loads(bytes(a).decode()) for a in self.comm.allgather(raw)]

    def _check_agreement(self, statuses):
        """Raises the same error on every rank (but a failed master, which
        raises its own) when a master failed or the masters found different
        snapshots."""
        masters = sorted(min(s) for s in self.sets)
        failed = [m for m in masters if statuses[m]["error"] is not None]
        if failed:
            listing = "; ".join(f"rank {m}: {statuses[m]['error']}" for m in failed)
            raise RuntimeError(f"multi_node_snapshot: loading the snapshot failed on master "
                               f"rank(s) {failed} ({listing}); no rank resumes")
        loaded = {m: statuses[m]["loaded"] for m in masters}
        if len(set(loaded.values())) > 1:
            listing = ", ".join(f"rank {m}: {name or 'none'}" for m, name in loaded.items())
            raise RuntimeError(f"multi_node_snapshot: the replica sets' masters found different "
                               f"snapshots to resume from ({listing}); resuming them would "
                               "put the sets at different iterations")

    def _share_state(self, trainer):
        """The master sends the state it loaded to the rest of its set."""
        target = trainer if self.snapshot._target is None else self.snapshot._target
        if self.is_master:
            buf = io.BytesIO()
            save_npz(buf, target)
            data = np.frombuffer(buf.getvalue(), np.uint8)
            for rank in sorted(self.replica_set - {self.comm.rank}):
                self.comm.send(data, rank, _TAG)
        else:
            data = self.comm.recv(self.master, _TAG)
            load_npz(io.BytesIO(data.tobytes()), target)

    def on_error(self, trainer, exc, tb):
        if self.is_master:
            self.snapshot.on_error(trainer, exc, tb)

    def __call__(self, trainer):
        if self.is_master:
            self.snapshot(trainer)

    def finalize(self):
        if self.is_master:
            self.snapshot.finalize()
