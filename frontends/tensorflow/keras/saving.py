"""load_model: a saved Keras model, with its optimizer made distributed.

Keras 3 saves a built-in optimizer under its public name (keras.optimizers.SGD)
and does not consult `custom_objects` for it, so Horovod's trick of mapping
optimizer names to wrapping factories does not apply. Instead the model is
loaded as saved, optimizer state included, and the loaded optimizer object
is then turned into a DistributedOptimizer in place: same object, same
variables, same state.
"""

import keras

from frontends.tensorflow.compression import Compression
from frontends.tensorflow.keras.optimizer import make_distributed_in_place
from frontends.tensorflow.sync_batch_norm import SyncBatchNormalization


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Loads a model saved by Keras (.keras) and wraps its optimizer, with its
    saved state, in a DistributedOptimizer using `compression`.

    custom_optimizers: optimizer classes the file may use besides Keras'.
    custom_objects: as for keras.models.load_model.
    legacy_opts: Keras 3 has no legacy optimizers; must be False."""
    if legacy_opts:
        raise ValueError("legacy_opts=True: Keras 3 has no keras.optimizers.legacy "
                         "optimizers")
    objects = {"SyncBatchNormalization": SyncBatchNormalization}
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        make_distributed_in_place(optimizer, compression=compression)
    return model
