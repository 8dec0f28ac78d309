"""Training-step time: frontends.torch's DistributedOptimizer against PyTorch
DDP (gloo backend), same model, same data, in the same processes.

    mpirun -np 2 -x OMPI_MCA_mpi_yield_when_idle=1 \
        python examples/torch/compare_ddp.py [--model small_cnn] [--rounds 60]

On GPUs (the issue's ResNet targets; torchvision's models, 224x224 images):

    mpirun -np 2 python examples/torch/compare_ddp.py --model resnet50 \
        --device cuda --ddp-backend nccl --batch-size 32 --rounds 20

Both run in every rank: the coordinator (over MPI) and torch.distributed
(gloo, over TCP; rank and size come from Open MPI's environment,
MASTER_ADDR/MASTER_PORT default to 127.0.0.1:29512). Each round runs a
couple of steps of each implementation, rotating the order, so drift in the
machine's load hits all alike; "local" (no communication) runs too as the
floor. Rank 0 prints the median step time of each and the median over
rounds of the paired ratio ours / DDP.

`--profile N` then runs N more steps of each implementation under
torch.profiler and prints where each step's GPU time went (step_profile.py):
the NCCL calls, when backward's kernels ended, the tail after them; the
traces stay in `--profile-dir` for Perfetto. `--host-profile N` runs N more
steps of each and prints where the host's time went (host_profile.py): the
gradient submissions' cost and every thread's sampled stacks.

On a machine where the ranks' compute threads use every core, the figure
depends on Open MPI's mpi_yield_when_idle: without it a rank that enters a
blocking collective before its peer spins on a core the peer's compute needs
(measured here: 1.17-1.20x DDP without, 1.01-1.03x with). The header line
says which setting the run had.
"""

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import frontends.torch as hvd  # noqa: E402
from coordinator import collectives, pacing, runtime  # noqa: E402

in_stream_order = collectives.in_stream_order


def env_int(*names, default=None):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


TORCHVISION = ("resnet18", "resnet50")


def build(args):
    """The model on the chosen device: ours (models.py) or torchvision's."""
    if args.model in TORCHVISION:
        import torchvision

        model = getattr(torchvision.models, args.model)(num_classes=1000)
    else:
        model = models.build(args.model)
    return model.to(args.device)


def make_steppers(args):
    torch.manual_seed(0)
    base = build(args)
    steppers = {}

    ours_model = build(args)
    ours_model.load_state_dict(base.state_dict())
    ours_opt = hvd.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=args.lr,
                                                        momentum=0.9),
                                        named_parameters=ours_model.named_parameters())
    hvd.broadcast_parameters(ours_model.state_dict(), root_rank=0)
    steppers["ours"] = (ours_model, ours_opt)

    ddp_model = build(args)
    ddp_model.load_state_dict(base.state_dict())
    device_ids = [torch.cuda.current_device()] if args.device == "cuda" else None
    ddp_model = torch.nn.parallel.DistributedDataParallel(ddp_model, device_ids=device_ids)
    steppers["ddp"] = (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=args.lr,
                                                  momentum=0.9))

    local_model = build(args)
    local_model.load_state_dict(base.state_dict())
    steppers["local"] = (local_model, torch.optim.SGD(local_model.parameters(), lr=args.lr,
                                                      momentum=0.9))
    return steppers


def _unannotated(_label):
    return contextlib.nullcontext()


