"""Logging under HOROVOD_LOG_LEVEL, each line tagged with the rank."""

import logging
import sys

_LEVELS = {
    "trace": logging.DEBUG - 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}

logger = logging.getLogger("coordinator")


class _RankFilter(logging.Filter):
    rank = "?"

    def filter(self, record):
        record.rank = self.rank
        return True


_filter = _RankFilter()
_handler = None


def configure(config):
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.addFilter(_filter)
        logger.addHandler(_handler)
        logger.propagate = False
    fmt = "[%(rank)s] %(levelname)s coordinator: %(message)s"
    if not config.log_hide_time:
        fmt = "[%(asctime)s] " + fmt
    _handler.setFormatter(logging.Formatter(fmt))
    logger.setLevel(_LEVELS[config.log_level])


def set_rank(rank):
    _filter.rank = str(rank)
