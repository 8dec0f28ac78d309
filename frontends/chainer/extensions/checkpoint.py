"""create_multi_node_checkpointer: per-rank generational snapshots, resumed
at the newest iteration that every rank saved.

Each rank writes '<name>.<rank>.<iteration>' (atomically: a temporary file,
then a rename) under `path` (default: the trainer's out directory). Every
`gc_interval` snapshots beyond `cp_interval`, the ranks agree on the
iterations all of them hold and delete the others, keeping the newest
`cp_interval`. `maybe_load` finds the newest iteration common to all ranks
and loads it. When training ends without error the snapshots are removed;
after an error they are kept for the restart.
"""

import os
import tempfile
import time

import chainer
from chainer.training import extension
from frontends.chainer._checks import InvalidArgument


class _Timings:
    def __init__(self):
        self.durations = []

    def report(self):
        if not self.durations:
            return "No stats available"
        d = self.durations
        return (f"Snapshot duration stats (sec): avg={sum(d) / len(d):f}, "
                f"min={min(d):f}, max={max(d):f}")


class _MultiNodeCheckpointer(extension.Extension):
    def __init__(self, name, comm, cp_interval, gc_interval, path):
        if not name or "." in name:
            raise InvalidArgument("checkpointer name must be non-empty and contain no '.', "
                                  f"got {name!r}")
        if cp_interval <= 0 or gc_interval <= 0:
            raise InvalidArgument("cp_interval and gc_interval must be positive")
        self.name = name
        self.comm = comm
        self.cp_interval = cp_interval
        self.gc_interval = gc_interval
        self.path = path
        self.files = []
        self.stats = _Timings()
        self._failed = False
        if path is not None:
            os.makedirs(path, exist_ok=True)

    def __call__(self, trainer):
        if self.path is None:
            self.path = trainer.out
        self.save(trainer, trainer.updater.iteration)

    def _filename(self, iteration):
        return f"{self.name}.{self.comm.rank}.{iteration}"

    def _parse(self, filename):
        parts = filename.split(".")
        if len(parts) != 3 or parts[0] != self.name:
            return None
        try:
            return int(parts[1]), int(parts[2])
        except ValueError:
            return None

    def save(self, target, iteration):
        """Snapshots `target` (usually the trainer). Every rank calls this at
        the same iteration."""
        os.makedirs(self.path, exist_ok=True)
        filename = self._filename(iteration)
        begin = time.time()
        fd, tmp = tempfile.mkstemp(prefix=f"tmp-{filename}", dir=self.path)
        os.close(fd)
        try:
            chainer.serializers.save_npz(tmp, target)
            os.replace(tmp, os.path.join(self.path, filename))
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        self.stats.durations.append(time.time() - begin)
        self.files.append(filename)
        if len(self.files) >= self.cp_interval + self.gc_interval:
            self._sync_file_list(remove_others=True)

    def _common_iterations(self):
        mine = {it for rank, it in filter(None, map(self._parse, self.files))}
        everyone = self.comm._allgather_obj(sorted(mine), self.comm._name("checkpoint"))
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        return sorted(common)[-self.cp_interval:]

    def _sync_file_list(self, remove_others=False):
        keep = [self._filename(it) for it in self._common_iterations()]
        if remove_others:
            for f in set(self.files) - set(keep):
                try:
                    os.remove(os.path.join(self.path, f))
                except OSError:
                    pass
        self.files = keep

    def maybe_load(self, trainer, optimizer=None, path=None):
        """Loads the newest snapshot every rank holds into `trainer`, if any
        (trainer.updater.iteration then says where training resumes). Call
        it on every rank after all extensions with state are registered."""
        if self.path is None:
            self.path = path if path is not None else trainer.out
        try:
            local = os.listdir(self.path)
        except OSError:
            local = []
        self.files = [f for f in local
                      if (p := self._parse(f)) is not None and p[0] == self.comm.rank]
        self._sync_file_list()
        if self.files:
            latest = self._common_iterations()[-1]
            chainer.serializers.load_npz(os.path.join(self.path, self._filename(latest)),
                                         trainer)
            return latest
        return None

    def on_error(self, trainer, exc, tb):
        self._failed = True

    def finalize(self):
        """Removes this rank's snapshots, unless training failed."""
        if self._failed or self.path is None:
            return
        for f in self.files:
            try:
                os.remove(os.path.join(self.path, f))
            except OSError:
                pass
        self.files = []

    def get_stats(self):
        return self.stats.report()


def create_multi_node_checkpointer(name, comm, cp_interval=5, gc_interval=5, path=None):
    """A trainer extension saving per-rank snapshots (see the module
    docstring). Before trainer.run(), call `checkpointer.maybe_load(trainer,
    optimizer)` on every rank to resume from the newest common snapshot."""
    return _MultiNodeCheckpointer(name, comm, cp_interval, gc_interval, path)
