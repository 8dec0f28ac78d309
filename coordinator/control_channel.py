"""The control plane's transport over MPI: wire messages, and the cycle.

Messages travel on a communicator of their own (a `Dup` of the job's), so
control traffic never mixes with tensor traffic. Sends are non-blocking and
tracked until complete; receives probe without blocking, so the background
thread never sits in a busy-polling MPI wait. The channel counts what it
sends and receives, for the scale benchmark.

`Cycle` is the steady-state negotiation's one collective (see
negotiation.py): a non-blocking bitwise-AND allreduce of a small vector, on
a communicator of its own.
"""

import bisect
import struct
import time
import weakref

import numpy as np
from mpi4py import MPI

from coordinator import leftovers
from coordinator.errors import DeadlockError

TAG_START = 0x7FF1  # init's rendezvous, on the job's communicator itself
TAG_REQUEST = 1  # worker -> coordinator, any time: reports, shutdown
TAG_RESPONSE = 2  # coordinator -> worker, any time: answers, pings, shutdown
TAG_ROUND = 3  # worker -> coordinator: its RequestList for a round
TAG_ROUND_RESPONSE = 4  # coordinator -> worker: its ResponseList for a round


class ControlChannel:
    def __init__(self, comm):
        self.comm = comm
        self._sends = []  # (MPI request, payload kept alive until sent)
        self._status = MPI.Status()
        # messages and bytes: sent, received
        self.counts = {"sent": 0, "sent_bytes": 0, "received": 0, "received_bytes": 0}

    def send(self, dest, tag, payload):
        self.counts["sent"] += 1
        self.counts["sent_bytes"] += len(payload)
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
            self.counts["received"] += 1
            self.counts["received_bytes"] += len(buf)
        return out

    def barrier(self):
        """A non-blocking barrier over the control communicator (its request),
        or None once MPI is unusable."""
        try:
            return self.comm.Ibarrier()
        except MPI.Exception:  # pragma: no cover - MPI already unusable
            return None

    def cancel_sends(self):
        """Gives up on the sends under way (shutting down). MPI may still
        read their payloads, even as the process exits (Open MPI cancels
        no send): they are kept until it has (leftovers.py)."""
        if not self._sends:
            return
        for req, _ in self._sends:
            try:
                req.Cancel()
            except MPI.Exception:
                pass
        leftovers.keep(self._sends)
        self._sends = []


# One 64-bit word of the cycle, all ones.
_WORD = 2 ** 64 - 1
# The cycle's last three words: the digest, its complement, the flags inverted.
_TAIL = struct.Struct("<3Q")
# The smallest size class of the cycle's payload, in float64 words.
_PAYLOAD_CLASS_MIN = 8


def _size_classes(capacity):
    """8, 16, 32 ... words below `capacity`, then `capacity` itself."""
    sizes, size = [], _PAYLOAD_CLASS_MIN
    while size < capacity:
        sizes.append(size)
        size *= 2
    return sizes + [capacity] if capacity else []


def _persistent(comm, send, recv, op):
    """A persistent allreduce (MPI-4's MPI_Allreduce_init), or None where the
    library has none."""
    try:
        return comm.Allreduce_init(send, recv, op)
    except (NotImplementedError, AttributeError):
        return None
    except MPI.Exception as exc:
        if exc.Get_error_class() in (MPI.ERR_UNSUPPORTED_OPERATION, MPI.ERR_OTHER):
            return None
        raise


def _start(persistent, comm, send, recv, op):
    """Starts `persistent`, or posts the same allreduce afresh without one."""
    if persistent is None:
        return comm.Iallreduce(send, recv, op)
    persistent.Start()
    return persistent