def step(model, opt, x, y, annotate=_unannotated):
    """One training step; `annotate(label)` marks its backward and optimizer
    phases for the profiler. A step ends when its GPU work has."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with annotate("backward"):
        loss.backward()
    with annotate("optimizer"):
        opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()


def timed_steps(model, opt, x, y, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(model, opt, x, y)
        times.append(time.perf_counter() - start)
    return times


def print_in_rank_order(header, lines):
    """Each rank prints its `header` and `lines`, rank 0 first."""
    for r in range(hvd.size()):
        hvd.barrier()
        if r == hvd.rank():
            print("\n".join([header] + lines), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small_cnn",
                        choices=sorted(models.MODELS) + list(TORCHVISION))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ddp-backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=2,
                        help="timed steps per implementation per round (their median counts)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: cores / local ranks)")
    parser.add_argument("--async-completion", action="store_true",
                        help="set HOROVOD_ENABLE_ASYNC_COMPLETION=1 for the coordinator (its "
                             "GPU handles complete once queued; synchronize orders the stream)")
    parser.add_argument("--hold-lead", default="", metavar="MS[,MS...]",
                        help="also run ours as 'ours@MS' for each value: holding gradients "
                             "for its busy GPU lane until MS milliseconds before the lane should "
                             "be free (coordinator.pacing.DEVICE_HOLD_LEAD; 'ours' keeps the "
                             "default), in the same rotation")
    parser.add_argument("--switch-interval", default="", metavar="US[,US...]",
                        help="also run ours as 'ours~US' for each value: the interpreter's "
                             "switch interval at most US microseconds while GPU work is in "
                             "flight (COORDINATOR_SWITCH_INTERVAL; 0: Python's own; 'ours' "
                             "keeps the setting), in the same rotation")
    parser.add_argument("--host-completion", action="store_true",
                        help="also run ours as 'ours-host': DistributedOptimizer's gradients "
                             "complete when the host has seen their NCCL calls end, not in "
                             "stream order (as before e7e2503), in the same rotation")
    parser.add_argument("--ready-at-launch", action="store_true",
                        help="also run ours as 'ours-launch': a gradient whose GPU lane is idle "
                             "has its ready event recorded when its collective launches, not at "
                             "submission (as before this option existed), in the same rotation")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile N steps of each and print where their GPU time went")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="then run N more steps of each, timing the gradient submissions "
                             "and sampling every thread's stack, and print where host time went")
    parser.add_argument("--profile-dir", default=os.environ.get("OUT", "."),
                        help="where the profiler's traces go (default: $OUT or .)")
    args = parser.parse_args()
    if args.async_completion:
        os.environ["HOROVOD_ENABLE_ASYNC_COMPLETION"] = "1"

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    threads = args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    if args.device == "cuda":  # ranks may share a GPU (each with its own NCCL_HOSTID)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group(args.ddp_backend,
                            rank=env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", default=rank),
                            world_size=env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=size),
                            timeout=datetime.timedelta(seconds=120))

    steppers = make_steppers(args)
    gen = torch.Generator().manual_seed(1000 + rank)
    image, classes = (224, 1000) if args.model in TORCHVISION else (32, 10)
    x = torch.randn(args.batch_size, 3, image, image, generator=gen).to(args.device)
    y = torch.randint(0, classes, (args.batch_size,), generator=gen).to(args.device)

    base = ["ours", "ddp", "local"]  # (what --profile and --host-profile look at)
    order = list(base)
    leads = {"ours": pacing.DEVICE_HOLD_LEAD}
    for ms in filter(None, args.hold_lead.split(",")):
        name = f"ours@{ms}"
        leads[name] = float(ms) * 1e-3
        steppers[name] = steppers["ours"]
        order.insert(order.index("ddp"), name)

    loop = runtime.current().background
    switches = {"ours": loop.switch_interval.seconds}
    for us in filter(None, args.switch_interval.split(",")):
        name = f"ours~{us}"
        switches[name] = float(us) * 1e-6
        steppers[name] = steppers["ours"]
        order.insert(order.index("ddp"), name)

    for wanted, name in ((args.host_completion, "ours-host"),
                         (args.ready_at_launch, "ours-launch")):
        if wanted:
            steppers[name] = steppers["ours"]
            order.insert(order.index("ddp"), name)

    def run(name, steps):
        if name in leads:  # (the background thread reads it at each look)
            pacing.DEVICE_HOLD_LEAD = leads[name]
        if name in switches:  # (read after each turn of the loop)
            loop.switch_interval.seconds = switches[name]
        # (the optimizer looks it up at each submission)
        collectives.in_stream_order = (contextlib.nullcontext if name == "ours-host"
                                       else in_stream_order)
        if name == "ours-launch":  # (read at each submission)
            loop.lane_idle = lambda process_set_id, device: False
        else:
            vars(loop).pop("lane_idle", None)
        return timed_steps(*steppers[name], x, y, steps)

    for name in order:
        hvd.barrier()
        run(name, args.warmup)
    times = {name: [] for name in order}
    for r in range(args.rounds):
        # Rotate the order so each implementation follows each other one equally often.
        for name in order[r % len(order):] + order[:r % len(order)]:
            hvd.barrier()
            times[name].append(statistics.median(run(name, args.block)))
    pacing.DEVICE_HOLD_LEAD = leads["ours"]
    loop.switch_interval.seconds = switches["ours"]
    collectives.in_stream_order = in_stream_order
    vars(loop).pop("lane_idle", None)

    # A synchronous step takes as long as the slowest rank's: per round, the max over ranks.
    everyone = hvd.allgather_object(times)
    if rank == 0:
        slow = {name: [max(t[name][i] for t in everyone) for i in range(args.rounds)]
                for name in order}
        med = {name: statistics.median(ts) for name, ts in slow.items()}
        ratios = sorted(o / d for o, d in zip(slow["ours"], slow["ddp"]))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        where = (f"on {torch.cuda.get_device_name()}, DDP over {args.ddp_backend}"
                 if args.device == "cuda" else f"{threads} torch thread(s)/rank")
        completion = ", async completion" if args.async_completion else ""
        print(f"model {args.model} ({models.parameter_count(steppers['local'][0])} parameters), "
              f"batch {args.batch_size}/rank, {size} ranks, {where}{completion}, "
              f"{args.rounds} rounds x {args.block} step(s) per implementation, rotating order, "
              f"OMPI_MCA_mpi_yield_when_idle={os.environ.get('OMPI_MCA_mpi_yield_when_idle', '')}")
        for name in order:
            vs = ""
            if name.startswith("ours") and name != "ours":  # (ours itself: the line below)
                per_round = statistics.median(o / d for o, d in zip(slow[name], slow["ddp"]))
                vs = f", ratio to ddp {per_round:.3f} (of medians {med[name] / med['ddp']:.3f})"
            print(f"  {name:5s} median step {med[name] * 1e3:7.2f} ms{vs}")
        print(f"ratio ours/ddp = {statistics.median(ratios):.3f} (median of per-round ratios, "
              f"IQR {q1:.3f}-{q3:.3f}); ratio of medians {med['ours'] / med['ddp']:.3f}; "
              f"ours - local = {(med['ours'] - med['local']) * 1e3:+.2f} ms, "
              f"ddp - local = {(med['ddp'] - med['local']) * 1e3:+.2f} ms")
    def profiled_step(model, opt, annotate):
        step(model, opt, x, y, annotate)

    if args.profile:
        import step_profile

        profiled = step_profile.profile_steps(steppers, base, profiled_step, args.profile,
                                              args.profile_dir, rank, hvd.barrier)
        print_in_rank_order(f"rank {rank}: where the GPU time of a step went (traces in "
                            f"{args.profile_dir})",
                            [line for name in base
                             for line in step_profile.report(name, profiled[name])])
    if args.host_profile:
        import host_profile

        reports = host_profile.profile_host(steppers, base, profiled_step, args.host_profile,
                                            hvd.barrier)
        print_in_rank_order(f"rank {rank}: where the host time of a step went",
                            [line for name in base for line in reports[name]])
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
