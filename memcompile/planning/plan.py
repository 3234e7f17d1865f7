"""Memory plans: pure data, decided by the planner, applied by the rewrite passes.

    FragmentPlan(decisions=(TensorDecision("mm_3", 2097152, "recompute"), ...),
                 backward_order=("mm_3", "t_5", ...), predicted_peak=..., ...)
    MemoryPlan(budget=..., fragments=(FragmentPlan(...), ...)).to_json()

A plan names tensors by their node names in the fragment's joint graph, so it can be saved,
read back (:meth:`MemoryPlan.from_json`), shown by the CLI and compared in tests without a model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["Action", "FragmentPlan", "MemoryPlan", "TensorDecision"]

#: What happens to a tensor the backward needs: kept on the device from forward to backward,
#: recomputed in the backward, or swapped to the host or disk tier in between.
Action = Literal["keep", "recompute", "host", "disk"]


@dataclass(frozen=True)
class TensorDecision:
    """One forward tensor the backward reads.

    Attributes:
        tensor: name of the joint-graph node that produces it.
        nbytes: bytes of its storage.
        action: ``keep``, ``recompute``, ``host`` or ``disk``.
    """

    tensor: str
    nbytes: int
    action: Action


@dataclass(frozen=True)
class FragmentPlan:
    """The plan of one fragment.

    Attributes:
        fragment: the fragment's stable id ("" until the backend sets it).
        decisions: one per tensor the default partition would save.
        backward_order: node names of the backward graph in execution order.
        forward_order: node names of the forward graph in execution order (empty: as traced).
        target: tracked bytes the fragment's graphs may peak at (budget minus what is resident),
            ``None`` without a budget.
        resident_bytes: parameters, buffers, inputs and other fragments' memory counted against
            the budget besides this fragment's own.
        predicted_peak: absolute device peak of a step under this plan (estimate of the planner's
            joint model; the report shows the exact profile of the built graphs).
        baseline_peak: the same without a plan (eager's saved set; host-placed parameters
            fetched again for the backward).
        recompute_time: predicted seconds the backward spends recomputing.
        swap_time: predicted seconds of the swaps' copies (out and back, not overlapped).
        feasible: the plan meets ``target``.
        prefetch: reload node -> backward node it is issued before (``prefetch.py``), so its
            copy overlaps compute; reloads not listed are issued right before their use.
        swap_stall: predicted seconds the backward's compute stream waits for reloads once
            prefetched (two-stream timeline, ``timeline.py``); ``None`` without swaps.
        host_params: joint-graph input names of the parameters kept in the host tier and
            fetched before each use (``offload_params``, ``rewrites/params.py``).
        saved_cap: bytes the plan was asked to hold at most from forward to backward (its
            kept tensors and ``saved_input_bytes``), ``None``: no cap. A re-plan of a step over
            budget sets it for fragments whose saved sets are held while others run
            (``planning/replan.py``); ``feasible`` requires it too.
        saved_input_bytes: activation inputs the backward reads (autograd holds them as it
            holds the kept tensors).
        rematerialized: ``(node, before)`` pairs of the built backward graph: ``node`` (a
            reload or a repeatable op) is made again right before ``before`` for the readers
            from there on, so it is not held across the peak, or moved there when no reader
            comes before (``rematerialize.py``); only when the plan did not fit without.
        row_tiled: ops of the built graphs made a block of rows at a time
            (``"backward:gelu_backward"``, ``tiling/``); only when the plan did not fit
            without.
        linear_ce: the cross-entropy heads made by blocks, their logits never whole
            (``"_log_softmax: 8 blocks"``, ``linearce.py``); only when the plan did not fit
            without.
    """

    fragment: str
    decisions: tuple[TensorDecision, ...]
    backward_order: tuple[str, ...]
    target: int | None
    resident_bytes: int
    predicted_peak: int
    baseline_peak: int
    recompute_time: float
    feasible: bool
    swap_time: float = 0.0
    forward_order: tuple[str, ...] = ()
    prefetch: tuple[tuple[str, str], ...] = ()
    swap_stall: float | None = None
    host_params: tuple[str, ...] = ()
    saved_cap: int | None = None
    saved_input_bytes: int = 0
    rematerialized: tuple[tuple[str, str], ...] = ()
    row_tiled: tuple[str, ...] = ()
    linear_ce: tuple[str, ...] = ()

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(d.tensor for d in self.decisions if d.action == "recompute")

    @property
    def swapped(self) -> dict[str, str]:
        """Tensor name -> tier of the swapped tensors."""
        return {d.tensor: d.action for d in self.decisions if d.action in ("host", "disk")}

    @property
    def saved_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions if d.action == "keep")

    @property
    def held_bytes(self) -> int:
        """Device bytes held from forward to backward: the kept tensors and the activation
        inputs the backward reads (what ``saved_cap`` bounds)."""
        return self.saved_bytes + self.saved_input_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FragmentPlan:
        fields = dict(data)
        fields["decisions"] = tuple(TensorDecision(**d) for d in fields["decisions"])
        fields["backward_order"] = tuple(fields["backward_order"])
        fields["forward_order"] = tuple(fields.get("forward_order", ()))
        fields["prefetch"] = tuple(tuple(p) for p in fields.get("prefetch", ()))
        fields["host_params"] = tuple(fields.get("host_params", ()))
        fields["rematerialized"] = tuple(tuple(p) for p in fields.get("rematerialized", ()))
        fields["row_tiled"] = tuple(fields.get("row_tiled", ()))
        fields["linear_ce"] = tuple(fields.get("linear_ce", ()))
        return cls(**fields)


@dataclass(frozen=True)
class MemoryPlan:
    """Plans of every fragment of one compiled model.

    Attributes:
        budget: the requested absolute device peak of a training step, bytes (or None).
        device_profile: the cost model the plans were priced with.
        fragments: one plan per planned fragment, in compile order.
    """

    budget: int | None
    device_profile: str
    fragments: tuple[FragmentPlan, ...] = field(default=())

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(asdict(self), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> MemoryPlan:
        data = json.loads(text)
        return cls(
            budget=data["budget"],
            device_profile=data["device_profile"],
            fragments=tuple(FragmentPlan.from_dict(f) for f in data["fragments"]),
        )
