"""horovodrun's --config-file: a YAML file of settings, by section.

    params:            {fusion_threshold_mb, cycle_time_ms, cache_capacity,
                        hierarchical_allreduce, torus_allreduce}
    autotune:          {enabled, log_file, warmup_samples, steps_per_sample}
    timeline:          {filename, mark_cycles}
    stall_check:       {enabled, warning_time_seconds, shutdown_time_seconds}
    library_options:   {num_nccl_streams, thread_affinity}
    logging:           {level, with_timestamp}
    controller:        mpi  (gloo is refused, unless --mpi is given)

Flags given on the command line win over the file. Keys horovodrun knows
that have no meaning here (hierarchical_allgather, mpi_threads_disable,
gloo_timeout_seconds, the autotune's Bayesian optimisation knobs) are
accepted and named on stderr, as their flags are (run.IGNORED_FLAGS);
ccl_bgt_affinity is accepted silently. Sections and keys horovodrun does not
read are named on stderr and skipped, as horovodrun skips them. Booleans may
be written 1 and 0, and the level WARN, as horovodrun passes them on.
The file is read with PyYAML when it is installed, otherwise with a small
reader for the nested mappings of scalars such files hold (block or
{flow} style, with or without a leading ---).
"""

import math
import sys

# section -> {key: (args attribute, kind)}
SECTIONS = {
    "params": {
        "fusion_threshold_mb": ("fusion_threshold_mb", float),
        "cycle_time_ms": ("cycle_time_ms", float),
        "cache_capacity": ("cache_capacity", int),
        "hierarchical_allreduce": ("hierarchical_allreduce", bool),
        "torus_allreduce": ("torus_allreduce", bool),
        "hierarchical_allgather": ("hierarchical_allgather", bool),
    },
    "autotune": {
        "enabled": ("autotune", bool),
        "log_file": ("autotune_log_file", str),
        "warmup_samples": ("autotune_warmup_samples", int),
        "steps_per_sample": ("autotune_steps_per_sample", int),
        "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples", int),
        "gaussian_process_noise": ("autotune_gaussian_process_noise", float),
    },
    "timeline": {
        "filename": ("timeline_filename", str),
        "mark_cycles": ("timeline_mark_cycles", bool),
    },
    "stall_check": {
        "enabled": ("no_stall_check", "not-bool"),
        "warning_time_seconds": ("stall_check_warning_time_seconds", float),
        "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", float),
    },
    "library_options": {
        "num_nccl_streams": ("num_nccl_streams", int),
        "mpi_threads_disable": ("mpi_threads_disable", bool),
        "thread_affinity": ("thread_affinity", "cores"),
        "ccl_bgt_affinity": (None, int),
        "gloo_timeout_seconds": ("gloo_timeout_seconds", int),
    },
    "logging": {
        "level": ("log_level", "level"),
        "with_timestamp": ("log_with_timestamp", bool),
    },
}


def load(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--config-file {path}: {exc.strerror}") from None
    try:
        import yaml
    except ImportError:
        data = parse_simple_yaml(text, path)
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--config-file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config-file {path}: the file holds no mapping of sections")
    return data


def _scalar(text):
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_simple_yaml(text, path="<config>"):
    """Nested mappings of scalars, indented with spaces; # comments."""
    root = {}
    stack = [(-1, root)]
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        indent = len(line) - len(line.lstrip(" "))
        key, sep, value = line.strip().partition(":")
        if not sep or not key:
            raise ValueError(f"--config-file {path}:{number}: {raw.strip()!r} is not "
                             "'key: value'")
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        if value.strip().startswith("{"):
            parent[key.strip()] = _flow_mapping(value.strip(), f"{path}:{number}")
        elif value.strip():
            parent[key.strip()] = _scalar(value)
        else:
            child = {}
            parent[key.strip()] = child
            stack.append((indent, child))
    return root


def _flow_mapping(text, where):
    """`{a: 1, b: x}`: a mapping of scalars written on one line."""
    if not text.endswith("}"):
        raise ValueError(f"--config-file {where}: {text!r} is not a {{key: value, ...}} "
                         "mapping")
    mapping = {}
    for item in filter(None, (part.strip() for part in text[1:-1].split(","))):
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            raise ValueError(f"--config-file {where}: {item!r} is not 'key: value'")
        mapping[key.strip()] = _scalar(value)
    return mapping


def _convert(value, kind, where):
    if kind in (bool, "not-bool"):
        if isinstance(value, int) and not isinstance(value, bool):
            value = value > 0  # horovodrun passes 1 and 0 on, read as numbers
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} is not true or false")
        return (not value) if kind == "not-bool" else value
    if kind == "cores":
        from coordinator.config import parse_cores

        return ",".join(str(c) for c in parse_cores(str(value)))
    if kind == "level":
        from coordinator.config import LOG_LEVEL_ALIASES
        from coordinator.run import LOG_LEVELS

        value = str(value).lower()
        value = LOG_LEVEL_ALIASES.get(value, value)
        if value not in LOG_LEVELS:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(LOG_LEVELS)}")
        return value
    if kind is str:
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {value!r} is not a number")
    if kind is int and float(value) != int(value):
        raise ValueError(f"{where}: {value!r} is not an integer")
    value = kind(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {value!r} must be a number >= 0")
    return value


def apply(args, config, explicit=()):
    """Sets the attributes of `args` the file gives, except those in
    `explicit` (flags given on the command line)."""
    for section, values in config.items():
        if section == "controller":
            if getattr(args, "use_mpi", False):
                continue  # --mpi on the command line wins, as in horovodrun
            if str(values).lower() == "gloo":
                raise ValueError("--config-file: controller gloo: this coordinator runs over "
                                 "MPI (and NCCL), not Gloo")
            if str(values).lower() != "mpi":
                raise ValueError(f"--config-file: no such controller: {values!r}")
            continue
        known = SECTIONS.get(section)
        if known is None:
            _skipped(f"section {section!r} (read: {', '.join(sorted(SECTIONS))}, controller)")
            continue
        if not isinstance(values, dict):
            raise ValueError(f"--config-file: section {section!r} must be a mapping")
        for key, value in values.items():
            if key not in known:
                _skipped(f"key {section}.{key}")
                continue
            dest, kind = known[key]
            if dest is None or value is None or dest in explicit:
                continue
            setattr(args, dest, _convert(value, kind, f"--config-file {section}.{key}"))


def _skipped(what):
    print(f"coordrun: --config-file: {what} is not a horovodrun setting; skipped",
          file=sys.stderr)
