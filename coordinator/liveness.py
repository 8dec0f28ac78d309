"""Noticing that a peer process died, without asking MPI.

An MPI job whose rank dies leaves the others blocked in collectives that can
never finish. Every rank publishes (host identity, pid, hostname) at `init`.

- Peers on the same machine: this rank opens a pidfd for each, which becomes
  readable the moment that process exits. Checking costs one `poll` system
  call, so the background thread and any waiting frontend thread can afford
  it often.
- Peers on other machines (given `comm`): pids mean nothing there, so they
  are watched over the network (network_watch.py): each rank holds an idle
  TCP connection to a rank of every other host, which closes when that rank
  dies and fails when its host goes silent, and the error names the host.

A rank that fails leaves its reason with the peers on its machine before it
exits (`tell_local`, a datagram to each one's abstract Unix socket), so that
they name the root cause ("rank 1 ..., which had failed: host hostb stopped
answering") rather than only the rank that exited first.
"""

import collections
import os
import select
import signal
import socket
import threading

# A dead peer: `how` says how it was noticed, where that helps ("" for a
# pidfd: the process exited).
Dead = collections.namedtuple("Dead", "rank pid host how")


def host_identity():
    """Identifies this machine and PID namespace: pids are comparable only
    between processes that share both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}:{ns}"


def process_start(pid):
    """When process `pid` started, in clock ticks after boot (the 22nd field
    of /proc/<pid>/stat), or None where there is no such process (or no
    /proc). With the pid it names one process: a pid alone may be reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def end_process(identity, pid, start):
    """SIGKILLs the process named by the machine and PID namespace
    `identity` (host_identity()), `pid` and its start time, if it runs here
    and is still that process (never this one). Returns whether the signal
    went. Through a pidfd where there is one, so the pid cannot be reused
    between the check and the signal."""
    if identity != host_identity() or pid == os.getpid() or start is None:
        return False
    fd = None
    try:
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            fd = os.pidfd_open(pid)
        if process_start(pid) != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except OSError:  # gone already, or not ours to end
        return False
    finally:
        if fd is not None:
            os.close(fd)


class PeerMonitor:
    def __init__(self, my_rank, peers, comm=None):
        """`peers`: one (identity, pid, hostname) per rank, indexed by rank.
        With `comm` (anything with mpi4py's `allgather(obj)`, over the same
        ranks; a collective call), peers on other machines are watched over
        the network too; without it only mpirun notices when they die."""
        self._lock = threading.Lock()
        self._poll = select.poll() if hasattr(select, "poll") else None
        self._fds = {}  # fd -> Dead
        self.dead = []
        self.network = None
        mine = peers[my_rank][0]
        self._causes = {}  # pid -> the reason it gave before exiting
        self._local = [_cause_address(identity, pid)
                       for rank, (identity, pid, _) in enumerate(peers)
                       if rank != my_rank and identity == mine]
        self._inbox = _cause_socket(_cause_address(mine, os.getpid())) if self._local else None
        if comm is not None:
            from coordinator.network_watch import NetworkWatch

            self.network = NetworkWatch.start(comm, my_rank, peers)
        if self._poll is None or not hasattr(os, "pidfd_open"):
            return
        for rank, (identity, pid, hostname) in enumerate(peers):
            if rank == my_rank or identity != mine:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            self._fds[fd] = Dead(rank, pid, hostname, "")
            self._poll.register(fd, select.POLLIN)

    def check(self):
        """Peers found dead since the last call: a list of Dead."""
        found = self.network.take() if self.network is not None else []
        if not self._fds or not self._lock.acquire(blocking=False):
            self.dead.extend(found)
            return found
        try:
            for fd, _ in self._poll.poll(0):
                info = self._fds.pop(fd, None)
                if info is None:
                    continue
                cause = self._cause_of(info.pid)
                if cause:
                    info = info._replace(how=f"which had failed: {cause}")
                self._poll.unregister(fd)
                os.close(fd)
                found.append(info)
            self.dead.extend(found)
            return found
        finally:
            self._lock.release()

    def tell_local(self, reason):
        """Leaves `reason` (why this rank cannot go on) with every peer on this
        machine; they read it when they see this process exit. Never blocks;
        a peer that cannot take it names this rank without it."""
        if self._inbox is None:
            return
        data = f"{os.getpid()}\n{reason}".encode("utf-8", "replace")[:_CAUSE_MAX]
        for address in self._local:
            try:
                self._inbox.sendto(data, address)
            except OSError:
                pass

    def _cause_of(self, pid):
        while self._inbox is not None:
            try:
                data = self._inbox.recv(_CAUSE_MAX)
            except OSError:  # nothing (more) queued
                break
            sender, _, text = data.decode("utf-8", "replace").partition("\n")
            if sender.isdigit():
                self._causes[int(sender)] = text
        return self._causes.get(pid)

    def close(self):
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self.network is not None:
            self.network.close()
        with self._lock:
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()


_CAUSE_MAX = 4096


def _cause_address(identity, pid):
    """The abstract Unix socket name on which the rank with this pid (on the
    machine and pid namespace `identity`) takes its peers' reasons."""
    return f"\0coordinator.cause.{identity}.{pid}"


def _cause_socket(address):
    """A non-blocking datagram socket bound to `address`, or None (not Linux,
    or the name is taken)."""
    if not hasattr(socket, "AF_UNIX"):
        return None
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    except OSError:
        return None
    try:
        s.bind(address)
        s.setblocking(False)
    except OSError:
        s.close()
        return None
    return s


def describe_dead(found):
    """'rank 2 (pid 28 on hostb)', with how it was noticed where that was
    over the network: 'rank 2 (pid 28 on hostb: the connection to host hostb
    closed)'."""
    parts = []
    for item in found:
        rank, pid, host = item[:3]
        how = item[3] if len(item) > 3 else ""
        sep = ", " if how.startswith("which ") else ": "
        parts.append(f"rank {rank} (pid {pid} on {host}{sep + how if how else ''})")
    return ", ".join(parts)
