"""The first step of a worker spawned on a host of an elastic job:

    python -m coordinator.elastic.spawned -- COMMAND...

MPI_Comm_spawn starts it with the driver's address and the job's secret in
its environment (membership.py), but not with the rest of what coordrun
exported to the first workers (PATH, PYTHONPATH, the settings, `-x VAR`):
a daemon on another host does not have it, and an MPI info value holds
only 256 bytes. It fetches that from the driver, then replaces itself with
COMMAND (exec: same process, so MPI sees COMMAND as the spawned rank; MPI
is not started here).
"""

import os
import sys

from coordinator.elastic import worker


def main(argv):
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("coordinator.elastic.spawned: no command given")
    os.environ.update(worker.client_from_env().environment())
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
