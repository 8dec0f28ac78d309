"""The control plane's transport: serialized wire messages over MPI.

Messages travel on a communicator of their own (a `Dup` of the job's), so
control traffic never mixes with tensor traffic. Sends are non-blocking and
tracked until complete; receives probe without blocking, so the background
thread never sits in a busy-polling MPI wait.
"""

from mpi4py import MPI

TAG_REQUEST = 1  # worker -> coordinator: RequestList
TAG_RESPONSE = 2  # coordinator -> worker: ResponseList


class ControlChannel:
    def __init__(self, comm):
        self.comm = comm
        self._sends = []  # (MPI request, payload kept alive until sent)
        self._status = MPI.Status()

    def send(self, dest, tag, payload):
        req = self.comm.Isend([payload, MPI.BYTE], dest, tag)
        if not req.Test():
            self._sends.append((req, payload))

    def progress(self):
        """Retire completed sends; True while some are still under way."""
        if self._sends:
            self._sends = [item for item in self._sends if not item[0].Test()]
        return bool(self._sends)

    def receive(self, tag):
        """Every message with `tag` that has arrived: a list of (source, bytes)."""
        out = []
        comm, status = self.comm, self._status
        while comm.Iprobe(MPI.ANY_SOURCE, tag, status):
            source = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            comm.Recv([buf, MPI.BYTE], source, tag)
            out.append((source, bytes(buf)))
        return out

    def barrier(self):
        """A non-blocking barrier over the control communicator (its request),
        or None once MPI is unusable."""
        try:
            return self.comm.Ibarrier()
        except MPI.Exception:  # pragma: no cover - MPI already unusable
            return None

    def cancel_sends(self):
        for req, _ in self._sends:
            try:
                req.Cancel()
                req.Free()
            except MPI.Exception:
                pass
        self._sends = []


class Transport:
    """The job as the control plane sees it: which ranks there are, a private
    channel for wire messages, and the few blocking exchanges of `init`.

    The MPI backend gets `data_world()`, a communicator of its own for
    tensor bytes; nothing else in the core touches MPI."""

    def __init__(self, comm=None):
        self.base = _base_comm(comm)
        self.rank = self.base.rank
        self.size = self.base.size
        self.channel = ControlChannel(self.base.Dup())

    def allgather(self, value):
        """Every rank's `value` (a picklable object), indexed by rank. Blocks:
        for `init` only, where every rank takes part."""
        return self.base.allgather(value)

    def data_world(self):
        """A new communicator over the job's ranks, for a data backend."""
        return self.base.Dup()

    def ranks_of(self, comm):
        """The job's ranks that a user's communicator holds, sorted."""
        group = comm.Get_group()
        return sorted(group.Translate_ranks(list(range(group.Get_size())),
                                            self.base.Get_group()))

    @staticmethod
    def threads_supported():
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _base_comm(comm):
    """The job's communicator: COMM_WORLD, a communicator the user passed, or
    the ranks of COMM_WORLD the user listed."""
    if comm is None:
        return MPI.COMM_WORLD
    if hasattr(comm, "Get_group"):
        return comm
    ranks = sorted(int(r) for r in comm)
    world = MPI.COMM_WORLD
    if world.rank not in ranks:
        raise ValueError(f"init(comm={ranks}): this process (rank {world.rank}) is not in "
                         "the list")
    return world.Create_group(world.Get_group().Incl(ranks))
