"""What memcompile records about each fragment and each step, for the report, the pilot and viz.

Compiling writes these; everything later reads them (``MemCompiler.fragments``): nothing the
report, the CLI or the notebooks show is recomputed.

    FragmentRecord   one fragment: identity, where Dynamo cut it, profile, plan, call counts
    RecordIndex      records by index, for per-call lookups on the hot path
    StepEvent        one fragment call in a step: (index, kind, block key)
    SizeKey          the values of a fragment's size symbols at one call
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from memcompile.analysis.fragment_profile import FragmentProfile
from memcompile.planning.plan import FragmentPlan

__all__ = [
    "FragmentIdentity",
    "FragmentRecord",
    "FragmentStats",
    "RecordIndex",
    "SizeKey",
    "StepEvent",
    "parameter_name",
]

#: One fragment call in a training step: (fragment index, "forward" | "backward" | "inference",
#: block key). The block key tells apart calls of one graph with different parameters (one
#: compiled graph serves every expert): the address of the first parameter, 0 if none.
StepEvent = tuple[int, str, int]
#: The values of a fragment's size symbols at one call (empty: static sizes).
SizeKey = tuple[int, ...]


@dataclass
class FragmentStats:
    """Runtime counters of one fragment (the only mutable part of a record)."""

    forward_calls: int = 0
    backward_calls: int = 0
    inference_calls: int = 0


@dataclass(frozen=True)
class FragmentIdentity:
    """Stable identity of a fragment.

    Attributes:
        id: 16 hex digits of the structural hash (graph + input metadata + sources).
        sources: Dynamo source of each input, e.g. ``L['self'].blocks[0].qkv.weight``.
        input_meta: one line per input: ``f32[8, 256]@cpu stride=(256, 1) grad``.
    """

    id: str
    sources: tuple[str, ...]
    input_meta: tuple[str, ...]


@dataclass(frozen=True)
class FragmentRecord:
    """One fragment: identity, where and why Dynamo cut it, its profile and call counts.

    Attributes:
        index: order in which this backend compiled it (``name`` is ``F{index}``); display only.
        identity: the stable :class:`FragmentIdentity`.
        code: the compiled frame, ``function (file:line)``.
        reason: why Dynamo ended the fragment (``return_value``, ``generic_jump …``, …).
        break_at: where that happened, ``function (file:line)``.
        compile_id: Dynamo's compile id (``frame/recompile``), for cross-referencing logs only.
        static_inputs: positions of parameters and buffers among the inputs.
        static_storages: ``(data_ptr, nbytes)`` of their storages at compile time, to count shared
            parameters once across fragments (no reference is kept).
        profile: forward/backward profile; ``None`` for a graph with no operations.
        plan: the memory plan applied (with a budget), else ``None``.
        inner: the inner compiler that runs the graphs.
        stats: call counters.
        blocks: parameter storages (address -> bytes) per block key seen at run time (one compiled
            graph serves many parameter sets, e.g. experts).
        block_inputs: per block key, the storage address of each parameter or buffer input (by
            position): which gradients the calls of different fragments share.
        profile_at: for a graph with dynamic sizes, its profile at one call's size-symbol values
            (``None`` when its sizes are static).
        summed_inputs: positions of the inputs whose several gradient contributions its
            backward graph sums: parameters read several times (not split), inputs an op
            reads through several autograd edges.
        hostable: addresses among ``static_storages`` of the parameters the host tier may take
            (``ResidentSet.may_host``): what a step that puts parameters on the host frees.
    """

    index: int
    identity: FragmentIdentity
    code: str
    reason: str
    break_at: str
    compile_id: str
    static_inputs: tuple[int, ...]
    static_storages: tuple[tuple[int, int], ...]
    profile: FragmentProfile | None
    plan: FragmentPlan | None
    inner: str
    stats: FragmentStats = field(default_factory=FragmentStats, compare=False)
    blocks: dict[int, dict[int, int]] = field(default_factory=dict, compare=False)
    block_inputs: dict[int, dict[int, int]] = field(default_factory=dict, compare=False)
    #: The profile at a call's size key (graphs compiled for dynamic sizes), else ``None``.
    profile_at: Callable[[tuple[int, ...]], FragmentProfile | None] | None = field(
        default=None, compare=False, repr=False
    )
    #: Positions of inputs whose several contributions its backward graph sums
    #: (``InputSplit.summed``, rewrites/input_uses.py).
    summed_inputs: tuple[int, ...] = ()
    hostable: frozenset[int] = frozenset()
    #: The plan cache's key when the plan was replayed from an earlier run's search
    #: (``pipeline/plan_cache.py``), else ``None``.
    plan_cached: str | None = None
    #: Why the inner compiler's code was not measured at compile time
    #: (``backends/inner_peak.py``; ``""``: measured, or the eager inner compiler).
    inner_unmeasured: str = ""
    #: Why it runs on eager kernels where ``inner="auto"`` chose Inductor (``""``: it does
    #: not): Inductor failed on it, or no plan of Inductor's fit the budget.
    inner_fallback: str = ""
    #: No plan of it fit, by no more than the rest of the step may still give way: it was
    #: not reported as infeasible (no error, no warning); the step's check decides
    #: (``FragmentBuild._step_decides``).
    step_decides: bool = False

    @property
    def name(self) -> str:
        return f"F{self.index}"

    @property
    def id(self) -> str:
        return self.identity.id


class RecordIndex:
    """Fragment records by index, looked up in ``records()`` again only for an index not seen
    yet (a fragment compiled since): per-call lookups on the hot path stay a dict access."""

    def __init__(self, records: Callable[[], Sequence[FragmentRecord]]) -> None:
        self._records = records
        self._by_index: dict[int, FragmentRecord] = {}

    def __call__(self, index: int) -> FragmentRecord | None:
        record = self._by_index.get(index)
        if record is None:
            self._by_index = {r.index: r for r in self._records()}
            record = self._by_index.get(index)
        return record

    def clear(self) -> None:
        self._by_index.clear()


def parameter_name(source: str) -> str:
    """A Dynamo source as the module's parameter name where it is one:
    ``L['self']._modules['w_hh']._parameters['weight']`` -> ``w_hh.weight``."""
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", source)
    name = re.sub(r"^L\['self'\]\.", "", name)
    return name or source
