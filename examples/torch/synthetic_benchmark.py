"""Synthetic data-parallel training benchmark, like Horovod's
pytorch_synthetic_benchmark: images per second per rank on random data.

    mpirun -np 2 python examples/torch/synthetic_benchmark.py [--model small_cnn]
        [--batch-size 32] [--num-iters 10] [--fp16-allreduce] [--use-adasum]

Models (examples/torch/models.py, no torchvision): small_cnn, mlp, resnet8,
all on 3x32x32 images. Each iteration runs --num-batches-per-iter training
steps; rank 0 prints every iteration's rate and the mean with a 95%
interval, per rank and in total.
"""

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

import frontends.torch as hvd  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small_cnn", choices=sorted(models.MODELS))
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: cores / local ranks)")
    args = parser.parse_args()

    hvd.init()
    threads = args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = models.build(args.model)
    lr_scale = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scale)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 32, 32)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model} ({models.parameter_count(model)} parameters)")
    log(f"Batch size: {args.batch_size} per rank; {threads} torch thread(s) per rank")
    log(f"Number of ranks: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
