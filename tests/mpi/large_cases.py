"""Tensors just past 2**31 elements and bytes, at np=2 (run by
tests/test_large_mpi.py). MPI's count arguments are C ints; every op must
still move such a tensor, and move it right. Each case frees its buffers
before the next: a case holds about 4-5 GiB per rank."""

import gc

import numpy as np

from core_cases import expect_raises  # noqa: F401  (shared helpers)

LIMIT = 2 ** 31
CHUNK = 1 << 28


def _filled(n, value, dtype=np.uint8):
    out = np.empty(n, dtype)
    out.fill(value)
    return out


def _all_equal(arr, value, what):
    flat = arr.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        part = flat[start:start + CHUNK]
        if not (part == value).all():
            bad = start + int(np.argmax(part != value))
            raise AssertionError(f"{what}: element {bad} is {flat[bad]}, expected {value}")


def case_broadcast_past_two_gib(hvd):
    n = LIMIT + 16
    me = hvd.rank()
    tensor = _filled(n, 7 if me == 0 else 0)
    tensor[-1] = 9 if me == 0 else 0
    out = hvd.broadcast(tensor, root_rank=0, name="big.bcast")
    assert out.shape == (n,)
    _all_equal(out[:-1], 7, "broadcast")
    assert out[-1] == 9
    del tensor, out
    gc.collect()


def case_allreduce_past_two_g_elements(hvd):
    n = LIMIT + 16
    me = hvd.rank()
    tensor = _filled(n, me + 1, np.int8)
    tensor[-1] = 10 * (me + 1)
    out = hvd.allreduce(tensor, op=hvd.Sum, name="big.sum")
    size = hvd.size()
    _all_equal(out[:-1], size * (size + 1) // 2, "allreduce")
    assert out[-1] == 10 * size * (size + 1) // 2
    del tensor, out
    gc.collect()


def case_allgather_past_two_gib_in_total(hvd):
    rows = LIMIT // hvd.size() + 8
    me = hvd.rank()
    tensor = _filled(rows, me + 3)
    out = hvd.allgather(tensor, name="big.gather")
    assert out.shape == (rows * hvd.size(),)
    for r in range(hvd.size()):
        _all_equal(out[r * rows:(r + 1) * rows], r + 3, f"allgather block {r}")
    del tensor, out
    gc.collect()


def case_alltoall_past_two_gib(hvd):
    size, me = hvd.size(), hvd.rank()
    per = LIMIT // size + 8
    tensor = np.empty(per * size, np.uint8)
    for dest in range(size):
        tensor[dest * per:(dest + 1) * per].fill(10 * me + dest)
    out = hvd.alltoall(tensor, name="big.a2a")
    assert out.shape == (per * size,)
    for src in range(size):
        _all_equal(out[src * per:(src + 1) * per], 10 * src + me, f"alltoall from {src}")
    del tensor, out
    gc.collect()


def case_reducescatter_past_two_g_elements(hvd):
    size, me = hvd.size(), hvd.rank()
    n = LIMIT + 2 * size
    tensor = _filled(n, me + 1, np.int8)
    out = hvd.reducescatter(tensor, op=hvd.Sum, name="big.rs")
    assert out.shape == (n // size,)
    _all_equal(out, size * (size + 1) // 2, "reducescatter")
    del tensor, out
    gc.collect()
