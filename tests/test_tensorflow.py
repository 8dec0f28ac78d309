"""frontends.tensorflow on 2 and 3 ranks under mpirun (cases: tests/mpi/tf_cases.py;
graphs that hold many independent collectives: tests/mpi/tf_graph_cases.py),
Horovod's process-set documentation on 4 ranks
(tests/mpi/tf_process_set_cases.py), and the elastic states on 2 ranks
(tests/mpi/tf_elastic_state_cases.py)."""

import pytest

from mpi_harness import CaseResults, case_names

ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "",
       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}
MODULE = "tests/mpi/tf_cases.py"
RESULTS = CaseResults(MODULE, env=ENV, timeout=400, case_timeout=90)
# A deadlocked graph shows as a case timeout, well inside the job's.
GRAPH_MODULE = "tests/mpi/tf_graph_cases.py"
GRAPH_RESULTS = CaseResults(GRAPH_MODULE, env=ENV, timeout=300, case_timeout=40)
PROCESS_SET_MODULE = "tests/mpi/tf_process_set_cases.py"
PROCESS_SET_RESULTS = CaseResults(PROCESS_SET_MODULE, env=ENV, timeout=300, case_timeout=60)
ELASTIC_STATE_MODULE = "tests/mpi/tf_elastic_state_cases.py"
ELASTIC_STATE_RESULTS = CaseResults(ELASTIC_STATE_MODULE, env=ENV, timeout=300,
                                    case_timeout=60)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(MODULE))
def test_tensorflow(case, np_):
    RESULTS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", case_names(GRAPH_MODULE))
def test_tensorflow_graph(case, np_):
    GRAPH_RESULTS.check(case, np_)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(PROCESS_SET_MODULE))
def test_tensorflow_process_sets(case):
    PROCESS_SET_RESULTS.check(case, 4)


@pytest.mark.mpi
@pytest.mark.parametrize("case", case_names(ELASTIC_STATE_MODULE))
def test_tensorflow_elastic_states(case):
    ELASTIC_STATE_RESULTS.check(case, 2)
