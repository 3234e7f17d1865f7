"""Rendered pictures that display inline in Jupyter and can be saved.

    img = show_plan("plan.json")      # an SvgImage; a notebook cell shows it inline
    img.save("plan.svg")
    PngImage(png_bytes).save("timeline.png")

Jupyter calls ``_repr_svg_`` / ``_repr_png_`` on a cell's value; nothing else is needed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["PngImage", "SvgImage"]


@dataclass(frozen=True)
class SvgImage:
    """An SVG document (text)."""

    svg: str

    def _repr_svg_(self) -> str:
        return self.svg

    def save(self, path: str | Path) -> Path:
        """Write the SVG to ``path``; returns the path."""
        p = Path(path)
        p.write_text(self.svg)
        return p


@dataclass(frozen=True)
class PngImage:
    """A PNG image (bytes)."""

    png: bytes

    def _repr_png_(self) -> bytes:
        return self.png

    def save(self, path: str | Path) -> Path:
        """Write the PNG to ``path``; returns the path."""
        p = Path(path)
        p.write_bytes(self.png)
        return p
