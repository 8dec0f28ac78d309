"""One rank dies mid-training (SIGKILL, or an uncaught exception); the others
must raise promptly and the job must end with a non-zero status.

Modes:
  kill        the victim's training loop kills itself between two steps;
  raise       it raises an uncaught exception there;
  collective  it kills itself inside the coordinator, just as it starts a
              collective the others are already running (a test hook wraps
              its backend), so that the others' collective fails under
              them. Each survivor prints what its training loop saw,
              `RANK r: <ExceptionType>: <message>`, and leaves it in a
              file of REPORTS_DIR (the launcher may drop what a process
              printed last as the job ends); it raises once every survivor has (10 s at
              most), so that no survivor's exit ends the job before the
              others have had their say.
"""

import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peers  # noqa: E402

import coordinator as hvd  # noqa: E402
from coordinator import runtime  # noqa: E402

MODE = sys.argv[1]
VICTIM = int(sys.argv[2])
DIE_AT = 20


hvd.init()
if MODE == "collective" and hvd.rank() == VICTIM:
    bg = runtime.current().background
    bg.ops = peers.BeforeNthOperation(bg.ops, DIE_AT,
                                      lambda: os.kill(os.getpid(), signal.SIGKILL))
for step in range(100000):
    if hvd.rank() == VICTIM and step == DIE_AT and MODE != "collective":
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ZeroDivisionError("simulated bug in rank's training code")
    try:
        hvd.allreduce(np.ones(1 << 16), name="grad")
    except hvd.HorovodInternalError as exc:
        peers.survivor_says(os.environ.get("REPORTS_DIR"), hvd.rank(), hvd.size(), VICTIM,
                            exc, 10)
        raise
    time.sleep(0.005)
print(f"rank {hvd.rank()} FINISHED AS IF NOTHING HAPPENED", flush=True)
