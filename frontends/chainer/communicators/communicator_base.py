"""The interface every ChainerMN communicator offers.

ChainerMN names its methods after MPI: array methods (`bcast`, `gather`,
`allreduce`, ...) take NumPy arrays, `_obj` methods take any picklable Python
object, and `bcast_data` / `multi_node_mean_grad` act on a model's
parameters. Code written against this class runs with any communicator.
"""

import abc
import contextlib
import warnings


class CommunicatorBase(abc.ABC):
    """What a ChainerMN communicator must provide."""

    # ------------------------------------------------------------ topology
    @property
    @abc.abstractmethod
    def rank(self):
        """This process's rank in the communicator."""

    @property
    @abc.abstractmethod
    def size(self):
        """Number of processes in the communicator."""

    @property
    @abc.abstractmethod
    def intra_rank(self):
        """This process's rank among the communicator's processes on its host."""

    @property
    @abc.abstractmethod
    def intra_size(self):
        """Number of the communicator's processes on this host."""

    @property
    @abc.abstractmethod
    def inter_rank(self):
        """Index of this host among the communicator's hosts."""

    @property
    @abc.abstractmethod
    def inter_size(self):
        """Number of hosts the communicator spans."""

    @abc.abstractmethod
    def split(self, color, key):
        """Like MPI_Comm_split: processes with the same color form a new
        communicator, ranked by key (ties broken by the current rank)."""

    # -------------------------------------------------------------- arrays
    @abc.abstractmethod
    def send(self, data, dest, tag):
        """Sends an array, or a tuple of arrays, to rank `dest`."""

    @abc.abstractmethod
    def recv(self, source, tag):
        """Receives what rank `source` sent with `send` (array or tuple)."""

    @abc.abstractmethod
    def bcast(self, x, root=0):
        """Returns root's array on every rank (other ranks' `x` is ignored)."""

    @abc.abstractmethod
    def gather(self, x, root=0):
        """Returns, on root, a tuple of every rank's array; None elsewhere."""

    @abc.abstractmethod
    def allgather(self, x):
        """Returns a tuple of every rank's array, on every rank."""

    @abc.abstractmethod
    def allreduce(self, x):
        """Returns the element-wise sum of every rank's array."""

    @abc.abstractmethod
    def scatter(self, xs, root=0):
        """Root holds one array per rank (a tuple, or an array whose first
        axis has `size` entries); rank i receives the i-th."""

    @abc.abstractmethod
    def alltoall(self, xs):
        """Each rank holds `size` arrays; rank j receives the j-th array of
        every rank, as a tuple ordered by sender."""

    # ------------------------------------------------------------- objects
    @abc.abstractmethod
    def send_obj(self, obj, dest, tag=0):
        """Sends a picklable object to rank `dest`."""

    @abc.abstractmethod
    def recv_obj(self, source, status=None, tag=None):
        """Receives an object sent by `send_obj` from `source`."""

    @abc.abstractmethod
    def bcast_obj(self, obj, max_buf_len=None, root=0):
        """Returns root's object on every rank."""

    @abc.abstractmethod
    def gather_obj(self, obj, root=0):
        """Returns, on root, the list of every rank's object; None elsewhere."""

    @abc.abstractmethod
    def allreduce_obj(self, obj):
        """Returns the sum (`+`) of every rank's object, on every rank."""

    # ---------------------------------------------------------- model data
    @abc.abstractmethod
    def bcast_data(self, model):
        """Overwrites every initialised parameter of `model` with rank 0's."""

    def broadcast_data(self, model):
        """Older name of `bcast_data`."""
        self.bcast_data(model)

    @abc.abstractmethod
    def multi_node_mean_grad(self, model, zero_fill=False):
        """Replaces each parameter's gradient by its mean over the ranks.

        zero_fill: a parameter whose data is set but whose gradient is None
        (unused in this step) takes part with zeros; without it such
        parameters are skipped, so every rank must leave the same ones out."""

    def allreduce_grad(self, model, zero_fill=False):
        """Deprecated name of `multi_node_mean_grad` (ChainerMN v7)."""
        warnings.warn("allreduce_grad() is deprecated; use multi_node_mean_grad()",
                      DeprecationWarning, stacklevel=2)
        self.multi_node_mean_grad(model, zero_fill)

    # -------------------------------------------------------------- config
    def set_config(self, name, value=True, **kwargs):
        raise ValueError(f"unknown communicator config {name!r}")

    def get_config(self, name=None):
        """The configs recorded by `config_scope` ({} when none): all of
        them as a dict when `name` is None."""
        configs = self.__dict__.get("_configs", {})
        if name is None:
            return dict(configs)
        if name not in configs:
            raise ValueError(f"unknown communicator config {name!r}")
        return configs[name]

    @property
    def within_config_scope(self):
        """True inside `with self.config_scope():`."""
        return self.__dict__.get("_within_config_scope", False)

    @contextlib.contextmanager
    def config_scope(self):
        """For communicators written on this class, as in ChainerMN: every
        attribute set inside `with self.config_scope():` is also recorded as
        a config that `get_config` returns. (ChainerMN kept them in one dict
        shared by every communicator; here each keeps its own.)"""
        outer = self.within_config_scope
        object.__setattr__(self, "_within_config_scope", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_within_config_scope", outer)

    def __setattr__(self, name, value):
        if self.within_config_scope:
            self.__dict__.setdefault("_configs", {})[name] = value
        super().__setattr__(name, value)

    def finalize(self):
        """Releases the communicator's resources; it cannot be used after."""
