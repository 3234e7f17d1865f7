"""What a fragment's pipeline is doing now, for the notice of a compile that runs long.

The backend's notice (``backends/progress.py``) runs on a timer thread; the pipeline runs on the
compiling thread and says where it is::

    stage.say("the planner, call 3: recomputing only")      # on the compiling thread
    stage.now(thread_id)   # -> "the planner, call 3: recomputing only"   (on the timer thread)

One line per thread, replaced as the pipeline goes, dropped by :func:`clear`.
"""

from __future__ import annotations

import threading

__all__ = ["clear", "now", "say"]

_lock = threading.Lock()
_stages: dict[int, str] = {}


def say(text: str) -> None:
    """The compiling thread is now doing ``text``."""
    with _lock:
        _stages[threading.get_ident()] = text


def now(thread: int) -> str | None:
    """What thread ``thread`` said last (``None``: nothing since :func:`clear`)."""
    with _lock:
        return _stages.get(thread)


def clear() -> None:
    """This thread's compile is done."""
    with _lock:
        _stages.pop(threading.get_ident(), None)
