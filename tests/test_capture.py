"""``memcompile.viz.capture.collect`` (what ``memcompile inspect`` and ``plan`` run): the snapshot
describes the plans training settles on, and every fragment says where its code is."""

from __future__ import annotations

import torch

from memcompile import zoo
from memcompile.viz.capture import collect


def test_collect_measures_the_plans_a_replanned_model_settles_on() -> None:
    # The tiny MoE at 60 % of its unplanned step is planned again after its first steps (the
    # step is predicted over budget). Measured in the step that compiled the new plans, it read
    # 461,008 B against 441,628 B predicted (-4.2 %); after the re-plans, within 0.2 %.
    stats = torch._dynamo.utils.counters["stats"]
    start = stats["unique_graphs"]
    insp = collect(zoo.build("moe", size="tiny"), budget="60%")
    assert insp.measured_peak is not None and insp.predicted_peak is not None
    assert abs(insp.predicted_peak - insp.measured_peak) <= 0.03 * insp.measured_peak, (
        insp.predicted_peak,
        insp.measured_peak,
    )
    assert stats["unique_graphs"] > start  # it compiled (the scenario)


def test_every_fragment_of_the_moe_names_its_code() -> None:
    # The routing frame's graph has no user stack from Dynamo: its compiled code names it.
    insp = collect(zoo.build("moe", size="tiny"), before=False, measure=False)
    codes = {f.name: f.code for f in insp.fragments}
    assert all("<unknown>" not in c for c in codes.values()), codes
    assert any(c.startswith("route (") for c in codes.values()), codes
