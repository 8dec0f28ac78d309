"""Random steps of every collective, on the global set and two process sets,
submitted in a different order on each rank and checked against NumPy
(tests/scripts/random_collectives.py), under settings that change how
negotiation and fusion go: a response cache of two entries (eviction every
step), none at all (every tensor through a round), no fusion, four ranks;
with bad input now and then; with process sets added and removed; with
scale factors; from several threads at once; as "CUDA" arrays through the
NCCL backend (a fake CuPy). And the same for frontends.torch
(tests/scripts/random_torch.py), frontends.chainer (random_chainer.py) and
frontends.tensorflow (random_tensorflow.py). And uneven steps with join()
(tests/scripts/random_join.py). And a rank killed half way through random
collectives or joins, under ULFM."""

import os
import sys
import time

import pytest

from mpi_harness import mpi_env, mpirun, mpirun_path, run_job

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
SETTINGS = {
    "defaults": (3, {}),
    "cache_of_two": (3, {"HOROVOD_CACHE_CAPACITY": "2"}),
    "no_cache": (3, {"HOROVOD_CACHE_CAPACITY": "0"}),
    "no_fusion_four_ranks": (4, {"HOROVOD_FUSION_THRESHOLD": "0"}),
    # one operation in seven with bad input on one member: mismatched or
    # refused, it fails on every member, and everything else goes on
    "bad_input": (3, {"BAD_INPUT": "0.15"}),
    "bad_input_cache_of_two": (3, {"BAD_INPUT": "0.15", "HOROVOD_CACHE_CAPACITY": "2"}),
    # names reused step after step (cached), bad input often: a cached
    # tensor changed on one rank waited 30 s for its error (417dee0)
    "bad_input_reused_names": (3, {"BAD_INPUT": "0.3", "REUSE": "0.9"}),
    # sets added and removed while steps run on others
    "dynamic_sets_four_ranks": (4, {"DYNAMIC_SETS": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
                                    "BAD_INPUT": "0.1"}),
    # prescale and postscale factors, integer averages (rounded toward
    # zero, dividing last), also on cached names that ride in the cycle
    "scales": (3, {"SCALES": "0.5"}),
    "scales_reused_names_four_ranks": (4, {"SCALES": "0.5", "REUSE": "0.8"}),
    # each rank's share submitted by three threads at once; or run by the
    # blocking variants, which run the coordinator's loop on their threads
    "threads_four_ranks": (4, {"THREADS": "3", "BAD_INPUT": "0.1", "REUSE": "0.5"}),
    "threads_blocking": (3, {"THREADS": "3", "BLOCKING": "1", "BAD_INPUT": "0.1",
                             "COORDINATOR_DRIVE_SECONDS": "0.05"}),
    # the 2D torus over two simulated hosts of two ranks
    "torus_four_ranks": (4, {"HOROVOD_TORUS_ALLREDUCE": "1",
                             "COORDINATOR_SIMULATED_LOCAL_SIZE": "2", "SCALES": "0.5",
                             "BAD_INPUT": "0.1"}),
    # "CUDA" arrays (tests/gpu_fakes.py) through the NCCL backend's device
    # fusion; it found a fused broadcast of two dtypes giving the second the
    # first's dtype (test_gpu_fallback.py's test_a_fused_broadcast_of_two_
    # dtypes_...). The fake's NCCL calls block until every member makes
    # them: on three sets they deadlocked (this setting, within
    # 40 steps) until every rank queued every set's GPU operations in one
    # order (negotiation.answered_in_rounds)
    "with_a_fake_gpu_four_ranks": (4, {"FAKE_GPU": "1", "REUSE": "0.5", "SCALES": "0.3",
                                       "BAD_INPUT": "0.1"}),
    "with_a_fake_gpu_dynamic_sets_four_ranks": (4, {
        "FAKE_GPU": "1", "DYNAMIC_SETS": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "BAD_INPUT": "0.1"}),
}


@pytest.mark.mpi
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_random_collectives_match_numpy_on_every_rank(setting):
    np_, env = SETTINGS[setting]
    _run_and_check("random_collectives.py", sorted(SETTINGS).index(setting) + 1, 40, np_, env)


