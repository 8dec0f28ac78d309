"""What MPI may still touch once the coordinator has let go of it is kept
until the process ends (coordinator/leftovers.py): a peer that completes
it late, during this rank's MPI_Finalize, finds its buffers still there."""

import os

import pytest

from mpi_harness import mpirun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "late_peer_at_exit.py")


def _late_peer(tmp_path, *args):
    # Buffers past 64 KiB are unmapped when freed: a touch after that is a
    # SIGSEGV, not a corruption that may go unseen.
    return mpirun([SCRIPT, str(tmp_path / "exiting"), *args], np_=2,
                  env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=120)


@pytest.mark.mpi
def test_requests_given_up_on_keep_their_buffers_through_mpi_finalize(tmp_path):
    """A cycle in flight at shutdown, an abandoned collective and a cancelled
    control message, all completed by the peer only as rank 0 exits."""
    run = _late_peer(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "rank 1 completed them" in out


@pytest.mark.mpi
@pytest.mark.parametrize("part", ["cycle", "operations", "sends"])
def test_without_keeping_a_late_peer_makes_mpi_finalize_touch_freed_memory(tmp_path, part):
    """The scenario above bites: not kept, any one of them crashes rank 0."""
    run = _late_peer(tmp_path, "--unkept", part)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "rank 1 completed them" not in out
    assert "signal 11" in out or "Segmentation fault" in out, out
