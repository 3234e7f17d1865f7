"""Dynamo's compile start and end callbacks, kept registered across ``torch._dynamo.reset()``.

``torch._dynamo.reset()`` clears every callback registered with Dynamo's ``callback_handler``.
memcompile's (the pinned placeholders, runtime/pinned.py; the unwrapped tensor reads,
runtime/scalar_reads.py; the compiler's attach at a frame's start, backends/compiler.py) must be
there whenever Dynamo starts on a frame, also when no memcompile code runs before that
(``torch.compile(model, backend="memcompile")`` after a reset, on a model whose only frame falls
back: the backend is never called). So the one idempotent call here registers them and keeps
them: ``callback_handler.clear`` is wrapped once to register them again right after it clears,
as importing memcompile did in a fresh process::

    ensure_compile_callbacks(_on_compile_start, _on_compile_end)   # a list lookup when kept
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._dynamo.callback import callback_handler

__all__ = ["ensure_compile_callbacks"]

Callback = Callable[[Any], None]

# The (start, end) pairs registered so far: registered again after each clear.
_kept: list[tuple[Callback, Callback | None]] = []


def _register(start: Callback, end: Callback | None) -> None:
    if start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(start)
    if end is not None and end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(end)


def _clear_and_keep(clear: Callable[[], None]) -> Callable[[], None]:
    def clear_and_keep() -> None:
        clear()
        for start, end in _kept:
            _register(start, end)

    clear_and_keep._memcompile = True  # type: ignore[attr-defined]
    return clear_and_keep


def ensure_compile_callbacks(start: Callback, end: Callback | None = None) -> None:
    """Register ``start`` (and ``end``) with Dynamo's compile callbacks unless they are there,
    and again after each ``torch._dynamo.reset()``."""
    if (start, end) in _kept:
        return
    _kept.append((start, end))
    _register(start, end)
    if not getattr(callback_handler.clear, "_memcompile", False):
        callback_handler.clear = _clear_and_keep(callback_handler.clear)  # type: ignore[method-assign]
