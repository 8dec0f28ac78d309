"""Noticing that a peer process died, without asking MPI.

An MPI job whose rank dies leaves the others blocked in collectives that can
never finish. Every rank publishes (host identity, pid) at `init`; for the
peers on the same machine this rank opens a pidfd, which becomes readable the
moment that process exits. Checking costs one `poll` system call, so the
background thread and any waiting frontend thread can afford it often.
Ranks on other machines are covered by mpirun, which ends the job when a rank
exits abnormally.
"""

import os
import select
import socket
import threading


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


class PeerMonitor:
    def __init__(self, my_rank, peers):
        """`peers`: one (identity, pid, hostname) per rank, indexed by rank."""
        self._lock = threading.Lock()
        self._poll = select.poll() if hasattr(select, "poll") else None
        self._fds = {}  # fd -> (rank, pid, hostname)
        self.dead = []
        mine = peers[my_rank][0]
        if self._poll is None or not hasattr(os, "pidfd_open"):
            return
        for rank, (identity, pid, hostname) in enumerate(peers):
            if rank == my_rank or identity != mine:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            self._fds[fd] = (rank, pid, hostname)
            self._poll.register(fd, select.POLLIN)

    def check(self):
        """Peers found dead since the last call: a list of (rank, pid, host)."""
        if not self._fds or not self._lock.acquire(blocking=False):
            return []
        try:
            found = []
            for fd, _ in self._poll.poll(0):
                info = self._fds.pop(fd, None)
                if info is None:
                    continue
                self._poll.unregister(fd)
                os.close(fd)
                found.append(info)
            self.dead.extend(found)
            return found
        finally:
            self._lock.release()

    def close(self):
        with self._lock:
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()


def describe_dead(found):
    parts = [f"rank {rank} (pid {pid} on {host})" for rank, pid, host in found]
    return ", ".join(parts)
