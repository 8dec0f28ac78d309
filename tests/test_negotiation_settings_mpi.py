"""Steps under the settings that change how tensors are negotiated and
fused, on 3 ranks (a set of two beside the global one): a response cache
smaller than a step, none at all (`--disable-cache`), no fusion
(`HOROVOD_FUSION_THRESHOLD=0`), cycles 5 ms apart. Results right and
nothing waiting forever under each (cases:
tests/mpi/negotiation_settings_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

MODULE = "tests/mpi/negotiation_settings_cases.py"
SETTINGS = {
    "cache2": {"HOROVOD_CACHE_CAPACITY": "2"},
    "cache0": {"HOROVOD_CACHE_CAPACITY": "0"},
    "fusion0": {"HOROVOD_FUSION_THRESHOLD": "0"},
    "cycle5ms": {"HOROVOD_CYCLE_TIME": "5"},
}
CASES = {name: CaseResults(MODULE, case_timeout=30, env=env) for name, env in SETTINGS.items()}


@pytest.mark.mpi
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", case_names(MODULE))
def test_steps_under_a_negotiation_setting(case, setting):
    CASES[setting].check(case, 3)
