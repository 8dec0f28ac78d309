"""backward_passes_per_step for a TensorFlow 1 optimizer: gradients summed
locally over N passes, reduced and applied on every N-th (Horovod's
LocalGradientAggregationHelper for tf.compat.v1.train.Optimizer).

Graphs only: the pass count lives in a variable the graph reads. Each
`compute_gradients` call adds the pass's gradients into accumulators and
counts the pass; on the N-th it reduces the sums (divided by N with
`average_aggregated_gradients`), clears them, restarts the count and returns
the reduced sums; on the passes between it returns that pass's own
gradients, unreduced. `apply_gradients` applies only on the N-th pass; on
the others it only advances `global_step`, so that the step still counts
passes, as in Horovod. The count and the accumulators are local variables
(tf.compat.v1.local_variables_initializer, which MonitoredTrainingSession
runs, sets them up): not saved with the model, not broadcast with the
global variables.
"""

import tensorflow as tf


def accumulable(grad, sparse_as_dense):
    """`grad` as a dense tensor that can be added into an accumulator."""
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` "
                             "> 1 and `sparse_as_dense` is False.")
        return tf.convert_to_tensor(grad)
    return grad


class LocalAggregation:
    """The accumulation state of one optimizer in the graph it was last
    used in."""

    def __init__(self, backward_passes_per_step, average_aggregated_gradients,
                 sparse_as_dense, name):
        self.passes = backward_passes_per_step
        self.average = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.name = name
        self.counter = None  # passes since the last reduction (a local variable)
        self.accumulators = []

    def _make_variables(self, variables, dtypes):
        with tf.init_scope(), tf.name_scope(f"{self.name}_aggregation"):
            local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
            self.counter = tf.compat.v1.Variable(0, trainable=False, collections=local,
                                                 name="counter")
            self.accumulators = [
                tf.compat.v1.Variable(tf.zeros(v.shape, dtype), trainable=False,
                                      collections=local, name="accumulator")
                for v, dtype in zip(variables, dtypes)]

    def compute_gradients(self, grads, variables, reduce):
        """This pass's gradients for `variables` (None stays None), reduced
        with `reduce(grads, variables)` on every N-th pass."""
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        dense = [accumulable(grads[i], self.sparse_as_dense) for i in present]
        mine = [variables[i] for i in present]
        self._make_variables(mine, [g.dtype for g in dense])
        adds = [acc.assign_add(g, read_value=False)
                for acc, g in zip(self.accumulators, dense)]
        with tf.control_dependencies(adds):
            count = self.counter.assign_add(1)

        def reduce_sums():
            sums = [acc.read_value() for acc in self.accumulators]
            reduced = reduce(sums, mine)
            if self.average:
                reduced = [r / tf.cast(self.passes, r.dtype) for r in reduced]
            with tf.control_dependencies(reduced):
                clear = [acc.assign(tf.zeros_like(acc), read_value=False)
                         for acc in self.accumulators]
                clear.append(self.counter.assign(0, read_value=False))
            with tf.control_dependencies(clear):
                return [tf.identity(r) for r in reduced]

        def this_pass():
            return [tf.identity(g) for g in dense]

        chosen = tf.nest.flatten(tf.cond(tf.equal(count, self.passes), reduce_sums, this_pass))
        out = [None] * len(grads)
        for i, g in zip(present, chosen):
            out[i] = g
        return out

    def apply_gradients(self, apply, grads_and_vars, global_step):
        """`apply()` on the N-th pass; else advances `global_step`. Runs
        after the gradients (and so after the pass was counted)."""
        if self.counter is None:
            raise ValueError("backward_passes_per_step > 1: call compute_gradients() (or "
                             "minimize()) before apply_gradients()")
        inputs = [t for g, _ in grads_and_vars if g is not None
                  for t in tf.nest.flatten(g, expand_composites=True)]
        with tf.control_dependencies(inputs):
            reduced_now = tf.equal(self.counter.read_value(), 0)

            def count_step():
                if global_step is None:
                    return tf.no_op()
                return global_step.assign_add(tf.ones([], global_step.dtype), read_value=False)

            done = tf.cond(reduced_now, apply, count_step)
        return done.op if isinstance(done, tf.Tensor) else done
