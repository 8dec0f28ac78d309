"""Ranks started with different COORDINATOR_CYCLE_PAYLOAD_BYTES (run by
tests/test_riders_mpi.py): their cycles would carry payloads of different
sizes, so the first cycle stops every rank with an error that names the
setting, before any payload is used."""

import os


def setup(hvd):
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ["COORDINATOR_CYCLE_PAYLOAD_BYTES"] = "2048" if rank == 0 else "1024"
    hvd.init()


def case_different_payload_sizes_stop_every_rank_at_the_first_cycle(hvd):
    import numpy as np

    from coordinator.errors import HorovodInternalError

    try:
        for _ in range(3):
            hvd.allreduce(np.ones(1), name="x", op=hvd.Sum)
    except HorovodInternalError as exc:
        assert "COORDINATOR_CYCLE_PAYLOAD_BYTES" in str(exc), exc
        assert "disagree" in str(exc), exc
    else:
        raise AssertionError("ranks with different payload sizes ran a collective")
