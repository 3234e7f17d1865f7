"""Live device bytes over a training step's schedule, before and after the plan (matplotlib, Agg).

    from memcompile.viz.timeline import timeline_figure, render_png
    fig = timeline_figure(insp)              # a matplotlib Figure, one panel per fragment
    png = render_png(fig)                    # bytes
    show_timeline(insp).save("timeline.png") # memcompile.viz.show_timeline: inline in notebooks

The x axis is the schedule: the forward graph's nodes, then the backward's, in execution order.
The y axis is absolute device bytes: the fragment's resident bytes (parameters, buffers, inputs)
plus the bytes its graphs hold while each node runs, plus during the backward the outputs the
caller holds (the loss). "before" is the same fragment compiled with no budget and torch's order,
drawn against its own schedule (the plan adds recompute and swap nodes, so the two differ in
length); it uses the planned fragment's resident bytes, which is exact for single-fragment
steps. The budget is the dashed red line. Figures are built without pyplot (no global state),
drawn by the Agg canvas.
"""

from __future__ import annotations

import io
import logging

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from memcompile.viz.snapshot import FragmentView, GraphView, Inspection, NodeView

log = logging.getLogger(__name__)

__all__ = ["curve", "render_png", "timeline_figure"]

_MIB = 2**20


def _ops(graph: GraphView | None) -> list[NodeView]:
    return [n for n in (graph.nodes if graph else ()) if n.op not in ("placeholder", "output")]


def curve(
    fragment: FragmentView, forward: GraphView | None, backward: GraphView | None
) -> tuple[list[int], int]:
    """(absolute live bytes while each op of ``forward`` then ``backward`` runs, index of the
    first backward op). Placeholders and outputs run nothing and are left out (a backward starts
    with dozens of saved-tensor inputs, a flat stretch that says nothing)."""
    fw = [fragment.base_bytes + n.live_bytes for n in _ops(forward)]
    bw = [fragment.base_bytes + fragment.held_output_bytes + n.live_bytes for n in _ops(backward)]
    return fw + bw, len(fw)


def timeline_figure(insp: Inspection, *, width: float = 10.0) -> Figure:
    """One panel per profiled fragment: live bytes before and after the plan, and the budget."""
    frags = [f for f in insp.fragments if f.forward is not None]
    fig = Figure(figsize=(width, 3.2 * max(1, len(frags))), layout="constrained")
    FigureCanvasAgg(fig)
    if not frags:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no profiled fragment", ha="center", va="center")
        ax.set_axis_off()
        return fig
    axes = fig.subplots(len(frags), 1, squeeze=False)[:, 0]
    for ax, frag in zip(axes, frags, strict=True):
        series = [("after", frag.forward, frag.backward, "#1c7ed6", 1.6)]
        if frag.before_forward is not None:
            series.insert(0, ("before", frag.before_forward, frag.before_backward, "#868e96", 1.2))
        for label, fw, bw, colour, lw in series:
            ys, split = curve(frag, fw, bw)
            mib = [y / _MIB for y in ys]
            peak = max(range(len(mib)), key=mib.__getitem__)
            ax.plot(
                range(len(mib)),
                mib,
                color=colour,
                lw=lw,
                label=f"{label}: peak {mib[peak]:.2f} MiB",
            )
            ax.plot([peak], [mib[peak]], "o", color=colour, ms=5)
            if split < len(mib):
                ax.axvline(split - 0.5, color=colour, ls=":", lw=0.8)
        if insp.budget is not None:
            ax.axhline(
                insp.budget / _MIB,
                color="#e03131",
                ls="--",
                lw=1.2,
                label=f"budget {insp.budget / _MIB:.2f} MiB",
            )
        ax.set_title(
            f"{insp.target} {frag.name} {frag.short_code}: forward | backward", fontsize=10
        )
        ax.set_xlabel("schedule position (op)")
        ax.set_ylabel("device MiB")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    return fig


def render_png(fig: Figure, *, dpi: int = 100) -> bytes:
    """``fig`` as PNG bytes (Agg)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
