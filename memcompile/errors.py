"""Exceptions memcompile raises on purpose.

Bad options raise the built-in ``ValueError``/``TypeError`` (naming the option); everything
memcompile itself cannot do raises a subclass of :class:`MemcompileError`.
"""

from __future__ import annotations

from typing import Any

from torch._dynamo.exc import ShortenTraceback

__all__ = [
    "InnerCompilerWarning",
    "MemcompileError",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
    "OffloadError",
    "PilotWarning",
    "RankDivergenceError",
    "format_bytes",
]


def format_bytes(n: int | float) -> str:
    """``format_bytes(3 * 2**20) == "3.00 MiB"``: binary units, two decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class MemcompileError(ShortenTraceback):
    """Base class of memcompile's own runtime errors (a ``RuntimeError``).

    It derives from Dynamo's ``ShortenTraceback`` because Dynamo re-raises those from a backend
    unchanged: users catch ``memcompile.MemoryBudgetError`` itself, not a
    ``BackendCompilerFailed`` wrapping it.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args, first_useful_frame=None)


class OffloadError(MemcompileError):
    """Moving a tensor to or from a tier failed (for example, the disk is full, or a copy on
    the CPU's copy thread raised)."""


class MemoryBudgetError(MemcompileError):
    """No plan fits the requested budget.

    Attributes:
        budget: the requested device peak, bytes.
        min_feasible: the smallest peak any plan found reaches, bytes; with ``bound``, a lower
            bound on every plan's peak instead (told before any search: the smallest feasible
            budget is at least this).
        hint: what would help (e.g. ``offload_params=True``), or ``""``.
        bound: ``min_feasible`` is a lower bound, not a plan's peak.
    """

    def __init__(
        self, budget: int, min_feasible: int, hint: str = "", *, bound: bool = False
    ) -> None:
        self.budget = budget
        self.min_feasible = min_feasible
        self.hint = hint
        self.bound = bound
        found = (
            f"every plan peaks at {format_bytes(min_feasible)} ({min_feasible} bytes) or more "
            "(a bound: no plan was searched)"
            if bound
            else f"the smallest peak found is {format_bytes(min_feasible)} ({min_feasible} bytes)"
        )
        msg = f"no memory plan fits budget={format_bytes(budget)} ({budget} bytes); {found}"
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the attributes through pickling (multiprocessing, pytest-xdist).
        return (_budget_error, (self.budget, self.min_feasible, self.hint, self.bound))


def _budget_error(budget: int, min_feasible: int, hint: str, bound: bool) -> MemoryBudgetError:
    return MemoryBudgetError(budget, min_feasible, hint, bound=bound)


class RankDivergenceError(MemcompileError):
    """Ranks of an FSDP2 model ran different ``fully_shard`` units (``check_ranks=True``): their
    all-gathers would not match, and FSDP's collectives would hang or abort.

    Attributes:
        units: the unit each rank was about to run (``"<none>"``: a rank that timed out
            waiting), by rank.
    """

    def __init__(self, message: str, units: tuple[str, ...]) -> None:
        super().__init__(message)
        self.units = units


class MemoryBudgetWarning(UserWarning):
    """A plan does not meet the budget (``on_infeasible="best_effort"``, or a prediction that the
    built graphs exceed it): the step may peak above the budget."""


class GradientOrderWarning(UserWarning):
    """A parameter's gradient was added up in another order than eager's (its contributions
    summed in a fragment's backward graph after another call added to it), so it may differ
    from eager's in the last bits; ``split_param_reads=True`` adds them in eager's order."""


class InnerCompilerWarning(UserWarning):
    """``inner="auto"`` chose Inductor for a fragment and Inductor failed on it: its graphs run
    on eager kernels instead (correct, at eager's speed)."""


class PilotWarning(UserWarning):
    """The dynamic-network pilot cannot use a saved model (missing, corrupt, or made for other
    features) and predicts with its Markov fallback until it has trained a new one."""
