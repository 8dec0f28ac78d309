"""A steady training-like loop under HOROVOD_AUTOTUNE=1; rank 0 reports
what the tuner chose."""

import sys

import numpy as np

import coordinator as hvd
from coordinator import runtime

hvd.init()
grads = [np.ones(1000 * (i + 1), np.float32) for i in range(12)]
for step in range(int(sys.argv[1])):
    handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
    for i, h in enumerate(handles):
        assert hvd.synchronize(h)[0] == hvd.size()
tuner = runtime.current().background.autotuner
if hvd.rank() == 0:
    print(f"AUTOTUNE done={tuner.done} best={tuner.best}", flush=True)
hvd.shutdown()
