"""Random steps of every collective, on the global set and two process sets,
submitted in a different order on each rank and checked against NumPy
(tests/scripts/random_collectives.py), under settings that change how
negotiation and fusion go: a response cache of two entries (eviction every
step), none at all (every tensor through a round), no fusion, four ranks."""

import os

import pytest

from mpi_harness import mpirun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "random_collectives.py")
SETTINGS = {
    "defaults": (3, {}),
    "cache_of_two": (3, {"HOROVOD_CACHE_CAPACITY": "2"}),
    "no_cache": (3, {"HOROVOD_CACHE_CAPACITY": "0"}),
    "no_fusion_four_ranks": (4, {"HOROVOD_FUSION_THRESHOLD": "0"}),
}


@pytest.mark.mpi
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_random_collectives_match_numpy_on_every_rank(setting):
    np_, env = SETTINGS[setting]
    seed = sorted(SETTINGS).index(setting) + 1
    steps = 40
    run = mpirun([SCRIPT, str(seed), str(steps)], np_=np_, env=env, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert sorted(line for line in out.splitlines() if line.startswith("OK ")) == [
        f"OK {r} {steps}" for r in range(np_)], out[-4000:]
