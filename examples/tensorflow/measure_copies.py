"""What moving a tensor through the TensorFlow frontend costs, per MB.

    python examples/tensorflow/measure_copies.py        (one process is enough)

Prints, for float32 tensors of a few sizes, the time of:
- the copies the frontend avoids: `tensor.numpy()` and `tf.convert_to_tensor`
  of a NumPy array (what a naive bridge pays on the way in and out);
- the core's allreduce on NumPy arrays, into a preallocated output and into
  one it allocates (a fresh result buffer costs its first-touch page faults);
- the frontend's own eager allreduce and allreduce inside a tf.function (each
  result is a fresh buffer TensorFlow adopts; the overhead over the core's
  allocating allreduce is the frontend's);
- the naive bridge: `.numpy()`, core allreduce, `tf.convert_to_tensor`.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import coordinator as core  # noqa: E402
import frontends.tensorflow as hvd  # noqa: E402


def timed(fn, repeat):
    fn()
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best.append((time.perf_counter() - start) / repeat)
    return min(best)


def main():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    small = tf.ones([1])
    graph_small = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))
    fixed = [timed(lambda: core.allreduce(np.ones(1, np.float32), op=core.Sum, name="c1"),
                   2000),
             timed(lambda: hvd.allreduce(small, op=hvd.Sum), 2000),
             timed(lambda: graph_small(small), 2000)]
    print("one float, us per call: core {:.1f}  eager {:.1f}  tf.function {:.1f}".format(
        *[t * 1e6 for t in fixed]))
    print(f"{'MB':>4} {'.numpy()':>10} {'convert':>10} {'core/out':>10} {'core':>10} "
          f"{'eager':>10} {'tf.function':>12} {'naive':>10}   (us per MB)")
    for mb in (1, 16, 64):
        n = mb * 1024 * 1024 // 4
        tensor = tf.random.uniform([n])
        array = tensor.numpy()
        output = np.empty_like(array)
        repeat = max(3, 64 // mb)

        graph_allreduce = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))

        def naive():
            result = core.allreduce(tensor.numpy(), op=core.Sum, name="naive")
            return tf.convert_to_tensor(result)

        row = [timed(lambda: tensor.numpy(), repeat),
               timed(lambda: tf.convert_to_tensor(array), repeat),
               timed(lambda: core.allreduce(array, op=core.Sum, name="core", output=output),
                     repeat),
               timed(lambda: core.allreduce(array, op=core.Sum, name="core.alloc"), repeat),
               timed(lambda: hvd.allreduce(tensor, op=hvd.Sum), repeat),
               timed(lambda: graph_allreduce(tensor), repeat),
               timed(naive, repeat)]
        print(f"{mb:>4} " + " ".join(f"{t / mb * 1e6:>10.1f}" for t in row[:5])
              + f" {row[5] / mb * 1e6:>12.1f} {row[6] / mb * 1e6:>10.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
