"""Starting the coordinator from TensorFlow, and what the job looks like."""

import coordinator as core
from coordinator import basics as _core_basics


def init(comm=None, process_sets=None):
    """Starts the coordinator, or joins the one already running in this
    process (PyTorch and TensorFlow in one process share it). Calling it
    again is harmless, as in Horovod.

    comm: an mpi4py communicator or a list of global ranks (default: all).
    process_sets: ProcessSets to register now, or "dynamic"."""
    _core_basics.ensure_initialized(comm, process_sets)


def shutdown():
    """Stops the coordinator; collectives still in flight fail."""
    core.shutdown()


is_initialized = core.is_initialized
size = core.size
rank = core.rank
local_size = core.local_size
local_rank = core.local_rank
cross_size = core.cross_size
cross_rank = core.cross_rank
is_homogeneous = core.is_homogeneous
mpi_threads_supported = core.mpi_threads_supported


def start_timeline(file_path, mark_cycles=False):
    """Starts writing the coordinator's timeline (a Chrome trace) to
    `file_path`; rank 0 writes it."""
    core.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline():
    """Stops writing the timeline and closes the file."""
    core.stop_timeline()


# What this build holds: the core answers for every frontend.
mpi_built = core.mpi_built
mpi_enabled = core.mpi_enabled
gloo_built = core.gloo_built
gloo_enabled = core.gloo_enabled
nccl_built = core.nccl_built
ccl_built = core.ccl_built
ddl_built = core.ddl_built
cuda_built = core.cuda_built
rocm_built = core.rocm_built
