"""The machine line every benchmark result starts with (benchmarks/ is on sys.path when a
benchmark runs as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import os
import platform

__all__ = ["describe_machine"]


def describe_machine() -> str:
    """``host: cpu, N CPUs, Python X.Y.Z``."""
    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
