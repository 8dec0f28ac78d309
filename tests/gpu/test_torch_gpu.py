"""frontends.torch on CUDA tensors: zero-copy in and out, every op against
the same computation on the host, torch and CuPy tensors in one job, a
DistributedOptimizer run that equals single-process training on the full
batch, and no host synchronisation on submit nor in the optimizer's step."""

import copy
import time

import numpy as np
import pytest


def values(torch, rank, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(1, 5, shape, generator=g).to(dtype)
    return torch.randint(-8, 8, shape, generator=g).to(dtype)


def test_inplace_allreduce_keeps_the_tensor_and_its_storage(hvd, torch_cuda):
    torch, thvd = torch_cuda
    t = torch.full((1000,), hvd.rank() + 1.0, device="cuda")
    ptr = t.data_ptr()
    out = thvd.allreduce_(t, op=thvd.Sum, name="t.inplace")
    assert out is t and t.data_ptr() == ptr
    assert t[0].item() == sum(r + 1 for r in range(hvd.size()))


@pytest.mark.parametrize("name", ["uint8", "int8", "int16", "int32", "int64", "float16",
                                  "bfloat16", "float32", "float64"])
def test_every_op_on_cuda_tensors_matches_the_host(hvd, torch_cuda, name):
    torch, thvd = torch_cuda
    dtype = getattr(torch, name)
    n, me = hvd.size(), hvd.rank()
    inputs = [values(torch, r, (2 * n + 1, 3), dtype, seed=1) for r in range(n)]
    x = inputs[me].cuda()
    total = sum(i.double() for i in inputs)

    out = thvd.allreduce(x, op=thvd.Sum, name=f"t.ar.{name}")
    assert out.is_cuda and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), total)
    out = thvd.allreduce(x, op=thvd.Average, name=f"t.avg.{name}")
    want = total / n
    torch.testing.assert_close(out.cpu().double(),
                               want if dtype.is_floating_point else want.trunc())
    outs = thvd.grouped_allreduce([x, x[:1].contiguous()], op=thvd.Max, name=f"t.gar.{name}")
    torch.testing.assert_close(outs[1].cpu().double(),
                               torch.stack([i[:1].double() for i in inputs]).amax(0))

    gathered = thvd.allgather(inputs[me][:me + 1].cuda(), name=f"t.ag.{name}")
    torch.testing.assert_close(gathered.cpu(), torch.cat([i[:r + 1]
                                                          for r, i in enumerate(inputs)]))
    b = x.clone()
    thvd.broadcast_(b, root_rank=n - 1, name=f"t.bc.{name}")
    torch.testing.assert_close(b.cpu(), inputs[n - 1])

    rs = thvd.reducescatter(x, op=thvd.Sum, name=f"t.rs.{name}")
    shares = [(2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0) for r in range(n)]
    start = sum(shares[:me])
    torch.testing.assert_close(rs.cpu().double(), total[start:start + shares[me]])

    splits = torch.tensor([1] * n, dtype=torch.int32)
    a2a, received = thvd.alltoall(x[:n].contiguous(), splits=splits, name=f"t.a2a.{name}")
    torch.testing.assert_close(a2a.cpu(), torch.stack([i[me] for i in inputs]))
    assert received.tolist() == [1] * n


def test_a_channels_last_cuda_tensor_is_reduced_in_place_in_its_layout(hvd, torch_cuda):
    """Not contiguous: reduced as a contiguous copy on torch's stream, the
    result copied back on it after synchronize (CPU: torch_ops_cases)."""
    torch, thvd = torch_cuda
    n, me = hvd.size(), hvd.rank()
    inputs = [values(torch, r, (2, 3, 4, 4), torch.float32, seed=4) for r in range(n)]
    x = inputs[me].cuda().contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    assert thvd.allreduce_(x, op=thvd.Sum, name="t.cl") is x
    assert x.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(x.cpu(), sum(inputs))


def test_bool_tensors_are_gathered_and_broadcast(hvd, torch_cuda):
    torch, thvd = torch_cuda
    n, me = hvd.size(), hvd.rank()
    inputs = [values(torch, r, (r + 1, 2), torch.bool, seed=2) for r in range(n)]
    out = thvd.allgather(inputs[me].cuda(), name="t.ag.bool")
    assert out.dtype == torch.bool and out.is_cuda
    assert torch.equal(out.cpu(), torch.cat(inputs))


def test_torch_and_cupy_tensors_in_one_job(hvd, cp, torch_cuda):
    torch, thvd = torch_cuda
    n, me = hvd.size(), hvd.rank()
    t = torch.full((300,), float(me), device="cuda")
    c = cp.full(200, me + 1.0, cp.float32)
    h_torch = thvd.allreduce_async(t, op=thvd.Sum, name="mix.torch")
    h_cupy = hvd.allreduce_async(c, op=hvd.Sum, name="mix.cupy")
    assert thvd.synchronize(h_torch)[0].item() == sum(range(n))
    assert float(hvd.synchronize(h_cupy)[0]) == sum(r + 1 for r in range(n))


def test_submit_does_not_wait_for_the_gpu(hvd, torch_cuda):
    torch, thvd = torch_cuda
    x = torch.ones(1 << 20, device="cuda")
    # Load every kernel first: loading a CUDA module can wait for the device.
    torch.cuda._sleep(1000)
    x.mul_(2)
    x.div_(2)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keeps the current stream busy for about a second
    x.mul_(2)  # queued behind it: the allreduce must read this
    busy = not torch.cuda.current_stream().query()
    start = time.perf_counter()
    handle = thvd.allreduce_async_(x, op=thvd.Sum, name="t.busy")
    submitted = time.perf_counter() - start
    # What matters is that submitting does not wait for the queued work
    # (the GPU is shared with the other rank, so how long the sleep lasts
    # is not ours to promise).
    assert busy, "the sleep ended before the test looked"
    assert submitted < 0.2, f"allreduce_async_ took {submitted:.3f} s: it waited for the GPU"
    out = thvd.synchronize(handle)
    assert out is x and x[0].item() == 2 * hvd.size()


