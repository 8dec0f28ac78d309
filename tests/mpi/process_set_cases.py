"""Process sets: static ones given to init(), dynamic ones added at run time."""

import numpy as np

from core_cases import assert_equal, expect_raises

EVEN = None


def setup(hvd):
    global EVEN
    import os

    EVEN = hvd.ProcessSet(range(0, int(os.environ["OMPI_COMM_WORLD_SIZE"]), 2))
    hvd.init(process_sets=[EVEN])


def case_process_set_api(hvd):
    me = hvd.rank()
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.size() == hvd.size()
    assert EVEN.process_set_id == 1
    assert EVEN.ranks == list(range(0, hvd.size(), 2))
    assert EVEN.size() == len(EVEN.ranks)
    assert EVEN.included() == (me % 2 == 0)
    if me % 2 == 0:
        assert EVEN.rank() == me // 2
    else:
        expect_raises(ValueError, EVEN.rank)


def case_collectives_on_a_static_set_involve_only_members(hvd):
    me = hvd.rank()
    if me % 2:
        exc = expect_raises(ValueError, hvd.allreduce, np.ones(2), name="even.sum",
                            process_set=EVEN)
        assert "not a member" in str(exc)
        return
    members = EVEN.ranks
    out = hvd.allreduce(np.full(3, me + 1.0), op=hvd.Sum, name="even.sum", process_set=EVEN)
    assert_equal(out, np.full(3, sum(r + 1.0 for r in members)))
    avg = hvd.allreduce(np.full(2, float(me)), name="even.avg", process_set=EVEN)
    assert_equal(avg, np.full(2, sum(members) / len(members)))
    gathered = hvd.allgather(np.full((1,), me, np.int32), name="even.gather", process_set=EVEN)
    assert_equal(gathered, np.array(members, np.int32))
    root = members[-1]
    b = hvd.broadcast(np.full(2, me, np.int64), root_rank=root, name="even.bcast",
                      process_set=EVEN)
    assert_equal(b, np.full(2, root, np.int64))
    rs = hvd.reducescatter(np.ones((len(members), 2)), op=hvd.Sum, name="even.rs",
                           process_set=EVEN)
    assert_equal(rs, np.full((1, 2), float(len(members))))
    a2a = hvd.alltoall(np.full(len(members), me, np.int16), name="even.a2a", process_set=EVEN)
    assert_equal(a2a, np.array(members, np.int16))
    hvd.barrier(process_set=EVEN)


def case_interleaved_sets_do_not_deadlock(hvd):
    me = hvd.rank()
    handles = []
    for i in range(10):
        handles.append(("g", i, hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum,
                                                     name=f"mix.g.{i}")))
        if me % 2 == 0:
            handles.append(("e", i, hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum,
                                                         name=f"mix.e.{i}", process_set=EVEN)))
    for kind, i, h in handles:
        expected = hvd.size() if kind == "g" else EVEN.size()
        assert_equal(hvd.synchronize(h), np.full(2, float(expected)), f"{kind}.{i}")


def case_dynamic_sets_need_to_be_enabled(hvd):
    exc = expect_raises(ValueError, hvd.add_process_set, [0])
    assert "HOROVOD_DYNAMIC_PROCESS_SETS" in str(exc)
