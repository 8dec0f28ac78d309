"""Two real hosts for tests, made of Linux namespaces on this machine
(examples/multihost/netns.py), and coordrun jobs on them.

Tests that use the `two_hosts` fixture skip, saying why, where namespaces
cannot be made (not root, not Linux, no `unshare` or `ip`). The hosts'
namespaces have no names and vanish with their processes, which the
fixture kills.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from mpi_harness import ROOT

_spec = importlib.util.spec_from_file_location(
    "multihost_netns", os.path.join(ROOT, "examples", "multihost", "netns.py"))
netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns)

HOSTS = ("hosta", "hostb")


@pytest.fixture
def two_hosts():
    """A started netns.Cluster of hosta (10.77.0.1) and hostb (10.77.0.2)."""
    # Short: the hosts' agent sockets live here, and AF_UNIX paths are short.
    directory = tempfile.mkdtemp(prefix="hosts-")
    cluster = netns.Cluster(directory, HOSTS)
    try:
        cluster.start()
    except netns.Unavailable as exc:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"cannot make hosts from network namespaces here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


def coordrun(cluster, args, env=None, **popen):
    """Starts `coordrun ARGS` on hosta (as `ssh hosta coordrun ...` would),
    with PRRTE's launcher pointed at the cluster's agent; a Popen whose
    stdout carries stderr too."""
    settings = {
        "PRTE_MCA_plm_ssh_agent": cluster.agent,
        "PYTHONPATH": ROOT,
        "PYTHONUNBUFFERED": "1",
        "HOROVOD_LOG_HIDE_TIME": "1",
    }
    settings.update(env or {})
    argv = [os.path.join(os.path.dirname(sys.executable), "coordrun")] + list(args)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    return cluster.popen(HOSTS[0], argv, env=settings, text=True, cwd=ROOT, **popen)


def sockets(cluster, host):
    """`ss -tanpH` on `host`: (state, local, peer, process) per TCP socket."""
    out = cluster.run(host, ["ss", "-tanpH"], capture_output=True, text=True, check=True)
    rows = []
    for line in out.stdout.splitlines():
        fields = line.split()
        process = fields[5] if len(fields) > 5 else ""
        rows.append((fields[0], fields[3], fields[4], process))
    return rows
