"""Imports Chainer 7.8.1 on a current Python toolchain.

Chainer runs an environment check when imported (chainer/_environment_check.py):
it warns about Python 3.5.0, about macOS's Accelerate BLAS, and about CuPy or
iDeep versions, and to do so imports `pkg_resources` and `numpy.distutils`.
Setuptools 81 dropped `pkg_resources`, and from setuptools 74 on
`numpy.distutils` no longer imports (it wants `distutils.msvccompiler`), while
torch and grpcio-tools require setuptools >= 77. When those modules are
missing, the check cannot run at all, and Chainer refuses to import.

In that case, and only then, the check is skipped: an empty
`chainer._environment_check` is registered before Chainer is imported.
Nothing it checks applies here (Linux, Python 3.11, no CuPy or iDeep), and
Chainer itself never uses those modules at run time.
"""

import importlib.util
import sys
import types


def _module_missing(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def environment_check_can_run():
    return not (_module_missing("pkg_resources") or _module_missing("distutils.msvccompiler"))


def import_chainer():
    if "chainer" not in sys.modules and not environment_check_can_run():
        skipped = types.ModuleType("chainer._environment_check")
        skipped.__doc__ = ("Chainer's import-time environment check, skipped by "
                           "frontends.chainer: pkg_resources or numpy.distutils is missing.")
        skipped.check = lambda: None
        sys.modules["chainer._environment_check"] = skipped
    import chainer

    return chainer
