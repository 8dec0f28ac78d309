"""A rank that fails tells the peers on its machine why before it exits, so
they name the root cause, not only the rank that exited first (seen in the
multi-host test: rank 1 lost hostb, raised and exited; rank 0 then blamed
rank 1 alone)."""

import os
import subprocess
import sys
import time

from coordinator.liveness import PeerMonitor, describe_dead, host_identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import os, sys
from coordinator.liveness import PeerMonitor, host_identity
ident = host_identity()
monitor = PeerMonitor(1, [(ident, int(sys.argv[1]), "hosta"), (ident, os.getpid(), "hosta")])
sys.stdin.readline()
if sys.argv[2] == "tell":
    monitor.tell_local("rank 3 (pid 29 on hostb: host hostb stopped answering for 4 s) "
                       "exited while the job was running")
"""


def _dead_child(tell):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(os.getpid()), tell],
                             stdin=subprocess.PIPE, env=env, text=True)
    ident = host_identity()
    monitor = PeerMonitor(0, [(ident, os.getpid(), "hosta"), (ident, child.pid, "hosta")])
    try:
        time.sleep(0.5)  # the child has bound its socket by now, or tells nobody
        child.stdin.write("go\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        found = []
        while not found and time.monotonic() < deadline:
            found = monitor.check()
            time.sleep(0.01)
        assert [d.pid for d in found] == [child.pid]
        return describe_dead(found), child.pid
    finally:
        monitor.close()


def test_a_local_peer_that_failed_is_named_with_its_reason():
    text, pid = _dead_child("tell")
    assert text.startswith(f"rank 1 (pid {pid} on hosta, which had failed: rank 3 "), text
    assert "host hostb stopped answering" in text


def test_a_local_peer_that_said_nothing_is_named_alone():
    text, pid = _dead_child("silent")
    assert text == f"rank 1 (pid {pid} on hosta)"


class _FailedGroup:
    """What ULFM's Comm.Get_failed gives: the failed ranks, translated to
    the communicator's ranks."""

    def __init__(self, ranks):
        self.ranks = ranks

    def Get_size(self):
        return len(self.ranks)

    def Translate_ranks(self, ranks, group):
        return [self.ranks[r] for r in ranks]


class _Comm:
    def __init__(self, failed):
        self.failed = failed

    def Get_failed(self):
        return _FailedGroup(self.failed)

    def Get_group(self):
        return None


def test_a_peer_failure_names_one_rank_or_several_in_good_english():
    from mpi4py import MPI

    from coordinator.control_channel import peer_failure

    exc = MPI.Exception(MPI.ERR_PROC_FAILED)
    assert peer_failure(exc, _Comm([1])).startswith("rank 1 failed or left the job (MPI: ")
    assert peer_failure(exc, _Comm([3, 0])).startswith("ranks 0, 3 failed or left the job")
    assert peer_failure(exc, None).startswith("a peer failed or left the job")
    assert peer_failure(MPI.Exception(MPI.ERR_COMM), _Comm([1])) is None
    assert peer_failure(ValueError("x"), _Comm([1])) is None


def test_a_survivor_that_knows_of_no_failure_yet_names_the_rank_that_died():
    """A rank whose operation failed because another survivor's did (an
    aborted schedule) may know of no failed process yet: it asks again, and
    asks the liveness watch, where it said "a peer" (seen in the kill probes
    under ULFM, np=3: one survivor named rank 0, the other "a peer")."""
    from mpi4py import MPI

    from coordinator.control_channel import peer_failure

    exc = MPI.Exception(MPI.ERR_PROC_FAILED)
    later = _Comm([])
    asked = []

    def known_dead():
        asked.append(1)
        if len(asked) == 3:
            later.failed = [2]  # ULFM has heard of it by the third look
        return []

    assert peer_failure(exc, later, known_dead).startswith("rank 2 failed or left the job")
    assert peer_failure(exc, _Comm([]), lambda: [0]).startswith("rank 0 failed")
    assert peer_failure(exc, _Comm([1]), lambda: [0]).startswith("ranks 0, 1 failed")
    # Nobody ever says: "a peer", after the wait
    assert peer_failure(exc, _Comm([]), lambda: [], wait=0.1).startswith("a peer failed")