@pytest.mark.mpi
@pytest.mark.parametrize("np_, env", [
    (2, {}), (3, {}), (3, {"HOROVOD_CACHE_CAPACITY": "2"}),
    # allreduces of two process sets too, stall checks off: a join that
    # another set's allreduce needed waited for a cycle nobody else posted
    (4, {"SETS": "1", "HOROVOD_STALL_CHECK_DISABLE": "1"}),
    # "CUDA" arrays through the NCCL backend (fake CuPy): its zero
    # stand-ins for the joined ranks, on the global set and the others
    (3, {"SETS": "1", "FAKE_GPU": "1"}),
    # a cache of two beside sets: ids evicted by one set's new tensors
    # while a rank of another sends them (a request sent by one with the
    # last join came back after the join had completed: seed 207)
    (4, {"SETS": "1", "HOROVOD_CACHE_CAPACITY": "2", "FAKE_GPU": "1"})],
    ids=["2", "3", "3_cache_of_two", "4_sets", "3_sets_fake_gpu", "4_sets_cache_of_two"])
def test_random_uneven_steps_with_join_match_numpy_on_every_rank(np_, env):
    """Each rank runs its own number of steps and joins, round after round;
    what the joined ranks stand in for is checked too (a grouped allreduce
    of new names run while the others had joined stopped the job)."""
    _run_and_check("random_join.py", np_ + len(env), 6, np_, env)


@pytest.mark.mpi
@pytest.mark.parametrize("np_, env", [
    (3, {}), (4, {"HOROVOD_CACHE_CAPACITY": "2"}),
    # one rank refuses a tensor now and then (not contiguous, a dtype
    # nothing takes): the others failed only after the stall timeout
    (3, {"BAD": "0.2", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
         "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"})],
    ids=["3", "4_cache_of_two", "3_refusals"])
def test_random_torch_steps_match_torch_on_every_rank(np_, env):
    """Every variant of frontends.torch's collectives, every dtype, scale
    factors, views into larger tensors (an in-place result stays in its
    view), named and unnamed (tests/scripts/random_torch.py)."""
    _run_and_check("random_torch.py", np_ + len(env), 25, np_,
                   dict(env, OMP_NUM_THREADS="1"))


@pytest.mark.mpi
@pytest.mark.parametrize("np_, env", [(2, {}), (3, {}), (4, {"BAD": "0.3"})],
                         ids=["2", "3", "4_refusals"])
def test_random_chainermn_steps_match_numpy_on_every_rank(np_, env):
    """ChainerMN's communicator methods, chainermn.functions, the multi-node
    optimizer and scatter_dataset on the whole job, splits and groups over
    mpi4py sub-communicators (tests/scripts/random_chainer.py)."""
    from chainer_presence import CHAINER_REASON, NO_CHAINER

    if NO_CHAINER:
        pytest.skip(CHAINER_REASON)
    _run_and_check("random_chainer.py", np_ + 20, 15, np_, env)


@pytest.mark.mpi
@pytest.mark.parametrize("np_, env", [
    (3, {}), (3, {"HOROVOD_CACHE_CAPACITY": "2", "HOROVOD_FUSION_THRESHOLD": "0"})],
    ids=["3", "3_cache_of_two_no_fusion"])
def test_random_tensorflow_steps_match_numpy_on_every_rank(np_, env):
    """frontends.tensorflow's and .keras's collectives, IndexedSlices,
    gradients through them and DistributedGradientTape, eager and in
    tf.function, on the global set and two process sets
    (tests/scripts/random_tensorflow.py)."""
    pytest.importorskip("tensorflow")
    _run_and_check("random_tensorflow.py", np_ + len(env) + 30, 10, np_, env)


def _run_and_check(script, seed, count, np_, env):
    run = mpirun([os.path.join(SCRIPTS, script), str(seed), str(count)], np_=np_, env=env,
                 timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert sorted(line for line in out.splitlines() if line.startswith("OK ")) == [
        f"OK {r} {count}" for r in range(np_)], out[-4000:]


STOP_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}


