"""Runs multi-rank test cases under mpirun and reports each case's outcome.

A case module (tests/mpi/*.py) defines functions `case_<name>(hvd)` that every
rank runs, in definition order, in ONE mpirun job per rank count: MPI start-up
is paid once per module, not once per case. Each rank records, per case,
"ok" or the error it raised; a case passes when it passed on every rank.
Cases that hang are bounded by per-case timeouts inside the job and by a
timeout on the whole job.

Usage from a test file:

    RESULTS = CaseResults("tests/mpi/core_cases.py")

    @pytest.mark.parametrize("np_", [2, 3])
    def test_allreduce_sum(np_):
        RESULTS.check("allreduce_sum", np_)
"""

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from coordinator.run import OPEN_MPI, own_session_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "mpi_runner.py")


def mpirun_path():
    venv_bin = os.path.dirname(sys.executable)
    for candidate in (os.path.join(venv_bin, "mpirun"), shutil.which("mpirun")):
        if candidate and os.path.exists(candidate):
            return candidate
    pytest.skip("no mpirun found")


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        # Keep tests robust on 2 oversubscribed cores.
        "OMPI_MCA_mpi_yield_when_idle": "1",
    })
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


# Open MPI's launcher (prterun) failed to start before any rank ran, twice in
# CI: a SIGKILLed prterun had left its session for the same pid (see
# coordinator.run, SESSION_BASE). Every launch here now keeps its session in
# a fresh directory; should the launcher still fail before any rank ran,
# nothing of the test's was tried, and the job is launched once more.
LAUNCHER_FAILURES = (
    "The PMIx server's listener thread failed to start",
)


def launcher_failed(output):
    return any(sign in output for sign in LAUNCHER_FAILURES)


def run_job(cmd, **kwargs):
    """subprocess.run(cmd, capture_output=True, text=True, **kwargs) for a
    command that launches MPI ranks (mpirun, coordrun); run once more when
    the launcher failed to start (LAUNCHER_FAILURES)."""
    for attempt in (1, 2):
        proc = _run_in_own_session(cmd, **kwargs)
        output = proc.stdout + proc.stderr
        if proc.returncode == 0 or attempt == 2 or not launcher_failed(output):
            return proc
        print(f"the MPI launcher failed to start; trying once more:\n{output[-1500:]}")


def _run_in_own_session(cmd, env=None, **kwargs):
    """subprocess.run with Open MPI's launcher keeping its session in a fresh
    directory, removed afterwards (coordinator.run.own_session_base): a
    launcher killed at a timeout leaves its session behind, which would stop
    a later launcher given the same pid."""
    env = dict(os.environ if env is None else env)
    with own_session_base(env, OPEN_MPI, cmd, prefix="mpisession-"):
        return subprocess.run(cmd, capture_output=True, text=True, env=env, **kwargs)


def torch_distributed_env():
    """MASTER_PORT for a job that also starts torch.distributed (compare_ddp.py):
    a port free now, so that two such jobs at once do not both take 29512."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": s.getsockname()[1]}


def mpirun(args, np_=2, env=None, timeout=180):
    """Runs `python args...` on np_ ranks; returns the CompletedProcess
    (see run_job)."""
    cmd = [mpirun_path(), "-n", str(np_), "--oversubscribe", "--bind-to", "none",
           sys.executable] + list(args)
    return run_job(cmd, env=mpi_env(env), timeout=timeout)


class CaseResults:
    def __init__(self, module, env=None, timeout=300, case_timeout=60):
        self.module = os.path.join(ROOT, module)
        self.env = env or {}
        self.timeout = timeout
        self.case_timeout = case_timeout
        self._runs = {}

    def run(self, np_):
        if np_ not in self._runs:
            self._runs[np_] = self._launch(np_)
        return self._runs[np_]

    def _launch(self, np_):
        outdir = tempfile.mkdtemp(prefix="mpicases-")
        env = dict(self.env)
        env["CASE_RESULTS_DIR"] = outdir
        env["CASE_TIMEOUT"] = self.case_timeout
        try:
            proc = mpirun([RUNNER, self.module], np_=np_, env=env, timeout=self.timeout)
            output = proc.stdout + proc.stderr
            rc = proc.returncode
        except subprocess.TimeoutExpired as exc:
            output = f"TIMEOUT after {self.timeout}s\n{exc.stdout or ''}{exc.stderr or ''}"
            rc = None
        per_rank = {}
        for fname in sorted(os.listdir(outdir)):
            rank = int(fname.split(".")[0])
            with open(os.path.join(outdir, fname)) as f:
                per_rank[rank] = [json.loads(line) for line in f if line.strip()]
        shutil.rmtree(outdir, ignore_errors=True)
        return {"rc": rc, "output": output, "ranks": per_rank}

    def check(self, case, np_):
        run = self.run(np_)
        outcomes = {}
        for rank, records in run["ranks"].items():
            for rec in records:
                if rec["case"] == case:
                    outcomes[rank] = rec
        missing = [r for r in range(np_) if r not in outcomes]
        tail = run["output"][-4000:]
        if missing:
            pytest.fail(f"case {case} at np={np_}: no result from ranks {missing} "
                        f"(job rc={run['rc']})\n{tail}")
        failed = {r: rec["error"] for r, rec in outcomes.items() if rec["status"] != "ok"}
        if failed:
            lines = "\n".join(f"  rank {r}: {err}" for r, err in sorted(failed.items()))
            pytest.fail(f"case {case} at np={np_} failed:\n{lines}")


def case_names(module):
    """The case_* functions of a case module, in definition order."""
    with open(os.path.join(ROOT, module)) as f:
        tree = ast.parse(f.read())
    return [node.name[5:] for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("case_")]
