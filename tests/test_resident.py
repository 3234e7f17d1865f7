"""step/resident.py: what a step holds on the device besides the graphs' own memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memcompile.config import MemConfig
from memcompile.runtime.measure import storage_sizes
from memcompile.step import resident as resident_mod
from memcompile.step.resident import ResidentSet


@pytest.mark.parametrize("host", [(), (0, 1)])
def test_the_devices_other_memory_never_counts_the_models_own_parameters(monkeypatch, host):
    # CUDA counts what else is allocated on the device at the first plan (other models, cuBLAS's
    # workspaces) against the budget. A first plan on the host tier leaves its parameters out of
    # the resident figure, but they are still allocated then: they are not someone else's. (An
    # H200: the GPT's 373.6 MB of parameters counted twice.) The allocator is a stub here.
    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    other = 4096  # what the device holds besides the model and its input
    mine = sum(storage_sizes([*model.parameters(), x]).values())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mine + other)
    monkeypatch.setattr(resident_mod, "_prime_backward_workspaces", lambda device: None)
    rs = ResidentSet(
        MemConfig.from_options({"budget": 1 << 20}),
        records=list,
        model=lambda: model,
        is_sharded=lambda t: False,
    )
    fragment = SimpleNamespace(
        index=0,
        example_inputs=[model.weight, model.bias, x],
        device=torch.device("cuda"),
        replan_resident=None,
        code="",
        inner_excess=0,
    )
    counted = rs.resident_bytes(fragment, host=host)
    assert rs.device_other_bytes == other
    hosted = sum(storage_sizes([model.weight, model.bias]).values()) if host else 0
    assert counted == mine - hosted + other
