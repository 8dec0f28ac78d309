"""Process sets: collectives among a subset of the ranks.

A `ProcessSet` names the global ranks it holds. Once registered (at `init`, or
with `add_process_set`, which every rank calls) it has an id; the backends
make its communicators on its members when it is first used. The global set,
id 0, holds every rank.
"""

import threading


class ProcessSet:
    """A set of global ranks that collectives can be restricted to."""

    def __init__(self, ranks_or_comm=None):
        self.process_set_id = None
        self.mpi_comm = None
        self._ranks = None
        self._my_rank = None
        self._released = False  # registered once, then the coordinator shut down
        self._stand_in = False  # made by the table for a set nobody named here
        if ranks_or_comm is None:
            return
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
            return
        ranks = [int(r) for r in ranks_or_comm]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks contain duplicates: {ranks}")
        self._ranks = sorted(ranks)

    @property
    def ranks(self):
        return list(self._ranks) if self._ranks is not None else None

    def _bind(self, process_set_id, ranks, my_global_rank):
        self.process_set_id = process_set_id
        self._released = False
        self._ranks = sorted(ranks)
        self._my_rank = (self._ranks.index(my_global_rank)
                         if my_global_rank in self._ranks else None)

    def _unbind(self):
        self.process_set_id = None
        self._my_rank = None

    def size(self):
        """Number of ranks in the set (None until it is registered). As in
        Horovod, ValueError for an id the running coordinator does not hold
        for this set."""
        if self.process_set_id is None:
            return None
        if self.process_set_id:
            from coordinator import runtime

            rt = runtime.current()
            if rt is not None and not rt.process_sets.holds(self):
                raise ValueError(f"process set {self.process_set_id} does not exist or has not "
                                 "been registered")
        return len(self._ranks)

    def rank(self):
        """This process's rank within the set (None until it is registered)."""
        if self.process_set_id is None:
            return None
        if self._my_rank is None:
            raise ValueError(f"this process is not a member of {self!r}")
        return self._my_rank

    def included(self):
        """Whether this process belongs to the set (None while its ranks are
        unknown)."""
        if self._ranks is None:
            return None
        if self.process_set_id is None:
            from coordinator import runtime

            rt = runtime.current()
            return None if rt is None else rt.rank in self._ranks
        return self._my_rank is not None

    def __repr__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self._ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__


global_process_set = ProcessSet()


class ProcessSetTable:
    """The registered sets of this process. Each id has one ProcessSet it
    was registered with, and may have more bound to it: as in Horovod, a
    later init() that names a registered set binds the object it was given
    to that set's id."""

    def __init__(self, my_rank):
        self.my_rank = my_rank
        self._lock = threading.Lock()
        self._sets = {}  # id -> ProcessSet
        self._aliases = {}  # id -> [ProcessSet bound to it besides _sets[id]]

    def register(self, process_set, process_set_id, ranks):
        with self._lock:
            process_set._bind(process_set_id, ranks, self.my_rank)
            self._sets[process_set_id] = process_set

    def bind(self, process_set, process_set_id):
        """Binds one more ProcessSet to a registered id (it takes the place
        of one the table made itself, see `stand_in`)."""
        with self._lock:
            first = self._sets[process_set_id]
            process_set._bind(process_set_id, first._ranks, self.my_rank)
            if first is process_set:
                return
            if first._stand_in:
                self._sets[process_set_id] = process_set
                first._unbind()
                return
            aliases = self._aliases.setdefault(process_set_id, [])
            if not any(a is process_set for a in aliases):
                aliases.append(process_set)

    @staticmethod
    def stand_in(ranks):
        """A ProcessSet for a set no object of the caller's names yet (on
        this rank): `bind` puts the caller's in its place."""
        ps = ProcessSet(ranks)
        ps._stand_in = True
        return ps

    def unregister(self, process_set_id):
        with self._lock:
            ps = self._sets.pop(process_set_id, None)
            aliases = self._aliases.pop(process_set_id, [])
        for other in aliases:
            other._unbind()
        if ps is not None and ps is not global_process_set:
            ps._unbind()
        return ps

    def get(self, process_set_id):
        return self._sets.get(process_set_id)

    def holds(self, process_set):
        """Whether `process_set` is bound to one of this table's ids."""
        pid = process_set.process_set_id
        with self._lock:
            return (self._sets.get(pid) is process_set
                    or any(a is process_set for a in self._aliases.get(pid, ())))

    def id_of(self, ranks):
        ranks = sorted(ranks)
        with self._lock:
            for pid, ps in self._sets.items():
                if ps._ranks == ranks:
                    return pid
        return None

    def members(self, process_set_id):
        ps = self._sets.get(process_set_id)
        return ps._ranks if ps is not None else None

    def all(self):
        with self._lock:
            return dict(self._sets)

    def release(self):
        """At shutdown: the sets of this process no longer name anything,
        so a `ProcessSet` kept by the caller can be registered again (after
        init(), for example as an elastic job re-forms) and, until then,
        says that it was released rather than showing a stale id. The table
        itself stays as it was, for a background thread still running."""
        with self._lock:
            sets = list(self._sets.values())
            sets += [a for aliases in self._aliases.values() for a in aliases]
        for ps in sets:
            if ps is not global_process_set:
                ps._unbind()
                ps._released = True
