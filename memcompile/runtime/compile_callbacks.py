"""Dynamo's compile start and end callbacks, registered where they went missing.

``torch._dynamo.reset()`` clears every callback registered with Dynamo's ``callback_handler``,
so memcompile's (the pinned placeholders, runtime/pinned.py; the unwrapped tensor reads,
runtime/scalar_reads.py; the compiler's attach at a frame's start, backends/compiler.py) are
registered again before each use, by the one idempotent call here::

    ensure_compile_callbacks(_on_compile_start, _on_compile_end)   # two list lookups when there

The compiler's attach must also be there when no memcompile code runs before Dynamo starts on
a frame (``torch.compile(model, backend="memcompile")`` after a reset, on a model whose only
frame falls back: the backend is never called), so :func:`keep_after_reset` registers it again
right after ``callback_handler.clear()``, as importing memcompile did in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._dynamo.callback import callback_handler

__all__ = ["ensure_compile_callbacks", "keep_after_reset"]


def ensure_compile_callbacks(
    start: Callable[[Any], None], end: Callable[[Any], None] | None = None
) -> None:
    """Register ``start`` (and ``end``) with Dynamo's compile callbacks unless they are there."""
    if start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(start)
    if end is not None and end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(end)


_kept: list[Callable[[Any], None]] = []


def keep_after_reset(start: Callable[[Any], None]) -> None:
    """Register ``start`` now and again after each ``torch._dynamo.reset()`` (which clears
    Dynamo's callbacks): ``callback_handler.clear`` is wrapped once."""
    ensure_compile_callbacks(start)
    if start in _kept:
        return
    _kept.append(start)
    if getattr(callback_handler.clear, "_memcompile", False):
        return
    clear = callback_handler.clear

    def clear_and_keep() -> None:
        clear()
        for fn in _kept:
            ensure_compile_callbacks(fn)

    clear_and_keep._memcompile = True  # type: ignore[attr-defined]
    callback_handler.clear = clear_and_keep  # type: ignore[method-assign]
