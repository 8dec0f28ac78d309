"""Elastic training: jobs that lose and gain workers as they run.

The framework-free part of Horovod's elastic API (horovod.common.elastic):
`State`, `ObjectState`, `run`, `HostsUpdatedInterrupt`. The frontends add
their states (`frontends.torch.elastic.TorchState`, ...) and `run`
decorators on top of these.

Launch with coordrun's elastic flags, e.g.

    coordrun -np 2 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \\
        python train.py

How it works: README, "Elastic training"; the pieces: state.py (states),
loop.py (the run decorator), membership.py (re-forming the job with ULFM and
MPI dynamic processes), worker.py (the worker's side of the driver),
driver.py and service.py (the driver and its gRPC service), hosts.py
(discovery and blacklisting), auth.py (the driver's authentication),
launch.py (coordrun's elastic path), spawned.py (how a spawned worker
starts).
"""

import os

# gRPC's fork handlers only log ("Other threads are currently calling into
# gRPC, skipping fork() handlers") when a process holding a channel forks, as
# the driver does for every discovery run and a worker for its data loaders;
# neither uses gRPC in the child. Read when grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from coordinator.elastic.loop import notification_manager, run, run_fn
from coordinator.elastic.membership import JobStoppedError
from coordinator.elastic.state import (HostsUpdatedInterrupt, HostUpdateResult, ObjectState,
                                       State, broadcast_object)

__all__ = ["State", "ObjectState", "run", "run_fn", "HostsUpdatedInterrupt",
           "HostUpdateResult", "JobStoppedError", "notification_manager", "broadcast_object"]
