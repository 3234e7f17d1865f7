"""memcompile.viz: the Inspection snapshot and the notebook views (inline SVG / PNG)."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest

import memcompile
from memcompile.cli_target import resolve_target
from memcompile.viz.capture import resolve_budget

import cli_targets

pytest.importorskip("graphviz", reason="the viz extra (graphviz, matplotlib) is not installed")
pytest.importorskip("matplotlib", reason="the viz extra (graphviz, matplotlib) is not installed")

# after the skips: these need the viz extra
import memcompile.viz as mv
from memcompile.viz.draw import node_roles
from memcompile.viz.fragments import transition_graph

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's `dot` program is not installed"
)


@pytest.fixture(scope="module")
def swapped() -> mv.Inspection:
    """The MLP planned with swaps only: one tensor to the host, its reload prefetched."""
    wl = resolve_target("cli_targets:mlp")
    # 80 %: the backward's elementwise ops in place alone bring it to 82 % (no swap needed).
    return mv.collect(wl, budget="80%", measure=False, recompute=False)


def test_inspection_survives_its_json_round_trip(swapped: mv.Inspection, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(swapped.to_json())
    assert mv.load(path) == swapped


def test_node_roles_follow_the_plan(swapped: mv.Inspection) -> None:
    (frag,) = swapped.fragments
    plan = swapped.plan_of(frag)
    assert plan is not None and plan.swapped and plan.prefetch
    roles = node_roles(frag, plan)
    for d in plan.decisions:
        expected = {"keep": "keep", "recompute": "recompute"}.get(d.action, "swap")
        assert roles[("forward", d.tensor)] == expected
    reloads = {name for (kind, name), _ in roles.items() if name.startswith("reload")}
    assert reloads == {r for r, _ in plan.prefetch}
    assert all(roles[("backward", r)] == "prefetch" for r in reloads)
    assert any(role == "swap" and name.startswith("offload") for (_, name), role in roles.items())
    assert roles[("forward", frag.forward.nodes[0].name)] == "input"  # type: ignore[union-attr]


def test_host_placed_parameters_and_their_fetches_have_their_role() -> None:
    wl = resolve_target("cli_targets:mlp")
    insp = mv.collect(wl, measure=False, offload_params=True)
    (frag,) = insp.fragments
    plan = insp.plan_of(frag)
    assert plan is not None and plan.host_params
    roles = node_roles(frag, plan)
    hosted = {name for (kind, name), role in roles.items() if role == "host_parameter"}
    assert set(plan.host_params) <= hosted
    assert any(name.startswith("fetch_param") for name in hosted)


def test_the_pilots_in_graph_prediction_is_drawn_as_a_prefetch() -> None:
    wl = resolve_target("cli_targets:mlp")
    insp = mv.collect(wl, measure=False, offload_params=True, pilot="markov")
    (frag,) = insp.fragments
    assert frag.forward is not None
    roles = node_roles(frag, insp.plan_of(frag))
    (op,) = (n for n in frag.forward.nodes if n.target == "memcompile.pilot_prefetch.default")
    assert roles[("forward", op.name)] == "prefetch"


@needs_dot
def test_show_plan_displays_inline_svg_and_saves(swapped: mv.Inspection, tmp_path: Path) -> None:
    img = mv.show_plan(swapped)
    svg = img._repr_svg_()
    assert "<svg" in svg and "PEAK" in svg and "reload" in svg
    assert img.save(tmp_path / "p.svg").read_text() == svg


def test_show_timeline_displays_inline_png_and_saves(
    swapped: mv.Inspection, tmp_path: Path
) -> None:
    from memcompile.viz.timeline import curve

    img = mv.show_timeline(swapped)
    assert img._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert img.save(tmp_path / "t.png").read_bytes() == img.png
    (frag,) = swapped.fragments
    after, _ = curve(frag, frag.forward, frag.backward)
    before, _ = curve(frag, frag.before_forward, frag.before_backward)
    assert swapped.budget is not None
    assert max(after) <= swapped.budget < max(before)  # the plot's two curves and its line
    assert max(after) == swapped.predicted_peak


@needs_dot
def test_show_fragments_draws_the_block_transitions(swapped: mv.Inspection) -> None:
    g = transition_graph(swapped)
    assert list(g.nodes) == ["F0.fw", "F0.bw"]
    assert g.edges["F0.fw", "F0.bw"]["count"] == 1
    svg = mv.show_fragments(swapped)._repr_svg_()
    assert "F0.fw" in svg and "F0.bw" in svg


def test_a_compiled_model_is_shown_from_its_report() -> None:
    model, batch = cli_targets.mlp()
    compiled = memcompile.compile(model)
    import torch.nn.functional as F

    F.cross_entropy(compiled(batch[0]), batch[1]).backward()
    insp = mv.as_inspection(compiled)
    assert insp.target == "Sequential" and insp.before_peak is None
    assert [c.label for c in insp.step] == ["F0.fw", "F0.bw"]
    assert mv.show_timeline(insp).png[:4] == b"\x89PNG"
    with pytest.raises(TypeError, match="memcompile"):
        mv.as_inspection(object())


def test_a_percentage_budget_is_relative_to_the_unplanned_step() -> None:
    assert resolve_budget("50%", resident=100, unplanned_peak=300) == 200
    assert resolve_budget("1KiB", resident=0, unplanned_peak=None) == 1024
    assert resolve_budget(None, resident=0, unplanned_peak=None) is None
    with pytest.raises(ValueError, match="needs the unplanned step"):
        resolve_budget("50%", resident=0, unplanned_peak=None)
    with pytest.raises(ValueError, match="positive percentage"):
        resolve_budget("-5%", resident=0, unplanned_peak=10)


@pytest.fixture(scope="module")
def gpt() -> mv.Inspection:
    """The tiny zoo GPT under a budget that recomputes and swaps: 452 nodes in all."""
    from memcompile import zoo

    return mv.collect(zoo.build("gpt", size="tiny"), budget="50%", measure=False)


def _drawn_nodes(source: str) -> list[str]:
    """Node statements of a dot source, the legend's left out."""
    return [ln for ln in source.splitlines() if "fillcolor=" in ln and '"legend/' not in ln]


