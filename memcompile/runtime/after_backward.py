"""Run code when a backward pass has returned to the Python that started it.

A loop without an optimizer has no hook after its backward: ``loss.backward()`` is the user's
call, and what autograd offers inside the pass (``Engine.queue_callback``, hooks) runs before
the engine restores the thread's state. A CPU profiler session stopped there is restored as
running when the pass returns ("Profiler is already enabled on this thread" at the next
``torch.profiler.profile``). So while something waits for a backward,
``torch.autograd._engine_run_backward`` (what ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` call) is wrapped::

    after_backward(fn)                     # fn waits on this thread
    loss.backward()                        # -> wrapper: the engine's pass, then, outermost
                                           #    call only (not a reentrant checkpoint's
                                           #    inner backward), fn() -> True: done
    cancel(fn)                             # or dropped before any backward came

Once nothing waits, the original function is back in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.autograd

__all__ = ["after_backward", "cancel", "waiting"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_local = threading.local()  # .waiting: list of callbacks; .depth: backward calls running
_waiting_threads = 0
_original: Callable[..., Any] | None = None


def _thread_waiting() -> list[Callable[[], bool]]:
    waiting = getattr(_local, "waiting", None)
    if waiting is None:
        waiting = _local.waiting = []
    return waiting


def _run_backward(*args: Any, **kwargs: Any) -> Any:
    original = _original
    if original is None:  # removed while a caller held the wrapper: the torch function
        original = torch.autograd.graph._engine_run_backward
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        return original(*args, **kwargs)
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            _after()


def _after() -> None:
    # Each waiting callback says whether the pass was the one it waited for (True: done).
    waiting = _thread_waiting()
    for fn in list(waiting):
        try:
            done = fn()
        except Exception:  # never fail the user's backward for memcompile's bookkeeping
            log.exception("memcompile: a callback after the backward failed")
            done = True
        if done:
            cancel(fn)


def after_backward(fn: Callable[[], bool]) -> None:
    """Call ``fn`` on this thread each time an outermost backward pass returns, until it returns
    True (or :func:`cancel`)."""
    global _waiting_threads, _original
    waiting = _thread_waiting()
    if fn in waiting:
        return
    with _lock:
        if not waiting:
            _waiting_threads += 1
        waiting.append(fn)
        if _original is None:
            _original = torch.autograd._engine_run_backward
            torch.autograd._engine_run_backward = _run_backward  # type: ignore[attr-defined]


def cancel(fn: Callable[[], bool]) -> None:
    """Stop waiting with ``fn`` (no-op when it does not wait)."""
    global _waiting_threads, _original
    waiting = _thread_waiting()
    if fn not in waiting:
        return
    with _lock:
        waiting.remove(fn)
        if not waiting:
            _waiting_threads -= 1
        # Put back only where it is still ours: a wrapper someone put over it since keeps
        # calling this one, which then only passes the call on.
        if (
            _waiting_threads == 0
            and _original is not None
            and torch.autograd._engine_run_backward is _run_backward
        ):
            torch.autograd._engine_run_backward = _original  # type: ignore[attr-defined]
            _original = None


def waiting() -> bool:
    """Whether anything waits for a backward on this thread."""
    return bool(_thread_waiting())
