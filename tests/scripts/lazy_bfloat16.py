"""bfloat16 loaded on first need, on 2 ranks through frontends.torch (run by
tests/test_dtypes.py). Neither rank imports ml_dtypes. Rank 0 reduces a
bfloat16 tensor while rank 1 has joined: rank 1 has never seen bfloat16 and
must make the zeros it contributes of that dtype from the wire alone. Then
both reduce bfloat16 together. Each rank prints what it saw."""

import sys

import torch

import frontends.torch as hvd

assert "ml_dtypes" not in sys.modules, "importing the frontend imported ml_dtypes"
hvd.init()
assert hvd.size() == 2, hvd.size()
me = hvd.rank()
assert "ml_dtypes" not in sys.modules, "init() imported ml_dtypes"

values = torch.tensor([1.5, -2.25, 3.0, 0.5], dtype=torch.bfloat16)
if me == 0:
    out = hvd.allreduce(values, op=hvd.Average, name="lazy.joined")
    # Average divides by the whole set; the joined rank gave zeros.
    assert out.dtype == torch.bfloat16 and out.tolist() == (values / 2).tolist(), out
    hvd.join()
else:
    hvd.join()
print(f"rank {me}: after join ml_dtypes loaded: {'ml_dtypes' in sys.modules}", flush=True)

out = hvd.allreduce(values * (me + 1), op=hvd.Sum, name="lazy.sum")
assert out.tolist() == (values * 3).tolist(), out
from coordinator import native  # noqa: E402
from coordinator.ops import mpi_reduce  # noqa: E402

bf16 = [dt for dt in native.KINDS if dt.name == "bfloat16"]
assert bf16 and bf16[0] in mpi_reduce._REDUCE_AS, (native.KINDS, mpi_reduce._REDUCE_AS)
print(f"rank {me}: bfloat16 kernels registered: {bool(bf16)}", flush=True)
hvd.shutdown()