def test_runs_cut_the_schedule_where_the_decision_changes(gpt: mv.Inspection) -> None:
    from memcompile.viz.draw import runs

    (frag,) = gpt.fragments
    roles = node_roles(frag, gpt.plan_of(frag))
    for graph in (frag.forward, frag.backward):
        assert graph is not None
        cut = runs(graph, roles)
        assert [n for run in cut for n in run] == [n for n in graph.nodes if n.op != "output"]
        decided = [{roles[(graph.kind, n.name)] for n in run} - {"op"} for run in cut]
        assert all(len(d) <= 1 for d in decided)
        assert all(decided)  # a run starts at a decided node (plain ops join the run they're in)
        assert all(a != b for a, b in itertools.pairwise(decided))  # cut where it changes


def test_the_compact_drawing_is_much_smaller_keeps_colours_and_the_peak(
    gpt: mv.Inspection,
) -> None:
    from memcompile.viz.draw import COMPACT_ABOVE, ROLE_COLOURS, node_count, plan_digraph

    full = plan_digraph(gpt, compact=False).source
    compact = plan_digraph(gpt, compact=True).source
    assert node_count(gpt) > COMPACT_ABOVE
    assert len(_drawn_nodes(compact)) * 4 < len(_drawn_nodes(full))
    for role in ("keep", "recompute", "swap", "prefetch", "input"):
        colour = f'fillcolor="{ROLE_COLOURS[role]}"'
        assert colour in full, role  # the plan uses it ...
        assert any(colour in ln for ln in _drawn_nodes(compact)), role  # ... and so does the box
    (frag,) = gpt.fragments
    (peak,) = [ln for ln in _drawn_nodes(compact) if "PEAK" in ln]
    assert f"at {frag.peak_node}" in peak and "penwidth=3" in peak
    assert "(compact: runs of nodes)" in compact
    assert plan_digraph(gpt).source == compact  # automatic above COMPACT_ABOVE nodes


def test_small_graphs_are_drawn_in_full_by_default(swapped: mv.Inspection) -> None:
    from memcompile.viz.draw import plan_digraph

    assert plan_digraph(swapped).source == plan_digraph(swapped, compact=False).source
    assert "compact" not in plan_digraph(swapped).source


@needs_dot
def test_show_plan_renders_the_compact_drawing(gpt: mv.Inspection) -> None:
    svg = mv.show_plan(gpt, compact=True)._repr_svg_()
    assert "<svg" in svg and "PEAK" in svg and " nodes: " in svg


def _trace(*steps: str) -> list[Any]:
    """StepTraces of forward blocks; ``"r a b"``: the root fragment's block, then experts."""
    from memcompile.dynamic.trace import BlockEvent, StepTrace

    def event(name: str) -> BlockEvent:
        block = "ffff/" if name == "r" else f"eeee/experts.{name}"
        return BlockEvent("forward", block.split("/")[0], block, 0.0)

    out = []
    for i, s in enumerate(steps):
        events = [event(n) for n in s.split()]
        events.append(BlockEvent("backward", "ffff", "ffff/", 0.0))  # not counted
        out.append(StepTrace(i, tuple(events)))
    return out


def test_trace_transitions_carry_probabilities_per_source_block() -> None:
    from memcompile.viz.fragments import trace_transition_graph

    g = trace_transition_graph(_trace("r 0 1", "r 0 2", "r 0 1", "r 3"))
    assert list(g.nodes) == [
        "F0:root",
        "F1:experts.0",
        "F1:experts.1",
        "F1:experts.2",
        "F1:experts.3",
    ]
    assert g.nodes["F0:root"]["calls"] == 4
    assert g.edges["F0:root", "F1:experts.0"]["p"] == 0.75
    assert g.edges["F0:root", "F1:experts.3"]["p"] == 0.25
    assert g.edges["F1:experts.0", "F1:experts.1"]["count"] == 2
    assert g.edges["F1:experts.0", "F1:experts.1"]["p"] == pytest.approx(2 / 3)
    assert not g.has_edge("F1:experts.1", "F0:root")  # no edge across steps
    for a in g.nodes:
        out = [d["p"] for _, _, d in g.out_edges(a, data=True)]
        assert not out or sum(out) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no block calls in phases forward"):
        trace_transition_graph(_trace("r")[:0])


@needs_dot
def test_show_fragments_of_a_trace_labels_edges_with_probabilities() -> None:
    svg = mv.show_fragments(_trace("r 0 1", "r 0 2"))._repr_svg_()
    assert "F1:experts.0" in svg and "p=0.50" in svg and "p=1.00 (2)" in svg
    # four blocks, three edges: "F1:experts.0" is one node, not node F1 with a port
    assert svg.count('class="node"') == 4 and svg.count('class="edge"') == 3
    counts = mv.show_fragments(_trace("r 0 1", "r 0 2"), probabilities=False)._repr_svg_()
    assert "p=" not in counts
    with pytest.raises(TypeError, match="must hold StepTrace"):
        mv.show_fragments([1, 2])
