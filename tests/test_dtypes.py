"""bfloat16 is loaded on first need (coordinator/dtypes.py): importing the
core or the torch frontend leaves ml_dtypes unimported, and the first
bfloat16 lookup, from a dtype or from the wire, fills every table that holds
it. Each check runs in a fresh interpreter, since this one may have loaded
it already."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from coordinator import dtypes, native
from coordinator.wire import pb
from mpi_harness import ROOT, mpirun


def run_fresh(code):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_importing_the_core_and_the_torch_frontend_leaves_ml_dtypes_unimported():
    out = run_fresh("""
        import sys
        import numpy as np
        import coordinator, coordinator.runtime, coordinator.collectives
        from coordinator import dtypes, gpu
        import frontends.torch
        from frontends.torch import _tensors
        import torch
        assert dtypes.info_for(np.float32).name == "float32"
        assert not dtypes.is_bfloat16(np.dtype(np.float64))
        assert gpu.storage_dtype(np.float16) == np.float16
        assert torch.bfloat16 in _tensors.SUPPORTED
        assert "bfloat16" in dtypes.SUPPORTED_NAMES
        print("ml_dtypes" in sys.modules)
    """)
    assert out.split() == ["False"]


def test_a_bfloat16_wire_dtype_loads_it_into_every_table():
    out = run_fresh("""
        import sys
        from coordinator import dtypes, native
        from coordinator.ops import mpi_reduce
        from coordinator.wire import pb
        assert "ml_dtypes" not in sys.modules
        info = dtypes.BY_WIRE[pb.BFLOAT16]
        assert info.name == "bfloat16" and info.wire == pb.BFLOAT16
        assert dtypes.BY_DTYPE[info.dtype] is info and dtypes.BFLOAT16 == info.dtype
        assert native.KINDS[info.dtype] == 1 and native._KIND_DTYPES[1] == info.dtype
        assert mpi_reduce._REDUCE_AS[info.dtype] == "float32"
        if native.halfops is not None:
            rdtype, _, op = mpi_reduce.reduction(info, pb.SUM)
            assert rdtype == info.dtype and op is mpi_reduce._user_op(
                native.halfops.reduce, 0, 1)
        seen = []
        dtypes.on_bfloat16(seen.append)  # registered late: called at once
        assert seen == [info.dtype]
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_threads_asking_at_once_all_get_bfloat16():
    """The frontend's thread and the background thread may both be first:
    none may be told there is no bfloat16 while another imports it."""
    out = run_fresh("""
        import threading
        from coordinator import dtypes, native
        from coordinator.wire import pb
        start, got = threading.Barrier(8), []
        def ask(i):
            start.wait()
            got.append(dtypes.BY_WIRE[pb.BFLOAT16].name if i % 2 else dtypes.bfloat16().name)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == ["bfloat16"] * 8, got
        assert native.KINDS[dtypes.BFLOAT16] == 1
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_a_child_forked_while_the_lock_is_held_can_still_load_bfloat16():
    out = run_fresh("""
        import os
        from coordinator import dtypes
        with dtypes._bf16_lock:  # as if another thread were loading it
            pid = os.fork()
            if pid == 0:
                import signal
                signal.alarm(20)  # (a hang ends the child, failing the check)
                os._exit(0 if dtypes.bfloat16().name == "bfloat16" else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out.split() == ["0"]


def test_a_bfloat16_array_made_after_import_is_known_by_its_dtype():
    out = run_fresh("""
        import numpy as np
        from coordinator import dtypes, fusion
        import ml_dtypes
        a = np.array([1.5, -2.25, 3.0], ml_dtypes.bfloat16)
        info = dtypes.info_for(a.dtype)
        assert info is not None and info.wire == dtypes.pb.BFLOAT16
        assert dtypes.is_bfloat16(a.dtype)
        fusion.scale_inplace(a, 0.5)
        print(a.astype(np.float32).tolist())
    """)
    assert out.strip() == "[0.75, -1.125, 1.5]"


def test_without_ml_dtypes_bfloat16_is_unsupported_and_named_so():
    out = run_fresh("""
        import sys
        sys.modules["ml_dtypes"] = None  # as if not installed
        import numpy as np
        from coordinator import dtypes, native
        from coordinator.wire import pb
        from frontends.torch import _tensors
        import torch
        assert dtypes.bfloat16() is None and dtypes.BFLOAT16 is None
        assert not dtypes.BFLOAT16_AVAILABLE and "bfloat16" not in dtypes.SUPPORTED_NAMES
        assert dtypes.info_for_wire(pb.BFLOAT16) is None
        assert dtypes.wire_name(pb.BFLOAT16) == f"dtype#{pb.BFLOAT16}"
        try:
            dtypes.BY_WIRE[pb.BFLOAT16]
        except KeyError:
            pass
        else:
            raise AssertionError("BY_WIRE has bfloat16 without ml_dtypes")
        assert list(native.KINDS) == [np.dtype(np.float16)]
        assert torch.bfloat16 not in _tensors.SUPPORTED
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_an_ml_dtypes_that_fails_to_import_is_an_error_not_int16(tmp_path):
    """Found but broken: a bfloat16 tensor must not travel as its int16
    bits, reduced as integers."""
    (tmp_path / "ml_dtypes").mkdir()
    (tmp_path / "ml_dtypes" / "__init__.py").write_text("raise ImportError('broken')\n")
    out = run_fresh(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import torch
        from coordinator import dtypes
        from frontends.torch import _tensors
        assert dtypes.BFLOAT16_AVAILABLE and dtypes.bfloat16() is None
        try:
            _tensors.bridge(torch.ones(2, dtype=torch.bfloat16), "allreduce.grad")
        except ValueError as exc:
            print(exc)
    """)
    assert out.strip() == ("allreduce.grad: bfloat16 tensors need the ml_dtypes package, "
                           "which failed to import")


def test_tables_here_hold_bfloat16_once_asked_for():
    bf16 = dtypes.bfloat16()
    if bf16 is None:
        pytest.skip("needs ml_dtypes")
    assert dtypes.BY_DTYPE[bf16].wire == pb.BFLOAT16 and native.KINDS[bf16] == 1
    assert dtypes.info_for(np.dtype(np.complex64)) is None  # still unsupported


def test_a_joined_rank_that_never_saw_bfloat16_reduces_it_from_the_wire():
    pytest.importorskip("ml_dtypes")
    proc = mpirun(["tests/scripts/lazy_bfloat16.py"], np_=2, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"rank {rank}: after join ml_dtypes loaded: True" in out, out
        assert f"rank {rank}: bfloat16 kernels registered: True" in out, out