def test_distributed_optimizer_equals_training_on_the_full_batch(hvd, torch_cuda):
    torch, thvd = torch_cuda
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).cuda()
    reference = copy.deepcopy(model)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters())
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(123)
    per_rank = 6
    for _ in range(5):
        x = torch.randn(n * per_rank, 8, generator=g).cuda()  # the same batch everywhere
        y = torch.randn(n * per_rank, 4, generator=g).cuda()
        mine = slice(me * per_rank, (me + 1) * per_rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if n > 1:  # the hooks submitted during backward: every gradient is in flight
            assert opt._handles and all(h is not None for h, _ in opt._handles.values())
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_optimizer_step_does_not_wait_for_the_gpu(hvd, torch_cuda):
    """DistributedOptimizer takes its gradients in stream order: step()
    queues the update behind their NCCL calls and returns without the host
    waiting for those; the update still reads the reduced gradients."""
    torch, thvd = torch_cuda
    n, lr = hvd.size(), 0.5
    warm = torch.nn.Linear(64, 64).cuda()  # load the kernels, open the lane
    warm_opt = thvd.DistributedOptimizer(torch.optim.SGD(warm.parameters(), lr=lr),
                                         named_parameters=warm.named_parameters())
    warm(torch.ones(4, 64, device="cuda")).sum().backward()
    warm_opt.step()
    model = torch.nn.Linear(64, 64).cuda()
    thvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = thvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                    named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((4, 64), float(hvd.rank() + 1), device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second: backward's kernels, then NCCL, wait
    model(x).sum().backward()
    start = time.perf_counter()
    opt.step()
    stepped = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    assert busy, "the sleep ended before the test looked"
    assert stepped < 0.3, f"step() took {stepped:.3f} s: it waited for the GPU"
    mean_x = sum(4.0 * (r + 1) for r in range(n)) / n  # d(sum)/dW: x summed over the batch
    weight, bias = model.parameters()
    torch.testing.assert_close(weight, before[0] - lr * mean_x)
    torch.testing.assert_close(bias, before[1] - lr * 4.0)


def test_tensors_go_in_and_results_come_back_without_copies(hvd, cp, torch_cuda):
    torch, thvd = torch_cuda
    from frontends.torch import _tensors

    t = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    bridged = _tensors.bridge(t, "test")
    assert bridged.array.array.data.ptr == t.data_ptr()  # bfloat16: the marked int16 view
    result = hvd.allgather(cp.arange(6, dtype=cp.float32), name="t.nocopy")
    back = _tensors.to_tensor(result, torch.empty(0, device="cuda"))
    assert back.data_ptr() == result.data.ptr and back.is_cuda
    np.testing.assert_array_equal(back.cpu().numpy()[:6], np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("name", ["bool", "uint8", "int32", "int64", "float16", "bfloat16",
                                  "float32", "float64"])
def test_the_cached_view_is_the_tensor_itself(hvd, cp, torch_cuda, name):
    """A CUDA tensor reaches the core as a CuPy view of its own memory, made
    once per pointer, shape and dtype (no DLPack, no CUDA call), equal to
    what cupy.from_dlpack gives."""
    torch, _ = torch_cuda
    from frontends.torch import _tensors

    dtype = getattr(torch, name)
    t = values(torch, hvd.rank(), (5, 7), dtype, seed=3).cuda().requires_grad_(
        dtype.is_floating_point)
    def unmarked(array):  # bfloat16 comes marked: coordinator.gpu.bfloat16(int16 view)
        return array.array if dtype == torch.bfloat16 else array

    view = unmarked(_tensors._device_array(t))
    assert unmarked(_tensors._device_array(t)) is view
    slow = unmarked(_tensors._dlpack_array(t))
    assert view.data.ptr == t.data_ptr() and view.shape == (5, 7)
    assert view.dtype == slow.dtype and view.device.id == t.get_device()
    np.testing.assert_array_equal(cp.asnumpy(view), cp.asnumpy(slow))
    # Another shape over the same memory is another view.
    assert unmarked(_tensors._device_array(t.view(-1))).shape == (35,)
    # Writes through the view land in the tensor.
    if dtype == torch.float32:
        view[...] = 7
        torch.cuda.synchronize()
        assert bool((t == 7).all())


def test_a_tensor_written_on_a_side_stream_is_reduced_after_it_is_written(hvd, torch_cuda):
    """The ready point is the submitting stream's, whichever it is: the
    collective waits for the work torch queued on it before the submission,
    even though the event is recorded later, on the background thread."""
    torch, thvd = torch_cuda
    side = torch.cuda.Stream()
    torch.cuda._sleep(1000)  # load the kernel first (loading can wait for the device)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        x = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(500_000_000)  # keeps the side stream busy
        x.mul_(3)  # queued behind it: the allreduce must read this
        handle = thvd.allreduce_async_(x, op=thvd.Sum, name="t.side")
        out = thvd.synchronize(handle)  # the side stream now waits for the result
        total = out.sum()
    torch.cuda.synchronize()
    assert out is x and total.item() == 3 * hvd.size() * (1 << 20)
