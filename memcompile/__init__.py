"""memcompile: a ``torch.compile`` backend that trains networks inside a device-memory budget.

compiled = torch.compile(model, backend="memcompile", options={"budget": "6GiB"})
compiled = memcompile.compile(model, budget="6GiB")     # same, options validated at once
report = memcompile.report(compiled)                    # fragments, predicted peak, fallbacks
peak = memcompile.measure_peak(step_fn)                 # measured device peak, bytes
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from memcompile.backends.compiler import MemCompiler
from memcompile.backends.dynamo_hooks import dynamo_context
from memcompile.backends.fallbacks import EagerFallbackWarning, Fallback
from memcompile.config import VERSION, MemConfig, parse_bytes
from memcompile.errors import (
    GradientOrderWarning,
    InnerCompilerWarning,
    MemcompileError,
    MemoryBudgetError,
    MemoryBudgetWarning,
    OffloadError,
    RankDivergenceError,
)
from memcompile.report import FragmentReport, MemReport, report
from memcompile.runtime.measure import PeakMeasurement, measure, measure_peak

__version__ = VERSION

__all__ = [
    "EagerFallbackWarning",
    "Fallback",
    "FragmentReport",
    "GradientOrderWarning",
    "InnerCompilerWarning",
    "MemCompiler",
    "MemConfig",
    "MemReport",
    "MemcompileError",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "OffloadError",
    "PeakMeasurement",
    "RankDivergenceError",
    "__version__",
    "compile",
    "measure",
    "measure_peak",
    "parse_bytes",
    "report",
]

_T = TypeVar("_T", bound=Callable[..., Any])


def compile(
    model: _T,
    *,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    **options: Any,
) -> _T:
    """``torch.compile(model, backend="memcompile", options=options)``, validating options now.

    Args:
        model: an ``nn.Module`` or a function.
        fullgraph, dynamic: passed to ``torch.compile``.
        **options: memcompile options (see :class:`MemConfig`).

    Raises:
        ValueError, TypeError: an unknown option or a bad value (the message names the option).
        NotImplementedError: an option value whose feature has not landed yet.
    """
    compiler = MemCompiler(MemConfig.from_options(options))
    if isinstance(model, torch.nn.Module):
        compiler.model = weakref.ref(model)
    compiled = torch.compile(model, backend=compiler, fullgraph=fullgraph, dynamic=dynamic)
    ctx = dynamo_context(compiled)
    if ctx is not None:  # warn about eager fallbacks in the very call where Dynamo gives up
        compiler.attach(ctx)
    return cast(_T, compiled)
