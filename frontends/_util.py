"""Helpers Horovod's frontends import from horovod.common.util, which some
programs and Horovod's own tests call through `hvd.`: the same names and
meanings, without Horovod's compiled extensions."""

import importlib


def gpu_available(ext_base_name, verbose=False):
    """Whether the framework `ext_base_name` names ("tensorflow", "torch",
    or Horovod's module names "horovod.tensorflow", "horovod.torch") can run
    on a GPU here; False for any other name or where it cannot be imported."""
    name = ext_base_name.rsplit(".", 1)[-1]
    try:
        if name == "tensorflow":
            return bool(importlib.import_module("tensorflow").config.list_physical_devices("GPU"))
        if name == "torch":
            return bool(importlib.import_module("torch").cuda.is_available())
    except Exception:
        return False
    return False


def check_extension(ext_name, ext_env_var, pkg_path, *args):
    """Horovod checks here that its compiled extension was built; nothing here
    is compiled against a framework, so there is nothing to check."""


def split_list(l, n):  # noqa: E741 (Horovod's parameter names)
    """`l` split into `n` chunks of sizes that differ by one at most, the
    longer ones first."""
    d, r = divmod(len(l), n)
    return [l[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def check_num_rank_power_of_2(num_rank):
    """Whether `num_rank` is a power of two (Adasum's requirement)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


class Basics:
    """Horovod's `mpi_ops._basics` (its HorovodBasics instance): a frontend's
    life-cycle and query functions as methods, and the private process-set
    calls Horovod's own tests and some programs make through it
    (`_get_process_set_ids_and_ranks`, `_comm_process_set_id`, ...)."""

    PUBLIC = ("init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
              "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
              "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
              "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
              "cuda_built", "rocm_built")

    def __init__(self, namespace):
        """namespace: the frontend module's globals (or any mapping) that
        holds its functions of those names."""
        from coordinator import basics

        for name in self.PUBLIC:
            setattr(self, name, namespace[name])
        self._add = namespace.get("add_process_set", basics.add_process_set)
        self._remove = namespace.get("remove_process_set", basics.remove_process_set)

    @staticmethod
    def _runtime():
        from coordinator import runtime

        rt = runtime.current()
        if rt is None or not rt.alive:
            raise ValueError("Horovod has not been initialized; use hvd.init().")
        return rt

    def _get_process_set_ids_and_ranks(self):
        """{process set id: its global ranks} of every registered set."""
        return {pid: ps.ranks for pid, ps in self._runtime().process_sets.all().items()}

    def _comm_process_set_id(self, comm):
        """The id of the registered set that holds the ranks of the mpi4py
        communicator `comm`."""
        rt = self._runtime()
        pid = rt.process_sets.id_of(rt.transport.ranks_of(comm))
        if pid is None:
            raise ValueError("MPI communicator does not correspond to any registered "
                             "process set.")
        return pid

    def _members(self, rt, process_set_id):
        ranks = rt.process_sets.members(int(process_set_id))
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return ranks

    def _process_set_size(self, process_set_id):
        return len(self._members(self._runtime(), process_set_id))

    def _process_set_rank(self, process_set_id):
        rt = self._runtime()
        ranks = self._members(rt, process_set_id)
        if rt.rank not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(rt.rank)

    def _add_process_set_impl(self, ranks):
        """Adds a set of `ranks` on every rank (all call it) and returns its
        id; None where a set of those ranks exists already."""
        rt = self._runtime()
        if rt.process_sets.id_of(list(ranks)) is not None:
            return None
        return self._add(list(ranks)).process_set_id

    def _remove_process_set_impl(self, process_set_id):
        """Removes the set `process_set_id` on every rank (all call it) and
        returns its id; None for the global set or an id not registered."""
        rt = self._runtime()
        ps = rt.process_sets.get(int(process_set_id))
        if not process_set_id or ps is None:
            return None
        return int(process_set_id) if self._remove(ps) else None


def num_rank_is_power_2(num_rank):
    """Horovod's other name for `check_num_rank_power_of_2`."""
    return check_num_rank_power_of_2(num_rank)


def get_average_backwards_compatibility_fun(reduce_ops):
    """Horovod's factory of `handle_average_backwards_compatibility(op,
    average)` for a module holding `Average` and `Sum` (the core's rule:
    `op` wins, both given is a ValueError, `average` alone warns and picks
    Average or Sum, neither gives Average)."""
    from coordinator import collectives

    def impl(op, average):
        if op is not None:
            return collectives.handle_average_backwards_compatibility(op, average)
        picked = collectives.handle_average_backwards_compatibility(None, average)
        return reduce_ops.Average if picked == collectives.Average else reduce_ops.Sum

    return impl
