"""GPU tests. `make test-gpu` runs them at np=2 on the GPU machine (each rank
runs this pytest session and the tests call the collectives directly, in
the same order on every rank); plain `pytest tests/gpu` runs them at np=1.
Without CuPy or a CUDA device every test here is skipped, with the reason."""

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _why_not():
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return f"CuPy sees no CUDA device ({exc})"
    return None if count else "CuPy sees no CUDA device"


REASON = _why_not()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {REASON}")
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="session")
def hvd(cp):
    """The core, started once for the session (the torch frontend joins it);
    this rank's GPU is local_rank modulo the devices (2 ranks may share one)."""
    import coordinator as hvd
    from coordinator import basics

    basics.ensure_initialized()
    cp.cuda.Device(hvd.local_rank() % cp.cuda.runtime.getDeviceCount()).use()
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="session")
def torch_cuda(hvd):
    """torch and frontends.torch on this rank's GPU, or a skip with the reason."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import frontends.torch as thvd

    thvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch, thvd
