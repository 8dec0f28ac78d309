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
