"""SyncBatchNorm: batch normalisation whose statistics cover the whole
global batch, on CPU and GPU alike (plain torch ops; Horovod's version is
GPU-only because it uses CUDA-only kernels).

Forward: every rank computes its count, per-channel mean and sum of squared
deviations; one allgather brings everyone's, which are merged exactly
(Chan et al.'s parallel variance). Backward: the per-channel sums of dy and
dy*(x-mean) are summed over the ranks with one allreduce, which is what the
input gradient needs; the weight and bias gradients stay local (the
DistributedOptimizer reduces them like any other gradient).
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from coordinator.process_sets import global_process_set
from frontends.torch.mpi_ops import Sum, allgather_async, allreduce_async, synchronize


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm{1,2,3}d with statistics synchronised
    over the ranks of `process_set` in training mode (num_features, eps,
    momentum, affine, track_running_stats as in torch)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, factor, self.eps)
        ps = self.process_set
        if not ps.included() or ps.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, factor, self.eps)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, factor, ps)


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = x.contiguous()
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        count = x.numel() // channels
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        if count:
            var, mean = torch.var_mean(x.to(work), dim=dims, unbiased=False)
        else:  # (an empty batch on this rank: its statistics weigh nothing, NaN-free)
            var = mean = torch.zeros(channels, dtype=work, device=x.device)
        local = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                           mean.double(), (var * count).double()]).unsqueeze(0)
        stats = synchronize(allgather_async(local, name=f"sync_batch_norm.stats.{channels}",
                                            process_set=process_set))
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + channels], stats[:, 1 + channels:]
        total = counts.sum()
        if not total:
            raise ValueError(
                f"SyncBatchNorm: the batch is empty on every rank of the process set "
                f"(ranks {list(process_set.ranks or range(counts.shape[0]))}): no statistics "
                "to normalise with")
        g_mean = (counts * means).sum(0) / total
        g_m2 = (m2s + counts * (means - g_mean) ** 2).sum(0)
        g_var = g_m2 / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * g_mean.to(running_mean.dtype))
                unbiased = g_m2 / max(float(total) - 1.0, 1.0)
                running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        mean = g_mean.to(work).view(_channel_shape(x))
        invstd = torch.rsqrt(g_var.to(work) + eps).view(_channel_shape(x))
        y = (x.to(work) - mean) * invstd
        if weight is not None:
            y = y * weight.to(work).view(_channel_shape(x)) + bias.to(work).view(_channel_shape(x))
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = float(total)
        ctx.process_set = process_set
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        work = mean.dtype
        dy = dy.contiguous().to(work)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xmu = x.to(work) - mean
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            both = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               name=f"sync_batch_norm.grads.{channels}",
                                               process_set=ctx.process_set))
            g_dy = both[:channels].view(_channel_shape(x)) / ctx.total
            g_dy_xmu = both[channels:].view(_channel_shape(x)) / ctx.total
            grad_x = (dy - g_dy - xmu * invstd * invstd * g_dy_xmu) * invstd
            if weight is not None:
                grad_x = grad_x * weight.to(work).view(_channel_shape(x))
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (sum_dy_xmu * invstd.view(-1)).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None