class Cycle:
    """One rank's side of the negotiation cycle: a non-blocking allreduce
    (bitwise AND) of `bits` (one per cache slot) and of their complement,
    of a digest and its complement (both survive the AND only where every
    rank sent the same digest), and of a word of flags stored inverted, so
    that every rank learns the slots set everywhere, whether some slot is
    set somewhere but not everywhere, whether the digests agree, and the
    flags set anywhere.

    Beside it, on a communicator of its own, an optional *payload*: a sum
    allreduce of float64 words that carries tiny tensors' data in the same
    round trip (negotiation.py, riders). Its sums mean something only for
    the slots set everywhere; the caller uses them for those alone. Its
    size follows the riders in use, rounded up to a size class (8, 16, 32
    ... words, then `payload_capacity`).

    Both are MPI-4 persistent collectives where the library has them,
    created once here (by every rank, in the same order) and restarted by
    each cycle: a start costs 0.3-0.5 us where a fresh Iallreduce cost
    1.9-3.3 us, and a one-float round trip 2.3 us instead of 5.4 (np=2,
    Open MPI 5.0.11, whose persistent collectives build their schedule
    locally). Elsewhere (an MPI-3 library) each cycle posts Iallreduces."""

    def __init__(self, comm, slots, payload_comm=None, payload_capacity=0):
        self.comm = comm
        self.payload_comm = payload_comm
        words = (slots + 63) // 64
        self._words = words
        self._mask = (1 << (64 * words)) - 1
        self.bits = 0  # this rank's, one per slot, kept up to date
        self._send = np.zeros(2 * words + 3, np.uint64)
        self._recv = np.zeros(2 * words + 3, np.uint64)
        self._send_bytes = memoryview(self._send).cast("B")
        self._recv_bytes = memoryview(self._recv).cast("B")
        self._bits_request = _persistent(comm, self._send, self._recv, MPI.BAND)
        capacity = payload_capacity if payload_comm is not None else 0
        self._payload_send = np.zeros(capacity, np.float64)
        self._payload_recv = np.zeros(capacity, np.float64)
        self._classes = _size_classes(capacity)
        self._payload_requests = {
            size: _persistent(payload_comm, self._payload_send[:size],
                              self._payload_recv[:size], MPI.SUM)
            for size in self._classes}
        self._payload_words = 0
        self._digest = 0
        self._request = None
        self._payload_request = None
        self._result = None  # the bits' outcome, while the payload is in flight
        self.moved = False
        self.posted_at = None
        self.cycles = 0
        self.bytes = 0

    @property
    def in_flight(self):
        return self._request is not None or self._payload_request is not None

    def close(self):
        """Frees the persistent requests. A cycle still in flight (a rank
        that stopped waiting for it) is left to MPI, which may complete it
        as late as in MPI_Finalize: its requests and buffers are kept until
        the process ends (leftovers.py)."""
        if self.in_flight:
            leftovers.keep(self)
            return
        requests = [self._bits_request, *self._payload_requests.values()]
        self._bits_request, self._payload_requests = None, {}
        for request in requests:
            if request is not None:
                try:
                    request.Free()
                except MPI.Exception:  # the communicator was revoked
                    pass

    def set(self, slot):
        self.bits |= 1 << slot

    def clear(self, slot):
        self.bits &= ~(1 << slot)

    def payload_out(self, words):
        """The zeroed send buffer of the next cycle's payload (`words` float64
        words, at most `payload_capacity`; 0: no payload): the caller fills
        it before `post`."""
        if words > len(self._payload_send):
            raise ValueError(f"a cycle payload of {words} words exceeds its capacity of "
                             f"{len(self._payload_send)}")
        self._payload_words = words
        self._payload_send[:self._class_of(words)].fill(0.0)
        return self._payload_send[:words]

    def _class_of(self, words):
        """The size class `words` (at most the capacity) travel in (0 for none)."""
        return self._classes[bisect.bisect_left(self._classes, words)] if words else 0

    @property
    def payload(self):
        """The last completed cycle's payload sums."""
        return self._payload_recv[:self._payload_words]

    def post(self, flags, now, digest=0):
        # Little-endian words: bit k of the int is bit k % 64 of word k // 64.
        n, mask = 8 * self._words, self._mask
        out = self._send_bytes
        out[:n] = self.bits.to_bytes(n, "little")
        out[n:2 * n] = (~self.bits & mask).to_bytes(n, "little")
        out[2 * n:] = _TAIL.pack(digest & _WORD, ~digest & _WORD, ~flags & _WORD)
        self._digest = digest
        self._result = None
        self._request = _start(self._bits_request, self.comm, self._send, self._recv, MPI.BAND)
        self.bytes += self._send.nbytes
        if self._payload_words:
            size = self._class_of(self._payload_words)
            self._payload_request = _start(
                self._payload_requests.get(size), self.payload_comm,
                self._payload_send[:size], self._payload_recv[:size], MPI.SUM)
            self.bytes += 8 * size
        self.posted_at = now

    def test(self):
        """None while in flight; then (slots set on every rank, flags set on
        any rank, whether every rank posted the same digest, whether some
        slot was set on some ranks only). Ranks whose digests disagree are
        told at once, without waiting for the payload. `moved` says whether
        this call completed the bits (the payload may still be in flight)."""
        self.moved = False
        if self._request is not None:
            if not self._request.Test():
                return None
            self._request = None
            self._result = self._outcome()
            self.moved = True
        if self._payload_request is not None and self._result[2]:
            if not self._payload_request.Test():
                return None
            self._payload_request = None
        result, self._result = self._result, None
        self.posted_at = None
        self.cycles += 1
        return result

    def _outcome(self):
        words = self._words
        raw = self._recv_bytes
        everywhere = int.from_bytes(raw[:8 * words], "little")
        # ~AND(~bits) is the OR: set somewhere. Somewhere but not everywhere:
        # some rank waits for the others to submit.
        somewhere = ~int.from_bytes(raw[8 * words:16 * words], "little") & self._mask
        partial = bool(somewhere & ~everywhere)
        digest = int.from_bytes(raw[16 * words:16 * words + 8], "little")
        complement = int.from_bytes(raw[16 * words + 8:16 * words + 16], "little")
        mine = self._digest & _WORD
        agree = digest == mine and ~complement & _WORD == mine
        flags = ~int.from_bytes(raw[-8:], "little") & _WORD
        return _set_bits(everywhere), flags, agree, partial


