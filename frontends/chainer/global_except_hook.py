"""global_except_hook: one rank's uncaught exception ends the whole job.

Without it, a rank that dies of an exception can leave the others waiting
for it (in MPI_Finalize, or in a receive the coordinator does not know
about). `add_hook()`, or CHAINERMN_FORCE_ABORT_ON_EXCEPTION set to a
non-empty value when the package is imported (pass it to every rank, e.g.
`mpiexec -x CHAINERMN_FORCE_ABORT_ON_EXCEPTION=1`), installs a sys.excepthook
that, after the usual traceback:

1. prints a banner naming the rank and the exception;
2. if the coordinator runs, shuts it down with that reason, so every other
   rank blocked in a coordinator operation fails at once with a
   ShutdownError that names this rank and the exception (waiting at most
   a few seconds for that);
3. calls MPI_Abort on COMM_WORLD, so the launcher ends every rank,
   whatever it is doing; every rank exits non-zero.

Steps 1 and 3 are ChainerMN's; step 2 is what the coordinator adds.
"""

import os
import sys
import threading
import warnings

# How long the shutdown in step 2 may take before MPI_Abort ends it anyway.
SHUTDOWN_WAIT_SECONDS = 3.0

_orig_except_hook = None


def _world_rank():
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # MPI unusable: the banner still goes out
        return "?"


def _tell_the_other_ranks(exc_type):
    """Shuts the coordinator down, naming the exception, if it runs."""
    from coordinator import runtime

    if runtime.current() is None:
        return
    why = f"is exiting after an uncaught {exc_type.__name__}"
    stopper = threading.Thread(target=runtime.stop, args=(why,), daemon=True)
    stopper.start()
    stopper.join(SHUTDOWN_WAIT_SECONDS)


def _global_except_hook(exc_type, value, traceback):
    """Prints the exception, tells the other ranks, calls MPI_Abort."""
    from coordinator import runtime

    if runtime.forked(runtime.current()):
        # A fork of a rank (os.fork) is no rank: MPI_Abort from it would end
        # the job the rank is still running.
        (_orig_except_hook or sys.__excepthook__)(exc_type, value, traceback)
        return
    try:
        (_orig_except_hook or sys.__excepthook__)(exc_type, value, traceback)
    finally:
        rank = _world_rank()
        sys.stderr.write(
            "\n******************************************\n"
            "ChainerMN (frontends.chainer):\n"
            f"   Uncaught exception on rank {rank}: {exc_type.__name__}: {value}\n"
            "   Shutting the coordinator down and calling MPI_Abort() to end every rank...\n"
            "******************************************\n\n")
        sys.stderr.flush()
        try:
            _tell_the_other_ranks(exc_type)
        except Exception as exc:  # the abort below must happen regardless
            sys.stderr.write(f"(could not shut the coordinator down: {exc})\n")
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        except Exception:
            sys.stderr.write("Sorry, failed to stop MPI and the process may hang.\n")
            sys.stderr.flush()
            os._exit(1)


def _add_hook_if_enabled():
    """Installs the hook when CHAINERMN_FORCE_ABORT_ON_EXCEPTION is set to a
    non-empty value (called when frontends.chainer is imported)."""
    if os.environ.get("CHAINERMN_FORCE_ABORT_ON_EXCEPTION"):
        add_hook()


def add_hook():
    """Installs the hook (see the module docstring); a second call warns
    and does nothing."""
    global _orig_except_hook
    if _orig_except_hook is not None:
        warnings.warn("chainermn.global_except_hook.add_hook() seems to be called multiple "
                      "times. Ignoring.", stacklevel=2)
        return
    _orig_except_hook = sys.excepthook
    sys.excepthook = _global_except_hook
