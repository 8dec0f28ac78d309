"""Checks a frontend's signature against Horovod's (tests/test_torch.py,
tests/test_tensorflow_api.py)."""

import inspect

REQUIRED = object()
# Defaults that name a frontend's own objects.
GPS, NONE, AVG = "global_process_set", "Compression.none", "Average"


def check_signature(fn, expected, hvd, skip_first=False):
    """`fn`'s parameters (but *args and **kwargs; `skip_first`: self) begin
    with `expected`, [(name, default)], in order, a default being REQUIRED,
    a value, or GPS, NONE or AVG for `hvd`'s; any further ones are optional."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if skip_first:
        params = params[1:]
    got = [(p.name, REQUIRED if p.default is p.empty else p.default) for p in params]
    assert [n for n, _ in got[:len(expected)]] == [n for n, _ in expected], got
    own = {GPS: hvd.global_process_set, NONE: hvd.Compression.none, AVG: hvd.Average}
    for (pname, default), (_, want) in zip(got, expected):
        want = own.get(want, want) if isinstance(want, str) else want
        assert default is want or default == want, (pname, default, want)
    for pname, default in got[len(expected):]:  # extras must be optional
        assert default is not REQUIRED, pname
