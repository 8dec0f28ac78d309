"""Horovod's TensorFlow 1 API in frontends.tensorflow (broadcast_global_variables,
BroadcastGlobalVariablesHook, DistributedOptimizer of a
tf.compat.v1.train.Optimizer) on 2 ranks under mpirun, and the cases where
3 ranks differ from 2 (an odd slice count, Adasum's tree) on 3 (cases:
tests/mpi/tf_legacy_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}
MODULE = "tests/mpi/tf_legacy_cases.py"
# A deadlocked graph shows as a case timeout, well inside the job's.
RESULTS = CaseResults(MODULE, env=ENV, timeout=300, case_timeout=60)
ON_THREE = ["gradient_descent_matches_one_process_on_the_full_batch",
            "two_backward_passes_per_step_reduce_and_apply_every_second_pass",
            "adasum_combines_the_ranks_steps_every_backward_passes_per_step"]
RESULTS_ON_THREE = CaseResults(MODULE, env=dict(ENV, CASES=",".join(ON_THREE)), timeout=300,
                               case_timeout=60)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(MODULE))
def test_tensorflow_legacy(case):
    RESULTS.check(case, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ON_THREE)
def test_tensorflow_legacy_on_three_ranks(case):
    assert case in case_names(MODULE)
    RESULTS_ON_THREE.check(case, 3)
