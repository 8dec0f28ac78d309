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
