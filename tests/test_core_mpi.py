"""The core API on 2, 3 and 4 ranks under mpirun (cases: tests/mpi/core_cases.py)."""

import ast
import os

import pytest

from mpi_harness import ROOT, CaseResults

MODULE = "tests/mpi/core_cases.py"
RESULTS = CaseResults(MODULE, env={"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})


def _case_names():
    with open(os.path.join(ROOT, MODULE)) as f:
        tree = ast.parse(f.read())
    return [node.name[5:] for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("case_")]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
@pytest.mark.parametrize("case", _case_names())
def test_core(case, np_):
    RESULTS.check(case, np_)