@pytest.mark.mpi
@pytest.mark.parametrize("victim, step, submitted", [(1, 5, 1), (0, 3, 2)],
                         ids=["a_worker", "the_coordinator"])
def test_a_rank_stopped_half_way_through_a_random_step_is_named_on_every_rank(
        victim, step, submitted, tmp_path):
    """SIGSTOP after it submitted part of a step (some of it in process sets
    it is not in), continued once the others have failed (60 s later at the
    latest): every other rank fails naming it, it fails too once continued,
    and the job ends instead of hanging."""
    np_ = 3
    run = mpirun([os.path.join(SCRIPTS, "random_collectives.py"), "7", "20"], np_=np_,
                 env=dict(STOP_ENV, STOP=f"{victim},{step},{submitted},60", BAD_INPUT="0.1",
                          STOP_MARKS=str(tmp_path)),
                 timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert f"RANK {victim}: stopping" in out, out[-4000:]
    assert not [line for line in out.splitlines() if line.startswith("OK ")], out[-4000:]
    for rank in range(np_):
        said = [line for line in out.splitlines()
                if line.startswith(f"RANK {rank}: ") and "Error: " in line]
        assert len(said) == 1, f"rank {rank}:\n{out[-4000:]}"
        if rank != victim:
            assert f"rank {victim}" in said[0], said


# (Not with sets added at run time: Open MPI 5.0.11's ULFM can crash a
# survivor when a rank dies while the others are making a communicator with
# it; see the README, "What was and was not run here".)
KILLS = {
    "collectives_bad_input": ("random_collectives.py", 3, "1,3,1", {
        "BAD_INPUT": "0.1", "REUSE": "0.5"}),
    "collectives_fake_gpu_four_ranks": ("random_collectives.py", 4, "2,2,2", {
        "FAKE_GPU": "1", "REUSE": "0.5"}),
    "collectives_the_coordinator": ("random_collectives.py", 3, "0,3,3", {"REUSE": "0.9"}),
    "join_sets": ("random_join.py", 3, "1,1,2", {"SETS": "1"}),
    "join_the_coordinator_four_ranks": ("random_join.py", 4, "0,1,1", {
        "SETS": "1", "HOROVOD_CACHE_CAPACITY": "1"}),
}


@pytest.mark.mpi
@pytest.mark.parametrize("setting", sorted(KILLS))
def test_a_rank_killed_half_way_through_random_steps_is_named_by_every_survivor(setting,
                                                                              tmp_path):
    """SIGKILL after it submitted part of a step (KILL in the scripts), under
    `mpirun --with-ft ulfm`, which lets the survivors run on, so each must
    end by itself: each raises RankFailedError naming the dead rank (the
    probes found a survivor blaming itself, and one saying "a peer"), and
    the job ends instead of hanging."""
    script, np_, kill, env = KILLS[setting]
    victim = int(kill.split(",")[0])
    cmd = [mpirun_path(), "--with-ft", "ulfm", "-n", str(np_), "--oversubscribe",
           "--bind-to", "none", sys.executable, os.path.join(SCRIPTS, script), "11", "8"]
    start = time.monotonic()
    run = run_job(cmd, env=mpi_env(dict(env, KILL=kill, KILL_MARKS=str(tmp_path))),
                  timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-4000:]
    assert time.monotonic() - start < 120, out[-4000:]
    assert f"RANK {victim}: dying" in out, out[-4000:]
    assert not [line for line in out.splitlines() if line.startswith("OK ")], out[-4000:]
    for rank in range(np_):
        if rank == victim:
            continue
        # (from the file it left: the launcher may drop the last lines a
        # process printed as the job ends)
        mark = tmp_path / f"said.{rank}"
        assert mark.exists(), f"rank {rank}:\n{out[-4000:]}"
        said = mark.read_text()
        assert said.startswith(f"RANK {rank}: RankFailedError: "), said
        assert (f"rank {victim} failed or left the job" in said
                or f"rank {victim} (pid " in said), said
