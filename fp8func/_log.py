"""``warn_once``: the one way the library says a thing once per process (a fallback, a missing
calibration), on the ``fp8func`` logger or one of its children."""

from __future__ import annotations

import logging

__all__ = ["warn_once", "forget"]

# what warn_once has said, by key: the one such record of the library
_SAID: set = set()


def warn_once(key, msg: str, *args, logger: str = "fp8func", level: int = logging.WARNING) -> bool:
    """Logs ``msg % args`` on ``logger`` the first time ``key`` (any hashable) comes; returns
    whether it logged."""
    if key in _SAID:
        return False
    _SAID.add(key)
    logging.getLogger(logger).log(level, msg, *args)
    return True


def forget(key=None) -> None:
    """Lets ``warn_once`` say ``key``'s message again (every message for None): for tests that
    read the log line."""
    if key is None:
        _SAID.clear()
    else:
        _SAID.discard(key)
