"""What the CLI and the notebook views show, as one frozen, JSON-serializable snapshot.

    insp = Inspection.from_report(memcompile.report(compiled), target="gpt", ...)
    Path("plan.json").write_text(insp.to_json())       # what `memcompile plan -o plan.json` writes
    insp = load_inspection("plan.json")                  # `memcompile draw plan.json` reads it
    MemoryPlan.from_json(Path("plan.json").read_text())  # the same file is a plain MemoryPlan too

A saved :class:`~memcompile.planning.plan.MemoryPlan` names tensors but has no graph, and drawing a
plan or its timeline needs the graph's nodes, their edges and the live bytes under each node. So
that ``draw`` and ``timeline`` work from a file without recompiling, ``plan.json`` is the
MemoryPlan's JSON object with one more key, ``"memcompile_inspection"``, holding the views below:
for every fragment its built forward and backward graphs (node names, ops, edges, live bytes) after
the plan and, when the CLI measured one, before it (the same model compiled without a budget and
with torch's own order). ``MemoryPlan.from_json`` ignores the extra key, so the file is also a
plain plan. Everything here is copied from the backend's records (``FragmentRecord``,
``GraphProfile``); nothing is recomputed.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memcompile.analysis.graph import GraphProfile
from memcompile.planning.plan import FragmentPlan, MemoryPlan
from memcompile.report import FragmentReport, MemReport

log = logging.getLogger(__name__)

__all__ = [
    "INSPECTION_KEY",
    "FragmentView",
    "GraphView",
    "Inspection",
    "InspectionFileError",
    "NodeView",
    "StepCall",
    "load_inspection",
]

#: The key of plan.json that holds the inspection (the rest of the object is the MemoryPlan).
INSPECTION_KEY = "memcompile_inspection"
_VERSION = 1


class InspectionFileError(ValueError):
    """A plan file that cannot be read, or that holds no inspection (the message says which)."""


@dataclass(frozen=True)
class NodeView:
    """One node of a built graph, in schedule order.

    Attributes:
        name, op, target: as in the FX graph (``target`` a qualified string).
        inputs: names of the nodes it reads (edges).
        live_bytes: tracked bytes live while it runs (relative to the fragment's resident bytes).
        new_bytes: bytes it allocates.
    """

    name: str
    op: str
    target: str
    inputs: tuple[str, ...]
    live_bytes: int
    new_bytes: int


@dataclass(frozen=True)
class GraphView:
    """A forward, backward or inference graph: its nodes in execution order and its peak."""

    kind: str
    nodes: tuple[NodeView, ...]
    peak_index: int

    @property
    def peak_node(self) -> str:
        return self.nodes[self.peak_index].name if self.nodes else ""

    @classmethod
    def of(cls, profile: GraphProfile) -> GraphView:
        return cls(
            kind=profile.kind,
            nodes=tuple(
                NodeView(n.name, n.op, n.target, n.inputs, n.live_bytes, n.new_bytes)
                for n in profile.nodes
            ),
            peak_index=profile.peak_index,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphView:
        nodes = tuple(NodeView(**{**n, "inputs": tuple(n["inputs"])}) for n in d["nodes"])
        return cls(kind=d["kind"], nodes=nodes, peak_index=d["peak_index"])


@dataclass(frozen=True)
class StepCall:
    """One fragment call of the observed step: ``F1``, ``forward``, block 0 (blocks of one
    fragment, e.g. experts sharing a graph, are numbered in the order they first ran)."""

    fragment: str
    kind: str
    block: int

    @property
    def label(self) -> str:
        short = {"forward": "fw", "backward": "bw", "inference": "inf"}.get(self.kind, self.kind)
        return f"{self.fragment}.{short}" + (f"#{self.block}" if self.block else "")


@dataclass(frozen=True)
class FragmentView:
    """One fragment: where it comes from, its graphs after (and before) planning, its peak.

    Attributes:
        name, id, code, reason: as in :class:`memcompile.report.FragmentReport`.
        calls: forward and inference calls seen.
        base_bytes: bytes resident under this fragment's graphs (its inputs, and on CUDA memory
            others hold): add to a node's ``live_bytes`` for the absolute device bytes.
        held_output_bytes: outputs the caller holds during the backward (the loss).
        predicted_peak: predicted absolute peak while this fragment runs in the step.
        peak_graph, peak_node: where the step's peak of this fragment falls (``"backward"``,
            ``"mm_4"``); empty when not profiled.
        forward, backward: the built graphs (``None``: not compiled / inference only).
        before_forward, before_backward: the same fragment compiled without a plan.
    """

    name: str
    id: str
    code: str
    reason: str
    calls: int
    base_bytes: int
    held_output_bytes: int
    predicted_peak: int | None
    peak_graph: str
    peak_node: str
    forward: GraphView | None
    backward: GraphView | None
    before_forward: GraphView | None = None
    before_backward: GraphView | None = None

    @property
    def short_code(self) -> str:
        """``forward (/long/path/gpt.py:113)`` -> ``forward (gpt.py:113)``."""
        return re.sub(r"\(([^()]*/)([^/()]+)\)$", r"(\2)", self.code)

    @classmethod
    def of(cls, f: FragmentReport, before: FragmentReport | None = None) -> FragmentView:
        prof = f.profile
        peak_graph = peak_node = ""
        fw = bw = None
        held = base = 0
        if prof is not None:
            fw = GraphView.of(prof.forward)
            bw = GraphView.of(prof.backward) if prof.backward is not None else None
            held = prof.held_output_bytes
            base = f.plan.resident_bytes if f.plan is not None else prof.input_bytes
            phases = prof.phase_peaks()
            phase = max(phases, key=lambda k: phases[k])  # first of equals: dict order
            if phase == "forward":
                peak_graph, peak_node = fw.kind, fw.peak_node
            elif bw is not None:
                # "accumulate" peaks after the backward's last node (AccumulateGrad's copy).
                peak_graph = "backward"
                peak_node = bw.peak_node if phase == "backward" else bw.nodes[-1].name
        bprof = before.profile if before is not None else None
        return cls(
            name=f.name,
            id=f.id,
            code=f.code,
            reason=f.reason,
            calls=f.forward_calls + f.inference_calls,
            base_bytes=base,
            held_output_bytes=held,
            predicted_peak=f.predicted_peak,
            peak_graph=peak_graph,
            peak_node=peak_node,
            forward=fw,
            backward=bw,
            before_forward=GraphView.of(bprof.forward) if bprof is not None else None,
            before_backward=(
                GraphView.of(bprof.backward)
                if bprof is not None and bprof.backward is not None
                else None
            ),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FragmentView:
        graphs = ("forward", "backward", "before_forward", "before_backward")
        fields = {k: v for k, v in d.items() if k not in graphs}
        for g in graphs:
            fields[g] = GraphView.from_dict(d[g]) if d.get(g) is not None else None
        return cls(**fields)


@dataclass(frozen=True)
class Inspection:
    """Everything ``memcompile inspect`` found about one model's training step.

    Attributes:
        target: what was inspected (a zoo name or ``module:function``).
        plan: the plans applied (an empty plan without a budget).
        fragments: one view per compiled fragment, in compile order.
        predicted_peak: predicted absolute device peak of the step, bytes.
        measured_peak: measured absolute peak of the step, ``None`` if not measured.
        before_peak: predicted peak of the step compiled without a plan (``None``: not compiled).
        exact: the prediction is exact (single fragment, eager inner compiler).
        resident_bytes: parameters, buffers and inputs resident for the whole step.
        step: the fragment calls of the observed step.
        fallbacks: one line per frame Dynamo ran eagerly.
    """

    target: str
    plan: MemoryPlan
    fragments: tuple[FragmentView, ...]
    predicted_peak: int | None
    measured_peak: int | None
    before_peak: int | None
    exact: bool
    resident_bytes: int
    step: tuple[StepCall, ...]
    fallbacks: tuple[str, ...] = field(default=())

    @property
    def budget(self) -> int | None:
        return self.plan.budget

    def plan_of(self, fragment: FragmentView) -> FragmentPlan | None:
        """The plan applied to ``fragment``, if any."""
        for p in self.plan.fragments:
            if p.fragment == fragment.id:
                return p
        return None

    @classmethod
    def from_report(
        cls,
        report: MemReport,
        *,
        target: str,
        step: tuple[StepCall, ...] = (),
        measured_peak: int | None = None,
        before: MemReport | None = None,
    ) -> Inspection:
        """The snapshot of ``report``; ``before`` is the report of the same model compiled with
        no budget and torch's order (fragments are matched by their stable id)."""
        by_id = {f.id: f for f in before.fragments} if before is not None else {}
        if not step:  # the report names calls only: every block is block 0
            kinds = {"fw": "forward", "bw": "backward", "inf": "inference"}
            step = tuple(
                StepCall(name, kinds[kind], 0) for name, kind in (s.split(".") for s in report.step)
            )
        return cls(
            target=target,
            plan=report.plan,
            fragments=tuple(FragmentView.of(f, by_id.get(f.id)) for f in report.fragments),
            predicted_peak=report.predicted_peak,
            measured_peak=measured_peak,
            before_peak=before.predicted_peak if before is not None else None,
            exact=report.exact,
            resident_bytes=report.resident_bytes,
            step=step,
            fallbacks=tuple(f"{fb.code}: {fb.kind}: {fb.reason}" for fb in report.fallbacks),
        )

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The MemoryPlan's JSON object plus :data:`INSPECTION_KEY` (see the module docstring)."""
        data = asdict(self.plan)
        rest = {k: v for k, v in asdict(self).items() if k != "plan"}
        data[INSPECTION_KEY] = {"version": _VERSION, **rest}
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Inspection:
        """Read what :meth:`to_json` wrote.

        Raises:
            InspectionFileError: not JSON, not a plan, or a plan without an inspection.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InspectionFileError(f"not JSON ({e})") from None
        if not isinstance(data, dict) or "fragments" not in data or "budget" not in data:
            raise InspectionFileError("not a memcompile plan (no 'budget' and 'fragments' keys)")
        extra = data.get(INSPECTION_KEY)
        if extra is None:
            raise InspectionFileError(
                "a memory plan without graphs (written by MemoryPlan.to_json?); write one that "
                "can be drawn with `memcompile plan TARGET --budget B -o FILE`"
            )
        if extra.get("version") != _VERSION:
            raise InspectionFileError(
                f"inspection version {extra.get('version')!r}, this memcompile reads {_VERSION}"
            )
        try:
            plan = MemoryPlan.from_json(text)
            return cls(
                target=extra["target"],
                plan=plan,
                fragments=tuple(FragmentView.from_dict(f) for f in extra["fragments"]),
                predicted_peak=extra["predicted_peak"],
                measured_peak=extra["measured_peak"],
                before_peak=extra["before_peak"],
                exact=extra["exact"],
                resident_bytes=extra["resident_bytes"],
                step=tuple(StepCall(**s) for s in extra["step"]),
                fallbacks=tuple(extra["fallbacks"]),
            )
        except (KeyError, TypeError) as e:
            raise InspectionFileError(f"malformed plan file (bad or missing field {e})") from None


def load_inspection(path: str | Path) -> Inspection:
    """Read a plan file written by ``memcompile plan`` (or :meth:`Inspection.to_json`).

    Raises:
        InspectionFileError: unreadable file or not an inspection; the message names the file.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InspectionFileError(f"cannot read plan file {str(p)!r}: {reason}") from None
    try:
        return Inspection.from_json(text)
    except InspectionFileError as e:
        raise InspectionFileError(f"{str(p)!r}: {e}") from None
