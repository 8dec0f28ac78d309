"""Benchmarks against raw mpi4py, side by side in one run.

    python -m coordinator.bench [--np 2] [--cases a,b,c,d] [--repeats N] [--load K]

`--load K` runs K processes that each spin on a core beside the benchmark,
as data loaders or another job would on a training machine.

Run without mpirun, it launches itself on --np ranks. Each case alternates
the raw MPI version and ours (A, B, A, B, ...) so both see the same machine
state, and reports medians and their ratio:

  (a) one 64 MiB float32 allreduce (Sum) vs MPI_Allreduce;
  (b) ResNet-50's 161 gradient shapes (25.6 M floats) submitted
      asynchronously then waited for, vs the better of raw per-tensor
      Allreduce and raw pack + one Allreduce + unpack;
  (c) latency of a one-float allreduce, submit to result;
  (d) CPU used by an idle rank over a few seconds (% of one core);
  (e) a small CNN's PyTorch training step against PyTorch DDP (gloo):
      examples/torch/compare_ddp.py, run as its own job;
  (f) 16-bit allreduce (16 M float16 / bfloat16 elements) with the native
      kernels against the same call without them (NumPy fallback: reduce
      in float32), and against raw MPI_Allreduce on float16;
  (g) what the timeline costs: one step of a small CNN's 10 gradients
      (160 k floats) with tracing on against the same step with it off;
  (h) what negotiation costs rank 0 per training step (161 gradients of 32
      floats, ResNet-50's count, each too big to ride in the cycle, steady
      state): control messages and
      bytes sent and received, negotiation cycles and their bytes, and the
      background thread's CPU time. Counts, not times, are the figures to
      compare across np (run it oversubscribed at np = 2 ... 32).

On GPUs (`--gpu`, CuPy arrays; each rank on GPU local_rank % devices):

  (A) one 64 MiB float32 allreduce vs a bare `cupy.cuda.nccl` allReduce of
      the same buffer on a stream of its own;
  (B) ResNet-50's 161 gradients submitted asynchronously then waited for,
      vs the better of bare per-tensor NCCL calls and one fused NCCL call
      (copies in and out included).

Two ranks sharing one GPU need a different NCCL_HOSTID each, so on the GPU
machine run it under its mpirun recipe:
    bash .device/device_env.sh bash -c '$MPIRUN2 $PY -m coordinator.bench --gpu'
and the training steps against DDP (NCCL) with
    examples/torch/compare_ddp.py --model resnet50 --device cuda --ddp-backend nccl
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

CASES = "abcdefgh"
GPU_CASES = "AB"


def resnet50_shapes():
    """The 161 parameter shapes of torchvision's ResNet-50 (25,557,032 floats)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out_ch = width * 4
        for b in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if b == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]
    return shapes


def resnet18_shapes():
    """The 62 parameter shapes of torchvision's ResNet-18 (11,689,512 floats)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width in (64, 128, 256, 512):
        for b in range(2):
            shapes += [(width, in_ch, 3, 3), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,)]
            if b == 0 and in_ch != width:
                shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            in_ch = width
    shapes += [(1000, 512), (1000,)]
    return shapes


def _thread_cpu(native_id):
    """CPU seconds a thread of this process has used (Linux), or 0."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_ms(samples):
    return statistics.median(samples) * 1e3


