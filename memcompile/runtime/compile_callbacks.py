"""Dynamo's compile start and end callbacks, registered where they went missing.

``torch._dynamo.reset()`` clears every callback registered with Dynamo's ``callback_handler``,
so memcompile's (the pinned placeholders, runtime/pinned.py; the unwrapped tensor reads,
runtime/scalar_reads.py; the compiler's attach at a frame's start, backends/compiler.py) are
registered again before each use, by the one idempotent call here::

    ensure_compile_callbacks(_on_compile_start, _on_compile_end)   # two list lookups when there
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._dynamo.callback import callback_handler

__all__ = ["ensure_compile_callbacks"]


def ensure_compile_callbacks(
    start: Callable[[Any], None], end: Callable[[Any], None] | None = None
) -> None:
    """Register ``start`` (and ``end``) with Dynamo's compile callbacks unless they are there."""
    if start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(start)
    if end is not None and end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(end)
