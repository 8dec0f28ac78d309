"""A rank of coordinator.run: fetches the function from the driver, runs
it, and reports its result (or its error) back.

    python -m coordinator.run_task      (started by coordinator.run through mpirun)

The function and its result travel pickled (cloudpickle),
over the driver's authenticated gRPC service.
"""

import os
import sys
import traceback

import cloudpickle as _pickle

from coordinator.config import elastic_job
from coordinator.elastic import membership, worker

# Where the launchers put a rank's number before MPI starts.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def _static_rank():
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def _static_size():
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


def main():
    elastic = elastic_job()
    client = worker.client_from_env()
    if not elastic:
        client.register(0, _static_rank(), _static_size(), os.getpid())
    fn = _pickle.loads(client.task())
    code, payload, error = 0, b"", ""
    try:
        payload = _pickle.dumps(fn())
    except BaseException as exc:  # reported to the caller, who raises it
        code, error = 1, "".join(traceback.format_exception(exc))
        print(error, file=sys.stderr, flush=True)
    if elastic:
        m = membership.current()
        m.communicator()
        m.agent.finish(code, payload, error)
    else:
        client.finish(0, _static_rank(), code, payload, error)
    return code


if __name__ == "__main__":
    sys.exit(main())
