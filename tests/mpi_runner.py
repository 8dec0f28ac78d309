"""Runs every `case_*` function of a case module on this rank (see
mpi_harness.py) and appends one JSON line per case to
$CASE_RESULTS_DIR/<rank>.jsonl."""

import faulthandler
import importlib.util
import json
import os
import sys
import traceback


def main(path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import coordinator as hvd

    setup = getattr(module, "setup", None)
    if setup is not None:
        setup(hvd)
    else:
        hvd.init()
    rank = hvd.rank()
    out = open(os.path.join(os.environ["CASE_RESULTS_DIR"], f"{rank}.jsonl"), "a")
    timeout = float(os.environ.get("CASE_TIMEOUT", "60"))
    cases = [(n, f) for n, f in vars(module).items() if n.startswith("case_") and callable(f)]
    only = os.environ.get("CASES")
    if only:
        cases = [(n, f) for n, f in cases if n[5:] in only.split(",")]
    for name, fn in cases:
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            fn(hvd)
            rec = {"case": name[5:], "status": "ok"}
        except Exception as exc:  # recorded, and the next case still runs
            rec = {"case": name[5:], "status": "fail",
                   "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"}
        faulthandler.cancel_dump_traceback_later()
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if hvd.is_initialized():
            hvd.barrier()
    teardown = getattr(module, "teardown", None)
    if teardown is not None:
        teardown(hvd)
    if hvd.is_initialized():
        hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
