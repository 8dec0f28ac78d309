"""chainermn.global_except_hook on the coordinator: one rank's uncaught
exception ends every rank within seconds, whatever the others are doing,
and the output names the rank. Without the hook such a job hangs here (rank
1 never finishes exiting while the others wait), which is what ChainerMN's
hook is for."""

import sys
import time
import warnings

import pytest

from mpi_harness import mpirun

JOB = """
import os, sys, time
import numpy as np
import frontends.chainer as chainermn

comm = chainermn.create_communicator("naive")
mode, out = sys.argv[1], sys.argv[2]
with open(os.path.join(out, f"pid.{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
comm.allreduce(np.ones(1))  # every rank is up
if comm.rank == 1:
    time.sleep(0.5)
    with open(os.path.join(out, "raised_at"), "w") as f:
        f.write(repr(time.time()))
    raise ValueError("rank one gives up")
if mode == "coordinator":
    comm.allreduce(np.ones(1))  # waits for rank 1 in the coordinator
elif mode == "mpi":
    comm.recv_obj(1)  # waits for rank 1 in plain mpi4py
else:
    time.sleep(120)  # busy with something else
print(f"rank {comm.rank} went on", flush=True)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _survivors(pids, grace):
    """The pids still running after up to `grace` seconds (the launcher's
    signals may still be on their way when it returns)."""
    deadline = time.time() + grace
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["coordinator", "mpi", "sleep"])
@pytest.mark.parametrize("np_", [2, 3])
def test_one_rank_raising_ends_every_rank_within_seconds_naming_it(tmp_path, np_, mode):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    proc = mpirun([str(job), mode, str(tmp_path)], np_=np_,
                  env={"CHAINERMN_FORCE_ABORT_ON_EXCEPTION": "1"}, timeout=90)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "went on" not in out, out[-3000:]
    raised_at = float((tmp_path / "raised_at").read_text())
    assert ended - raised_at < 20, f"took {ended - raised_at:.1f} s\n{out[-3000:]}"
    assert "Uncaught exception on rank 1: ValueError: rank one gives up" in out, out[-3000:]
    # (Ranks that were waiting in the coordinator learn why and may abort first.)
    assert "MPI_ABORT was invoked on rank" in out, out[-3000:]
    if mode == "coordinator":
        assert "rank 1 is exiting after an uncaught ValueError" in out, out[-3000:]
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(np_)]
    survivors = _survivors(pids, grace=5)
    assert not survivors, f"ranks {[pids.index(p) for p in survivors]} outlived the job"


def test_the_hook_is_installed_once_and_only_when_asked(monkeypatch):
    from frontends.chainer import global_except_hook as hook

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(hook, "_orig_except_hook", None)
    monkeypatch.delenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTION", raising=False)
    hook._add_hook_if_enabled()
    assert sys.excepthook is sys.__excepthook__
    monkeypatch.setenv("CHAINERMN_FORCE_ABORT_ON_EXCEPTION", "1")
    hook._add_hook_if_enabled()
    assert sys.excepthook is hook._global_except_hook
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook.add_hook()
    assert any("multiple times" in str(w.message) for w in caught)
    assert hook._orig_except_hook is sys.__excepthook__
