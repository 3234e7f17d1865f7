"""Run one training step of a workload under memcompile and snapshot what the backend did.

    from memcompile import zoo
    from memcompile.viz.capture import collect
    insp = collect(zoo.build("gpt", size="tiny"), budget="70%")   # an Inspection
    insp = collect(wl, budget="1.5MiB", before=False, measure=False)

``collect`` compiles the workload twice when ``before`` is set: first with no budget and torch's
own order (``reorder=False``, the "before" curves and ``before_peak``), then with the requested
options. Each compile is one step (forward, backward). A budgeted model may be planned again
after a step (a multi-fragment step predicted over budget, outputs the caller drops:
``planning/replan.py``), and Dynamo then compiles those fragments again in the next step: the
planned model runs more steps until one compiles nothing (at most :data:`SETTLE_STEPS`), so the
snapshot and the measurement describe the plans training runs with. With ``measure`` one more
step is measured (``memcompile.measure``). Gradients are set to ``None`` before every step, as
the predictions assume. The snapshot is read from ``memcompile.report`` only.

A budget ``"N%"`` is relative to the step without a plan: resident bytes plus N % of what the step
allocates above them (``resident + N/100 * (before_peak - resident)``), the convention of
``benchmarks/anchors.py``; it needs ``before=True``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memcompile.errors import MemoryBudgetError
from memcompile.viz.snapshot import Inspection, StepCall
from memcompile.zoo.base import Workload

log = logging.getLogger(__name__)

__all__ = ["SETTLE_STEPS", "collect", "resolve_budget"]

#: Steps after the first that ``collect`` runs at most, until one compiles nothing (re-plans
#: take up to two rounds per fragment for the budget and two for what a step shows).
SETTLE_STEPS = 6


def resolve_budget(
    budget: int | str | None, *, resident: int, unplanned_peak: int | None
) -> int | None:
    """Bytes of ``budget``: an int, a size string (``"512MiB"``) or a percentage (``"70%"``, of
    the step's allocations above ``resident`` without a plan, ``unplanned_peak``).

    Raises:
        ValueError: the string does not parse, or a percentage without ``unplanned_peak``.
    """
    from memcompile.config import parse_bytes

    if budget is None:
        return None
    if isinstance(budget, str) and budget.strip().endswith("%"):
        text = budget.strip()[:-1]
        try:
            frac = float(text) / 100
        except ValueError:
            raise ValueError(f"budget {budget!r}: cannot read {text!r} as a percentage") from None
        if not 0 < frac:
            raise ValueError(f"budget {budget!r} must be a positive percentage")
        if unplanned_peak is None:
            raise ValueError(f"budget {budget!r}: a percentage needs the unplanned step (before)")
        return int(resident + frac * (unplanned_peak - resident))
    return parse_bytes(budget)


def _unwrap_budget_error(e: BaseException) -> MemoryBudgetError | None:
    # Dynamo re-raises MemcompileError unchanged, but a budget error from a later recompile may
    # still arrive wrapped (BackendCompilerFailed): find it in the chain.
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, MemoryBudgetError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _run_step(wl: Workload, options: dict[str, Any]) -> tuple[Any, Any]:
    """Compile ``wl.model`` with ``options`` and run one training step; (compiled, compiler)."""
    import memcompile
    from memcompile.report import find_compiler

    _zero_grads(wl.model)
    compiled = memcompile.compile(wl.model, **options)
    _train_step(wl, compiled)
    return compiled, find_compiler(compiled)[0]


def _train_step(wl: Workload, compiled: Any) -> None:
    """One step (forward, backward) of batch 0; a budget error comes out unwrapped."""
    _zero_grads(wl.model)
    try:
        wl.loss(compiled, 0).backward()
    except Exception as e:
        budget_error = _unwrap_budget_error(e)
        if budget_error is not None:
            raise budget_error from None
        raise


def _settle(wl: Workload, compiled: Any) -> int:
    """Run training steps of ``compiled`` until one compiles no graph (re-plans done), at most
    :data:`SETTLE_STEPS`; returns the steps run. Warns if it is still compiling then."""
    stats = torch._dynamo.utils.counters["stats"]
    for n in range(1, SETTLE_STEPS + 1):
        before = stats["unique_graphs"]
        _train_step(wl, compiled)
        if stats["unique_graphs"] == before:
            log.info("collect %s: plans settled after %d more step(s)", wl.name, n)
            return n
    log.warning(
        "memcompile inspect: %s still compiled in its %d-th step; the snapshot describes the "
        "plans of that step",
        wl.name,
        SETTLE_STEPS + 1,
    )
    return SETTLE_STEPS


def _step_calls(seq: tuple[tuple[int, str, int], ...]) -> tuple[StepCall, ...]:
    # Block keys are parameter addresses: renumber them per fragment in first-seen order, so the
    # snapshot is the same in every run.
    numbers: dict[tuple[int, int], int] = {}
    out = []
    for index, kind, key in seq:
        n = numbers.setdefault((index, key), sum(1 for i, _ in numbers if i == index))
        out.append(StepCall(f"F{index}", kind, n))
    return tuple(out)


def collect(
    wl: Workload,
    *,
    budget: int | str | None = None,
    before: bool = True,
    measure: bool = True,
    target: str | None = None,
    **options: Any,
) -> Inspection:
    """Inspect one training step of ``wl`` under memcompile (see the module docstring).

    Args:
        wl: the workload (``wl.loss(model, step)`` is the step's loss).
        budget: bytes, a size string or a percentage of the unplanned step; ``None``: no budget.
        before: also compile without a plan, for the "before" curves and percentages.
        measure: measure one more step's peak (CPU profiler or CUDA stats).
        target: the name the snapshot carries (default ``wl.name``).
        **options: other memcompile options (``swap=False``, ``offload_to="disk"``, ...).

    Raises:
        MemoryBudgetError: no plan fits the budget.
        ValueError, TypeError: a bad budget or option.
    """
    import memcompile
    from memcompile.report import build_report

    before_report = None
    if before:
        _, compiler = _run_step(wl, {"reorder": False, **options, "budget": None})
        before_report = build_report(compiler, wl.model)
        torch._dynamo.reset()  # the next compile must not reuse (or count against) these frames
    resolved = resolve_budget(
        budget,
        resident=before_report.resident_bytes if before_report is not None else 0,
        unplanned_peak=before_report.predicted_peak if before_report is not None else None,
    )
    compiled, compiler = _run_step(wl, {**options, "budget": resolved})
    log.info("collect %s: budget %s", wl.name, resolved)
    if resolved is not None:
        _settle(wl, compiled)
    measured = None
    if measure:
        _zero_grads(wl.model)
        batch = wl.batch(0)  # the shapes already compiled: no compile inside the measurement

        def step() -> None:
            compiled(*batch).backward()

        measured = memcompile.measure(step, resident=[wl.model, batch]).peak
    report = build_report(compiler, wl.model)
    insp = Inspection.from_report(
        report,
        target=target or wl.name,
        step=_step_calls(compiler.step_sequence()),
        measured_peak=measured,
        before=before_report,
    )
    _zero_grads(wl.model)
    torch._dynamo.reset()
    return insp