def _set_bits(value):
    """The positions of the set bits of a non-negative int, ascending."""
    if value.bit_count() > 32:  # many: one NumPy pass beats a Python loop
        data = np.frombuffer(value.to_bytes((value.bit_length() + 7) // 8, "little"),
                             np.uint8)
        return np.flatnonzero(np.unpackbits(data, bitorder="little")).tolist()
    found = []
    while value:
        low = value & -value
        found.append(low.bit_length() - 1)
        value ^= low
    return found


_PEER_FAILURES = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}


def peer_failure(exc, comm=None, known_dead=None, wait=1.0):
    """A sentence about the failed peers when `exc` is MPI reporting one
    (ULFM: a process failed, or a communicator was revoked), else None.

    The failed ranks are those `comm` knows of (ULFM's Get_failed), and
    `known_dead()`'s (ranks the job's liveness watch found dead). A rank
    whose operation failed because another survivor's did may know of no
    failed process yet; then both are asked again for up to `wait` seconds,
    so that it names the rank that died too, not "a peer"."""
    if not isinstance(exc, MPI.Exception) or exc.Get_error_class() not in _PEER_FAILURES:
        return None
    deadline = time.monotonic() + wait
    while True:
        failed = set(_failed_in(comm))
        if known_dead is not None:
            failed.update(known_dead())
        if failed or known_dead is None or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    who = (f"rank{'s' if len(failed) > 1 else ''} " + ", ".join(map(str, sorted(failed)))
           if failed else "a peer")
    return f"{who} failed or left the job (MPI: {exc.Get_error_string()})"


def _failed_in(comm):
    """The ranks of `comm` its ULFM knows to have failed ([] where it cannot say)."""
    if comm is None:
        return []
    try:
        group = comm.Get_failed()
        return group.Translate_ranks(list(range(group.Get_size())), comm.Get_group())
    except MPI.Exception:
        return []


def revoke(comms):
    """Revokes communicators (ULFM) so that peers still waiting on them are
    released with an error; quiet where ULFM is unavailable."""
    for comm in comms:
        try:
            comm.Revoke()
        except (MPI.Exception, NotImplementedError, AttributeError):
            pass


# The program's own communicators, as weak references: ChainerMN
# communicators' `mpi_comm` and the ones they were made from, and process
# sets made from communicators (with the job's own communicator, the one
# init() was given or MPI.COMM_WORLD, they are what Transport.release
# revokes).
_program_comms = []


# Open MPI numbers every communicator a process holds from 0 in a table of
# its own, and MPI_Comm_f2c maps a number back (freed ones leave holes that
# new ones fill, lowest first). _held_comms stops after this many unused
# numbers in a row.
_HELD_GAP = 1024


def _held_comms(within):
    """Every intracommunicator of more than one rank that this process
    holds over ranks of the communicator `within` only, where MPI can list
    them: Open MPI's (through Fortran handles, above); elsewhere none.
    Communicators the program made itself and told nobody of
    (`MPI.COMM_WORLD.Split(...)`) are among them."""
    if not MPI.Get_library_version().startswith("Open MPI"):
        return []
    held, number, missed = [], 0, 0
    while missed < _HELD_GAP:
        try:
            comm = MPI.Comm.f2py(number)
        except MPI.Exception:  # MPI_ERR_COMM: a hole, or past the end
            comm = None
        number += 1
        if comm is None or comm == MPI.COMM_NULL:
            missed += 1
            continue
        missed = 0
        if not comm.Is_inter() and comm.Get_size() > 1:
            outside = MPI.Group.Difference(comm.Get_group(), within.Get_group())
            if outside.Get_size() == 0:
                held.append(comm)
    return held


def note_program_comm(comm):
    """Notes `comm`, a communicator the program may call MPI on itself, for
    Transport.release."""
    if comm is None or not hasattr(comm, "Revoke"):
        return
    _program_comms[:] = [ref for ref in _program_comms if ref() is not None]
    if not any(ref() is comm for ref in _program_comms):
        _program_comms.append(weakref.ref(comm))


