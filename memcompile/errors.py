"""Exceptions memcompile raises on purpose.

Bad options raise the built-in ``ValueError``/``TypeError`` (naming the option); everything
memcompile itself cannot do raises a subclass of :class:`MemcompileError`.
"""

from __future__ import annotations

from torch._dynamo.exc import ShortenTraceback

__all__ = [
    "MemcompileError",
    "MemoryBudgetError",
    "MemoryBudgetWarning",
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


class MemoryBudgetError(MemcompileError):
    """No plan fits the requested budget.

    Attributes:
        budget: the requested device peak, bytes.
        min_feasible: the smallest peak any plan found reaches, bytes.
        hint: what would help (e.g. ``offload_params=True``), or ``""``.
    """

    def __init__(self, budget: int, min_feasible: int, hint: str = "") -> None:
        self.budget = budget
        self.min_feasible = min_feasible
        self.hint = hint
        msg = (
            f"no memory plan fits budget={format_bytes(budget)} ({budget} bytes); the smallest "
            f"peak found is {format_bytes(min_feasible)} ({min_feasible} bytes)"
        )
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[type, tuple[int, int, str]]:
        # Keep the attributes through pickling (multiprocessing, pytest-xdist).
        return (type(self), (self.budget, self.min_feasible, self.hint))


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


class PilotWarning(UserWarning):
    """The dynamic-network pilot cannot use a saved model (missing, corrupt, or made for other
    features) and predicts with its Markov fallback until it has trained a new one."""
