"""The machine line every benchmark result starts with, and the results files' common form
(benchmarks/ is on sys.path when a benchmark runs as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["describe_machine", "write_results"]


def describe_machine() -> str:
    """``host: cpu, N CPUs, Python X.Y.Z``."""
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def write_results(
    out: Path,
    stem: str,
    *,
    title: str,
    argv: Sequence[str],
    notes: Sequence[str],
    table: Sequence[str],
    rows: Sequence[dict[str, Any]],
    script: str | None = None,
) -> Path:
    """Write ``out/STEM.md`` (``# title``, the command, machine and date, ``notes`` as list
    items, then ``table``) and ``out/STEM.json`` (the same header and ``rows``); the command is
    ``OMP_NUM_THREADS=1 python benchmarks/SCRIPT.py`` (``script`` defaults to ``stem``) with
    ``argv``. Returns the Markdown path."""
    import torch

    command = f"OMP_NUM_THREADS=1 python benchmarks/{script or stem}.py {' '.join(argv)}".strip()
    machine = f"{describe_machine()}, torch {torch.__version__}"
    date = datetime.date.today().isoformat()
    lines = [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- machine: {machine}",
        f"- date: {date}",
        *(f"- {note}" for note in notes),
        "",
        *table,
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines))
    payload = {"command": command, "machine": machine, "date": date, "rows": list(rows)}
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out / f'{stem}.md'}")
    return out / f"{stem}.md"
