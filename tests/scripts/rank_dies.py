"""One rank dies mid-training (SIGKILL, or an uncaught exception); the others
must raise promptly and the job must end with a non-zero status."""

import os
import signal
import sys
import time

import numpy as np

import coordinator as hvd

MODE = sys.argv[1]  # "kill" or "raise"
VICTIM = int(sys.argv[2])

hvd.init()
for step in range(100000):
    if hvd.rank() == VICTIM and step == 20:
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ZeroDivisionError("simulated bug in rank's training code")
    hvd.allreduce(np.ones(1000), name="grad")
    time.sleep(0.005)
print(f"rank {hvd.rank()} FINISHED AS IF NOTHING HAPPENED", flush=True)