class Bench:
    def __init__(self, repeats):
        import coordinator as hvd
        from mpi4py import MPI

        self.hvd = hvd
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.repeats = repeats
        hvd.init()
        self.rank = hvd.rank()
        self.rows = []

    def _sync(self):
        self.comm.Barrier()

    def _alternate(self, raw, ours, repeats, warmup=2):
        for _ in range(warmup):
            raw()
            ours()
        t_raw, t_ours = [], []
        for _ in range(repeats):
            self._sync()
            t0 = time.perf_counter()
            raw()
            t_raw.append(time.perf_counter() - t0)
            self._sync()
            t0 = time.perf_counter()
            ours()
            t_ours.append(time.perf_counter() - t0)
        # Every rank reports the slowest rank's time for each sample.
        both = np.array([t_raw, t_ours])
        self.comm.Allreduce(self.MPI.IN_PLACE, both, op=self.MPI.MAX)
        return list(both[0]), list(both[1])

    def case_a(self):
        n = 64 * 1024 * 1024 // 4
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        out = np.empty_like(src)
        hvd = self.hvd
        raw, ours = self._alternate(
            lambda: self.comm.Allreduce(src, dst, op=self.MPI.SUM),
            lambda: hvd.allreduce(src, op=hvd.Sum, name="bench.a", output=out),
            max(5, self.repeats // 4))
        assert np.array_equal(dst, out)
        self.rows.append(("(a) 64 MiB allreduce", _median_ms(raw), _median_ms(ours), "ms",
                          _median_ms(ours) / _median_ms(raw), "<= 1.05x raw"))

    def case_b(self):
        hvd = self.hvd
        shapes = resnet50_shapes()
        grads = [np.full(s, 1.0, np.float32) for s in shapes]
        outs = [np.empty_like(g) for g in grads]
        total = sum(g.size for g in grads)
        buf = np.empty(total, np.float32)
        comm, SUM = self.comm, self.MPI.SUM

        def per_tensor():
            for g, o in zip(grads, outs):
                comm.Allreduce(g, o, op=SUM)

        def packed():
            off = 0
            for g in grads:
                buf[off:off + g.size] = g.reshape(-1)
                off += g.size
            comm.Allreduce(self.MPI.IN_PLACE, buf, op=SUM)
            off = 0
            for o in outs:
                o.reshape(-1)[:] = buf[off:off + o.size]
                off += o.size

        def ours():
            handles = [hvd.allreduce_async(g, op=hvd.Sum, name=f"bench.b.{i}", output=o)
                       for i, (g, o) in enumerate(zip(grads, outs))]
            for h in handles:
                hvd.synchronize(h)

        reps = max(5, self.repeats // 4)
        raw1, ours1 = self._alternate(per_tensor, ours, reps)
        raw2, ours2 = self._alternate(packed, ours, reps)
        best_raw = min(_median_ms(raw1), _median_ms(raw2))
        mine = _median_ms(ours1 + ours2)
        which = "per-tensor" if _median_ms(raw1) <= _median_ms(raw2) else "pack+allreduce"
        self.rows.append((f"(b) ResNet-50 161 grads (raw: {which})", best_raw, mine, "ms",
                          mine / best_raw, "<= 1.15x raw"))

    def case_c(self):
        hvd = self.hvd
        x = np.ones(1, np.float32)
        y = np.empty_like(x)
        out = np.empty_like(x)
        raw, ours = self._alternate(
            lambda: self.comm.Allreduce(x, y, op=self.MPI.SUM),
            lambda: hvd.allreduce(x, op=hvd.Sum, name="bench.c", output=out),
            self.repeats * 10, warmup=50)
        self.rows.append(("(c) one-float allreduce latency", _median_ms(raw), _median_ms(ours),
                          "ms", None, "<= 0.25 ms"))

    def case_d(self, seconds=3.0):
        self._sync()
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        cpu = (time.process_time() - c0) / (time.perf_counter() - t0) * 100
        worst = self.comm.allreduce(cpu, op=self.MPI.MAX)
        self.rows.append(("(d) idle rank CPU (worst rank)", 0.0, worst, "% core", None,
                          "<= 2%"))

    def case_f(self):
        from coordinator import native

        hvd = self.hvd
        built = native.halfops
        if built is None:
            self.rows.append(("(f) native 16-bit kernels: not built", 0, 0, "ms", None, ""))
            return
        n = 16 * 1024 * 1024
        reps = max(5, self.repeats // 4)
        bf16 = native.dtypes.bfloat16()
        for dtype in [np.float16] + ([bf16] if bf16 is not None else []):
            x = np.ones(n, dtype)
            out = np.empty_like(x)
            name = np.dtype(dtype).name

            def run(kernel):
                native.halfops = kernel
                hvd.allreduce(x, op=hvd.Sum, name=f"bench.f.{name}", output=out)

            try:
                fallback, ours = self._alternate(lambda: run(None), lambda: run(built), reps)
            finally:
                native.halfops = built
            self.rows.append((f"(f) {name} allreduce, vs NumPy fallback", _median_ms(fallback),
                              _median_ms(ours), "ms", _median_ms(ours) / _median_ms(fallback),
                              "< 1 to ship"))
            if dtype == np.float16:
                y = np.empty_like(x)
                raw, ours = self._alternate(
                    lambda: self.comm.Allreduce(x, y, op=self.MPI.SUM), lambda: run(built),
                    reps)
                self.rows.append(("(f) float16 allreduce, vs raw MPI float16", _median_ms(raw),
                                  _median_ms(ours), "ms", _median_ms(ours) / _median_ms(raw),
                                  ""))

    def case_g(self):
        hvd = self.hvd
        shapes = [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 64, 3, 3), (128,),
                  (256, 128), (256,), (10, 256), (10,)]
        grads = [np.ones(s, np.float32) for s in shapes]
        outs = [np.empty_like(g) for g in grads]

        def step():
            handles = [hvd.allreduce_async(g, name=f"bench.g.{i}", output=o)
                       for i, (g, o) in enumerate(zip(grads, outs))]
            for h in handles:
                hvd.synchronize(h)

        # Alternate blocks of steps with the timeline on and off. The trace
        # goes to a private directory: a predictable name in /tmp could be a
        # link someone planted.
        reps = self.repeats * 5
        t_off, t_on = [], []
        with tempfile.TemporaryDirectory(prefix="coordinator-bench-") as scratch:
            path = os.path.join(scratch, "timeline.json")
            for _ in range(reps):
                self._sync()
                t0 = time.perf_counter()
                step()
                t_off.append(time.perf_counter() - t0)
                hvd.start_timeline(path)
                self._sync()
                t0 = time.perf_counter()
                step()
                t_on.append(time.perf_counter() - t0)
                hvd.stop_timeline()
        both = np.array([t_off, t_on])
        self.comm.Allreduce(self.MPI.IN_PLACE, both, op=self.MPI.MAX)
        off_ms, on_ms = _median_ms(list(both[0])), _median_ms(list(both[1]))
        self.rows.append(("(g) small-CNN step, timeline on vs off", off_ms, on_ms, "ms",
                          on_ms / off_ms, "report"))

    def case_h(self, steps=None):
        from coordinator import runtime

        hvd = self.hvd
        bg = runtime.current().background
        # 32 floats: more than a rider's 16 (negotiation.py), so the cycle
        # carries bits only, as for a real model's gradients.
        grads = [np.ones(32, np.float32) for _ in range(161)]

        def step():
            handles = [hvd.allreduce_async(g, op=hvd.Sum, name=f"bench.h.{i}")
                       for i, g in enumerate(grads)]
            for h in handles:
                hvd.synchronize(h)

        for _ in range(3):
            step()
        self._sync()
        steps = steps or max(20, self.repeats)
        counts0 = dict(bg.channel.counts)
        cycles0, cbytes0 = bg.cycle.cycles, bg.cycle.bytes
        cpu0 = _thread_cpu(bg.thread.native_id)
        for _ in range(steps):
            step()
        cpu = (_thread_cpu(bg.thread.native_id) - cpu0) / steps * 1e3
        msgs = sum(bg.channel.counts[k] - counts0[k] for k in ("sent", "received")) / steps
        nbytes = sum(bg.channel.counts[k] - counts0[k]
                     for k in ("sent_bytes", "received_bytes")) / steps
        cycles = (bg.cycle.cycles - cycles0) / steps
        cbytes = (bg.cycle.bytes - cbytes0) / steps
        self.rows.append(("(h) rank 0 control messages per step", 0, msgs, "msgs", None,
                          "flat in np"))
        self.rows.append(("(h) rank 0 control bytes per step", 0, nbytes, "bytes", None,
                          "flat in np"))
        self.rows.append(("(h) negotiation cycles per step", 0, cycles, "cycles", None, ""))
        self.rows.append(("(h) cycle bytes sent per step", 0, cbytes, "bytes", None, ""))
        self.rows.append(("(h) background thread CPU per step", 0, cpu, "ms", None, ""))

    def report(self):
        if self.rank != 0:
            return
        size = self.hvd.size()
        print(f"\ncoordinator benchmark, np={size}, medians of alternating runs")
        print(f"{'case':44} {'baseline':>10} {'ours':>10} {'unit':>7} {'ratio':>7}  target")
        for name, raw, ours, unit, ratio, target in self.rows:
            r = f"{ratio:.3f}" if ratio is not None else "-"
            print(f"{name:44} {raw:10.3f} {ours:10.3f} {unit:>7} {r:>7}  {target}")
        sys.stdout.flush()


class GpuBench(Bench):
    """The GPU cases, against bare NCCL through CuPy in the same processes."""

    def __init__(self, repeats):
        import cupy
        from cupy.cuda import nccl

        super().__init__(repeats)
        self.cp, self.nccl = cupy, nccl
        cupy.cuda.Device(self.hvd.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
        uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.bare = nccl.NcclCommunicator(self.hvd.size(), uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _bare_allreduce(self, src, dst):
        self.bare.allReduce(src.data.ptr, dst.data.ptr, src.size, self.nccl.NCCL_FLOAT32,
                            self.nccl.NCCL_SUM, self.stream.ptr)

    def case_A(self):
        cp, hvd = self.cp, self.hvd
        x = cp.ones(64 * 1024 * 1024 // 4, cp.float32)
        bare_out, ours_out = cp.empty_like(x), cp.empty_like(x)
        cp.cuda.Device().synchronize()  # the bare stream does not wait for the default one

        def bare():
            self._bare_allreduce(x, bare_out)
            self.stream.synchronize()

        raw, ours = self._alternate(
            bare, lambda: hvd.allreduce(x, op=hvd.Sum, name="bench.A", output=ours_out),
            max(5, self.repeats // 4))
        assert bool((bare_out == ours_out).all())
        self.rows.append(("(A) 64 MiB CUDA allreduce vs bare NCCL", _median_ms(raw),
                          _median_ms(ours), "ms", _median_ms(ours) / _median_ms(raw),
                          "<= 1.05x bare"))

    def case_B(self):
        cp, hvd, stream = self.cp, self.hvd, self.stream
        grads = [cp.ones(s, cp.float32) for s in resnet50_shapes()]
        outs = [cp.empty_like(g) for g in grads]
        buf = cp.empty(sum(g.size for g in grads), cp.float32)
        cp.cuda.Device().synchronize()

        def per_tensor():
            for g, o in zip(grads, outs):
                self._bare_allreduce(g, o)
            stream.synchronize()

        def fused():
            with stream:
                cp.concatenate([g.reshape(-1) for g in grads], out=buf)
                self._bare_allreduce(buf, buf)
                off = 0
                for o in outs:
                    cp.copyto(o.reshape(-1), buf[off:off + o.size])
                    off += o.size
            stream.synchronize()

        marks = []  # per run of ours: all submitted, first handle done, all done

        def ours():
            start = time.perf_counter()
            handles = [hvd.allreduce_async(g, op=hvd.Sum, name=f"bench.B.{i}", output=o)
                       for i, (g, o) in enumerate(zip(grads, outs))]
            submitted = time.perf_counter()
            hvd.synchronize(handles[0])
            first = time.perf_counter()
            for h in handles[1:]:
                hvd.synchronize(h)
            marks.append((submitted - start, first - start, time.perf_counter() - start))

        reps = max(5, self.repeats // 4)
        raw1, ours1 = self._alternate(per_tensor, ours, reps)
        half = len(marks)
        raw2, ours2 = self._alternate(fused, ours, reps)
        best = min(_median_ms(raw1), _median_ms(raw2))
        mine = _median_ms(ours1 + ours2)
        which = "per-tensor" if _median_ms(raw1) <= _median_ms(raw2) else "fused"
        self.rows.append((f"(B) ResNet-50 161 CUDA grads (bare: {which})", best, mine, "ms",
                          mine / best, "<= 1.10x bare"))
        # Where ours' time goes on this rank, warm-up runs (2 per _alternate)
        # left out: the training thread's submissions, then the first handle
        # done (the fused operation's device work and its completion), then
        # synchronizing the other 160.
        runs = marks[2:half] + marks[half + 2:]
        submitted, first, done = (_median_ms([m[i] for m in runs]) for i in range(3))
        self.rows.append(("(B) ours: all 161 submitted", 0, submitted, "ms", None,
                          f"{submitted / len(grads) * 1e3:.1f} us a tensor"))
        self.rows.append(("(B) ours: first handle done", 0, first, "ms", None,
                          f"{first - submitted - _median_ms(raw2):+.2f} ms past submitted "
                          "+ bare fused"))
        self.rows.append(("(B) ours: all 161 synchronized", 0, done, "ms", None, ""))

    def report(self):
        if self.rank == 0:
            name = self.cp.cuda.runtime.getDeviceProperties(self.cp.cuda.Device().id)["name"]
            name = name.decode() if isinstance(name, bytes) else name
            print(f"GPU: {name}, NCCL {self.nccl.get_version()}")
        super().report()


def _busy_load(count):
    """`count` processes that each spin on a core, as data-loader workers
    or another job would: the loaded case of the benchmark (--load)."""
    code = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
            for _ in range(count)]


def _launch(args):
    """Runs the MPI cases as one job, then case (e) as a job of its own,
    with `args.load` spinning processes beside them."""
    load = _busy_load(args.load)
    try:
        return _launch_jobs(args)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def _launch_jobs(args):
    status = 0
    mpi_cases = args.cases.replace("e", "")
    if mpi_cases:
        cmd = [sys.executable, "-m", "coordinator.run", "-np", str(args.np), sys.executable,
               "-m", "coordinator.bench", "--cases", mpi_cases, "--repeats", str(args.repeats)]
        if args.gpu:
            cmd.append("--gpu")
        status = subprocess.call(cmd)
    if "e" in args.cases:
        status = _case_e(args) or status
    return status


def _case_e(args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "examples", "torch", "compare_ddp.py")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("(e) skipped: PyTorch is not installed")
        return 0
    if not os.path.exists(script):
        print(f"(e) skipped: {script} not found (run from a source checkout)")
        return 0
    print(f"\n(e) small-CNN training step, ours against DDP (gloo), np={args.np}:")
    sys.stdout.flush()
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.call([sys.executable, "-m", "coordinator.run", "-np", str(args.np),
                            sys.executable, script], env=env)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--cases", default=None,
                        help=f"letters of the cases to run (default {CASES}; {GPU_CASES} "
                             "with --gpu)")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--load", type=int, default=0,
                        help="spinning processes to run beside the benchmark (busy cores)")
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU cases, on CuPy arrays (needs CuPy, NCCL and a GPU)")
    args = parser.parse_args(argv)
    if args.cases is None:
        args.cases = GPU_CASES if args.gpu else CASES
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        return _launch(args)
    bench = GpuBench(args.repeats) if args.gpu else Bench(args.repeats)
    for case in args.cases:
        getattr(bench, f"case_{case}")()
    bench.report()
    bench.hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