class Transport:
    """The job as the control plane sees it: which ranks there are, a private
    channel for wire messages, and the few blocking exchanges of `init`.

    The MPI backend gets `data_world()`, a communicator of its own for
    tensor bytes; nothing else in the core touches MPI."""

    def __init__(self, comm=None, start_timeout=None):
        self.base = _base_comm(comm)
        self.rank = self.base.rank
        self.size = self.base.size
        rendezvous(self.base, start_timeout)
        self.channel = ControlChannel(self.base.Dup())
        self.made = [self.channel.comm]  # communicators made here, to revoke

    def allgather(self, value):
        """Every rank's `value` (a picklable object), indexed by rank. Blocks:
        for `init` only, where every rank takes part."""
        return self.base.allgather(value)

    def data_world(self):
        """A new communicator over the job's ranks, for a data backend."""
        comm = self.base.Dup()
        self.made.append(comm)
        return comm

    def cycle(self, slots, payload_capacity=0):
        """The negotiation cycle, on a communicator of its own (and its
        payload, of up to `payload_capacity` float64 words, on another)."""
        comm, payload = self.base.Dup(), self.base.Dup()
        self.made += [comm, payload]
        return Cycle(comm, slots, payload, payload_capacity)

    def revoke(self):
        """After a peer died: releases everyone still waiting on this job's
        communicators (elastic training re-forms the job afterwards)."""
        revoke(self.made)

    def release(self):
        """A rank stopped answering, so the job cannot go on: revokes the
        program's own communicators, so that its MPI calls waiting in them,
        which that rank would never finish, raise MPI_ERR_REVOKED (where MPI
        is fault tolerant: runtime.fault_tolerant) instead of waiting for
        good. They are the job's, note_program_comm's, and every other one
        over the job's ranks that this process holds (_held_comms), but the
        control plane's own (`made`: the shutdown notices may still be on
        their way there).
        Returns their names (MPI's, else how many ranks they hold)."""
        comms = [self.base]
        noted = [ref() for ref in _program_comms]
        for comm in noted + _held_comms(self.base):
            if (comm is not None and comm != MPI.COMM_NULL
                    and not any(comm == c for c in comms + self.made)):
                comms.append(comm)
        revoke(comms)
        return [comm.Get_name() or f"a communicator of {comm.Get_size()} ranks" for comm in comms]

    def ranks_of(self, comm):
        """The job's ranks that a user's communicator holds, sorted."""
        group = comm.Get_group()
        return sorted(group.Translate_ranks(list(range(group.Get_size())),
                                            self.base.Get_group()))

    @staticmethod
    def threads_supported():
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def rendezvous(comm, timeout, poll=0.01):
    """Returns once every rank of `comm` has come here (init), or raises
    DeadlockError on each rank that did, naming those that did not, within
    about `timeout` seconds (None or 0: waits as MPI's collectives do).

    init's first collective waited for ever for a rank that never called
    init (it left without, it initialised on another communicator, or it
    alone called init again after a shutdown): each rank now tells rank 0
    it is here, and rank 0 tells each what it found, by point-to-point
    messages that the waiting ranks poll, so nobody blocks in MPI."""
    if not timeout or comm.size == 1:
        return
    deadline = time.monotonic() + timeout
    size = comm.size
    if comm.rank == 0:
        bufs = {r: np.zeros(1, np.int64) for r in range(1, size)}
        reqs = {r: comm.Irecv(bufs[r], source=r, tag=TAG_START) for r in bufs}
        while reqs and time.monotonic() < deadline:
            reqs = {r: q for r, q in reqs.items() if not q.Test()}
            if reqs:
                time.sleep(poll)
        missing = sorted(reqs)
        for req in reqs.values():
            req.Cancel()
            req.Wait()
        verdict = np.zeros(size + 1, np.int64)
        verdict[0] = len(missing)
        verdict[1:1 + len(missing)] = missing
        sends = [comm.Isend(verdict, dest=r, tag=TAG_START)
                 for r in range(1, size) if r not in reqs]
        MPI.Request.Waitall(sends)
    else:
        comm.Isend(np.ones(1, np.int64), dest=0, tag=TAG_START).Wait()  # (small: eager)
        verdict = np.zeros(size + 1, np.int64)
        req = comm.Irecv(verdict, source=0, tag=TAG_START)
        # Rank 0 may come up to `timeout` after this rank and then wait as
        # long for the others.
        deadline += timeout + 5.0
        while not req.Test():
            if time.monotonic() >= deadline:
                req.Cancel()
                req.Wait()
                missing = [0]
                break
            time.sleep(poll)
        else:
            missing = [int(r) for r in verdict[1:1 + verdict[0]]]
    if missing:
        ranks = ", ".join(map(str, missing))
        raise DeadlockError(
            f"init(): rank{'s' if len(missing) > 1 else ''} {ranks} of {size} did not call "
            f"init() within {timeout:g} s (COORDINATOR_DEADLOCK_SECONDS), so the coordinator "
            "cannot start: every rank of the job calls init(), on the same communicator")


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
