"""Pictures of fragments and plans, for notebooks (inline SVG/PNG) and the ``memcompile`` CLI.

    import memcompile.viz as mv
    insp = mv.collect(zoo.build("gpt", size="tiny"), budget="70%")   # or mv.load("plan.json")
    mv.show_plan(insp)            # graphviz: nodes coloured by keep / recompute / swap / prefetch
    mv.show_timeline(insp)        # matplotlib: live bytes before and after, budget line
    mv.show_fragments(insp)       # networkx: the block transition graph of the step
    mv.show_fragments(read_trace("moe.jsonl"))  # ... of every step of a block trace, P(next)
    mv.show_plan(insp).save("plan.svg")

Every ``show_*`` takes an :class:`Inspection`, the path of a plan file written by
``memcompile plan``, or a model compiled with memcompile that has run a step (its report is read;
there is then no "before" curve). They return :class:`SvgImage` / :class:`PngImage`, which Jupyter
displays inline. Needs the ``viz`` extra (graphviz, matplotlib) and graphviz's ``dot`` program.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcompile.viz.image import PngImage, SvgImage
from memcompile.viz.snapshot import Inspection, InspectionFileError, load_inspection

if TYPE_CHECKING:
    from memcompile.dynamic.trace import StepTrace

log = logging.getLogger(__name__)

__all__ = [
    "Inspection",
    "InspectionFileError",
    "PngImage",
    "SvgImage",
    "as_inspection",
    "collect",
    "load",
    "show_fragments",
    "show_plan",
    "show_timeline",
]

load = load_inspection


def collect(*args: Any, **kwargs: Any) -> Inspection:
    """:func:`memcompile.viz.capture.collect` (imported lazily: it imports the backend)."""
    from memcompile.viz.capture import collect as _collect

    return _collect(*args, **kwargs)


def as_inspection(x: Inspection | str | Path | Any) -> Inspection:
    """``x`` as an :class:`Inspection`: itself, a plan file, or a memcompile-compiled model."""
    if isinstance(x, Inspection):
        return x
    if isinstance(x, (str, Path)):
        return load_inspection(x)
    from memcompile.report import find_compiler, report

    compiler = find_compiler(x)[0]  # TypeError for anything else, with a clear message
    from memcompile.viz.capture import _step_calls

    name = type(getattr(x, "_orig_mod", x)).__name__
    return Inspection.from_report(
        report(x), target=name, step=_step_calls(compiler.step_sequence())
    )


def show_plan(x: Inspection | str | Path | Any, *, compact: bool | None = None) -> SvgImage:
    """Every fragment's graphs, nodes coloured by the plan's decisions (``memcompile draw``).

    ``compact``: draw runs of nodes instead of nodes (``None``: above
    :data:`memcompile.viz.draw.COMPACT_ABOVE` nodes; see :mod:`memcompile.viz.draw`).
    """
    from memcompile.viz.draw import plan_digraph, render

    return SvgImage(render(plan_digraph(as_inspection(x), compact=compact), "svg").decode())


def show_timeline(x: Inspection | str | Path | Any) -> PngImage:
    """Live bytes over the schedule before and after the plan (``memcompile timeline``)."""
    from memcompile.viz.timeline import render_png, timeline_figure

    return PngImage(render_png(timeline_figure(as_inspection(x))))


def show_fragments(
    x: Inspection | str | Path | Sequence[StepTrace] | Any, *, probabilities: bool = True
) -> SvgImage:
    """The block transition graph: of the observed step, or of every step of a block trace
    (a list of :class:`~memcompile.dynamic.trace.StepTrace`, e.g. ``read_trace(path)``), edges
    labelled with the transition probability ``P(next | block)`` (``probabilities=False``: counts).
    """
    from memcompile.viz.fragments import render_trace_transitions, render_transitions

    if isinstance(x, (list, tuple)):
        from memcompile.dynamic.trace import StepTrace

        if not x or not all(isinstance(s, StepTrace) for s in x):
            raise TypeError(
                "show_fragments: a sequence must hold StepTrace objects (read_trace(path)); got "
                + (type(x[0]).__name__ if x else "an empty sequence")
            )
        return SvgImage(render_trace_transitions(x, probabilities=probabilities).decode())
    return SvgImage(render_transitions(as_inspection(x), probabilities=probabilities).decode())
