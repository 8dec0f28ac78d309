"""The timeline: a valid Chrome trace (even after SIGKILL), Horovod's
activities, every rank's submit time, and a report that names who was late."""

import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import types

import pytest

from coordinator.timeline import Timeline
from coordinator.timeline.report import analyse, iter_events
from mpi_harness import ROOT, mpirun


def _rows(events):
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    rows = {}
    for e in events:
        if e.get("ph") != "M":
            rows.setdefault(names.get(e["pid"]), []).append(e)
    return rows


@pytest.fixture(scope="module")
def straggler_trace(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tl") / "trace.json")
    proc = mpirun(["tests/scripts/timeline_job.py", "straggler", path, "8"], np_=2,
                  env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


@pytest.mark.mpi
def test_trace_is_valid_json_with_one_row_per_tensor(straggler_trace):
    with open(straggler_trace) as f:
        events = json.load(f)
    rows = _rows(events)
    assert {"grad.early", "grad.other", "grad.late", "params"} <= set(rows)
    for name in ("grad.early", "grad.late"):
        labels = [e["name"] for e in rows[name]]
        assert "NEGOTIATE_ALLREDUCE" in labels and "ALLREDUCE" in labels
        assert "MPI_ALLREDUCE" in labels
        ready = [e for e in rows[name] if e["ph"] == "i"]
        assert {e["args"]["rank"] for e in ready} == {0, 1}
        op = next(e for e in rows[name] if e["name"] == "ALLREDUCE")
        assert op["args"]["dtype"] == "float32" and op["args"]["shape"] in ([3, 4], [7])
    assert "MPI_BCAST" in [e["name"] for e in rows["params"]]
    assert any(e["name"] == "CYCLE_START" for e in events)
    # B/E events balance on every row.
    for name, evs in rows.items():
        depth = 0
        for e in sorted((e for e in evs if e["ph"] in "BE"), key=lambda e: e["ts"]):
            depth += 1 if e["ph"] == "B" else -1
        assert depth == 0, name


@pytest.mark.mpi
def test_fused_tensors_show_fusion_buffer_copies(straggler_trace):
    with open(straggler_trace) as f:
        labels = {e["name"] for e in json.load(f)}
    assert {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"} <= labels


@pytest.mark.mpi
def test_report_names_the_late_rank_and_tensor(straggler_trace):
    report = analyse(straggler_trace, top=5)
    stalls = report.top_stalls()
    assert stalls, report.text()
    worst = stalls[0]
    assert worst["tensor"] == "grad.late" and worst["late"] == [1], report.text()
    assert worst["wait"] >= 200e3  # us; the straggler slept 250 ms
    # (by how much depends on the machine's load, which makes rank 0 late
    # for other tensors too: not a ratio of times)
    assert report.lateness[1][0] > report.lateness[0][0], report.text()
    text = report.text()
    assert "late rank 1" in text and "'grad.late'" in text and "most late: rank 1" in text
    assert "negotiation" in text and "communication" in text and "fusion copies" in text


@pytest.mark.mpi
def test_report_command_prints_and_plots(straggler_trace, tmp_path):
    png = tmp_path / "stalls.png"
    proc = subprocess.run([sys.executable, "-m", "coordinator.timeline", "report",
                           straggler_trace, "--top", "3", "--plot", str(png)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "late rank 1" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "RuntimeWarning" not in proc.stderr


@pytest.mark.mpi
def test_plot_marks_the_late_rank_in_its_own_colour(straggler_trace):
    import matplotlib.pyplot as plt
    import numpy as np

    fig = analyse(straggler_trace, top=5).figure()
    ax = fig.axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    tab10 = plt.get_cmap("tab10")
    late = [c for c in ax.collections if len(c.get_offsets()) and c.get_sizes()[0] == 80]
    assert late, "no late arrivals drawn"
    # Every late mark on grad.late's row is rank 1's (the straggler's) colour.
    on_late_row = [c for c in late if c.get_offsets()[0][1] == rows.index("grad.late")]
    assert on_late_row
    for c in on_late_row:
        assert np.allclose(c.get_facecolors()[0][:3], tab10(1)[:3])
    plt.close(fig)


@pytest.mark.mpi
def test_trace_stays_valid_after_sigkill(tmp_path):
    path = str(tmp_path / "killed.json")
    proc = mpirun(["tests/scripts/timeline_job.py", "sigkill", path, "40"], np_=2,
                  env={"HOROVOD_TIMELINE": path}, timeout=120)
    assert proc.returncode != 0
    with open(path) as f:
        events = json.load(f)
    assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events)


@pytest.mark.mpi
def test_start_and_stop_timeline_at_run_time(tmp_path):
    base = str(tmp_path / "rt.json")
    proc = mpirun(["tests/scripts/timeline_job.py", "runtime", base], np_=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for suffix in (".1", ".2"):
        with open(base + suffix) as f:
            events = json.load(f)
        assert any(e.get("name") == "NEGOTIATE_ALLREDUCE" for e in events)
    with open(base + ".1") as f:
        assert any(e.get("name") == "CYCLE_START" for e in json.load(f))
    with open(base + ".2") as f:
        assert not any(e.get("name") == "CYCLE_START" for e in json.load(f))


def test_report_reads_a_trace_cut_mid_line(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text('[\n{"name":"process_name","ph":"M","pid":1,"args":{"name":"w"}},\n'
                    '{"name":"NEGOTIATE_ALLREDUCE","ph":"B","ts":0,"pid":1,"tid":0},\n'
                    '{"name":"rank 0 ready","ph":"i","ts":0,"pid":1,"args":{"rank":0}},\n'
                    '{"name":"rank 1 ready","ph":"i","ts":5000,"pid":1,"args":{"rank":1}},\n'
                    '{"name":"","ph":"E","ts":5100,"pid":1,"tid":0},\n'
                    '{"name":"MPI_ALL')
    assert len(list(iter_events(str(path)))) == 5
    report = analyse(str(path))
    assert report.top_stalls()[0]["late"] == [1]


def test_a_symlink_at_the_timeline_path_is_refused_not_followed(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    link = tmp_path / "timeline.json"
    link.symlink_to(precious)
    with pytest.raises(OSError, match="is a symbolic link, which is not followed") as exc:
        Timeline().start(str(link))
    assert exc.value.errno == errno.ELOOP and exc.value.filename == str(link)
    assert precious.read_text() == "keep me"


def test_a_regular_file_at_the_timeline_path_is_replaced(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text("an old trace, longer than the new one " * 100)
    timeline = Timeline()
    timeline.start(str(path))
    timeline.stop()
    assert json.loads(path.read_text()) == []


class _BenchHvd:
    """Just enough of `coordinator` for bench case (g); records where the
    timeline went and who could read that directory."""

    def __init__(self):
        self.timelines = []

    def allreduce_async(self, tensor, name, output):
        return name

    def synchronize(self, handle):
        pass

    def start_timeline(self, path):
        mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        self.timelines.append((path, mode))

    def stop_timeline(self):
        pass


def test_bench_writes_its_timeline_in_a_private_directory_and_removes_it():
    from coordinator import bench

    case = bench.Bench.__new__(bench.Bench)
    case.hvd, case.repeats, case.rank, case.rows = _BenchHvd(), 1, 0, []
    case.MPI = types.SimpleNamespace(IN_PLACE=None, MAX=None)
    case.comm = types.SimpleNamespace(Barrier=lambda: None,
                                      Allreduce=lambda *args, **kwargs: None)
    case.case_g()
    paths = {path for path, _ in case.hvd.timelines}
    assert len(paths) == 1 and {mode for _, mode in case.hvd.timelines} == {0o700}
    scratch = os.path.dirname(paths.pop())
    assert scratch != tempfile.gettempdir() and not os.path.exists(scratch)
    assert case.rows[0][0] == "(g) small-CNN step, timeline on vs off"
