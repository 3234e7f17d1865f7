"""What every pass is given besides the graph: ``name_pass(gm, ctx, *, knobs) -> GraphModule``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PassContext"]


@dataclass(frozen=True)
class PassContext:
    """Read-only facts shared by the passes of one fragment.

    Attributes:
        fragment: the fragment's name (``F3``) for logs and errors.
        graph: which graph a pass runs on (``joint``, ``forward``, ``backward``).
    """

    fragment: str = ""
    graph: str = ""
