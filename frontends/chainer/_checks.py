"""The error for arguments ChainerMN 7.8.1 refuses with a bare `assert`."""


class InvalidArgument(ValueError, AssertionError):
    """A bad argument (a root that is no rank, an interval that is not
    positive). ChainerMN checks these with `assert`, which raises a bare
    AssertionError (and nothing under `python -O`): code written for it that
    catches AssertionError still catches this. It is a ValueError too, as
    the coordinator's other refusals of bad values are, and says what was
    wrong."""


def check_root(what, root, size):
    """Raises InvalidArgument unless `root` is a rank of a communicator of
    `size` ranks (ChainerMN: `assert 0 <= root and root < comm.size`)."""
    if not 0 <= root < size:
        raise InvalidArgument(f"{what}: root {root} is not a rank of the communicator (its "
                              f"ranks are 0 to {size - 1})")
