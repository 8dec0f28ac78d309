"""AllreducePersistent: averages a model's float persistent values over ranks
(e.g. BatchNormalization's running mean and variance) before evaluation or
saving. Integer persistents (counters) are left alone."""

import numpy as np

import chainer
import chainer.training.extension
import coordinator as hvd
from coordinator import gpu
from frontends.chainer._checks import InvalidArgument


def _named_persistents(model):
    # ChainerMN asserts a chainer.Link; what is read of one is namedlinks().
    if not callable(getattr(model, "namedlinks", None)):
        raise InvalidArgument(f"AllreducePersistent: the model must be a chainer.Link, got "
                              f"{type(model).__name__}")
    for link_name, link in model.namedlinks():
        for name in link._persistent:
            yield f"{link_name}/{name}", link.__dict__[name]


class AllreducePersistent(chainer.training.extension.Extension):
    trigger = 1, "epoch"
    # Before the evaluators (PRIORITY_WRITER), so they see the averages.
    priority = chainer.training.extension.PRIORITY_WRITER + 1

    def __init__(self, model, comm):
        self.model = model
        self.comm = comm

    def __call__(self, trainer=None):
        pending = []
        for name, value in sorted(_named_persistents(self.model), key=lambda kv: kv[0]):
            # NumPy or CuPy arrays (on a GPU, CuPy's: skipping them left the
            # running statistics unaveraged).
            if (isinstance(value, np.ndarray) or gpu.is_device_array(value)) \
                    and value.dtype.kind == "f":
                writable = getattr(value.flags, "writeable", True)  # (CuPy's have none)
                out = value if value.flags.c_contiguous and writable else None
                handle = hvd.allreduce_async(value, op=hvd.Average,
                                             name=f"{self.comm._prefix}.persistent{name}",
                                             process_set=self.comm.process_set, output=out)
                pending.append((value, handle, out is None))
        for value, handle, copy_back in pending:
            result = hvd.synchronize(handle)
            if copy_back:
                value[...] = result
