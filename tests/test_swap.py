"""Swapping saved tensors to the host and disk tiers: store, ops, planning, failures."""

from __future__ import annotations

import errno
import random

import pytest
import torch

import memcompile
from memcompile import zoo
from memcompile.report import find_compiler
from memcompile.rewrites.context import PassContext
from memcompile.rewrites.partition import partition_pass
from memcompile.rewrites.swap import swap_pass
from memcompile.runtime import store as store_module
from memcompile.runtime.store import OffloadError, TieredStore, register_store

from helpers import (
    built_phase_peaks,
    capture_joint,
    capture_module,
    plan_for,
    predicted_peak,
    train_under_budget,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("tier", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_offload_reload_round_trip_keeps_values_and_layout(tier: int, dtype: torch.dtype) -> None:
    key = register_store(TieredStore())
    x = (torch.arange(64 * 32) % 97).to(dtype).reshape(64, 32).t()  # dense, permuted
    host = torch.ops.memcompile.offload(x, key, tier)
    assert host.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    back = torch.ops.memcompile.reload(host, torch.device("cpu"), key, tier)
    torch.ops.memcompile.wait(back, key)  # the copy may run on the CPU's copy thread
    assert torch.equal(back, x) and back.stride() == x.stride() and back.dtype == dtype


def test_host_tier_memory_is_outside_torchs_allocator() -> None:
    key = register_store(TieredStore())
    x = torch.randn(256, 1024)

    def offload() -> torch.Tensor:
        return torch.ops.memcompile.offload(x, key, 0)

    # The profiler (torch's CPU allocator) sees nothing for the 1 MiB host copy.
    m = memcompile.measure(offload)
    assert m.peak == m.resident_bytes == x.numel() * 4
    assert m.result.shape == x.shape


def _peak_without_budget(name: str) -> int:
    return predicted_peak(name)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_swap_only_plan_meets_budget_bit_identically(tier: str, tmp_path) -> None:
    name = "gpt_manual"
    budget = int(_peak_without_budget(name) * 0.85)
    compiled, _, measured = train_under_budget(
        name, "sgd", budget, recompute=False, offload_to=tier, disk_path=str(tmp_path)
    )
    rep = memcompile.report(compiled)
    (plan,) = rep.plan.fragments
    assert plan.swapped and not plan.recomputed and set(plan.swapped.values()) == {tier}
    assert measured <= budget * 1.02 and abs(rep.predicted_peak - measured) <= 0.03 * measured
    store = find_compiler(compiled)[0].store
    assert store.bytes_out[tier] > 0 and store.bytes_in[tier] == store.bytes_out[tier]


def test_swap_false_plans_recompute_only() -> None:
    budget = int(_peak_without_budget("gpt_manual") * 0.85)
    torch._dynamo.reset()
    wl = zoo.build("gpt_manual", size="tiny")
    compiled = memcompile.compile(wl.model, budget=budget, swap=False)
    wl.loss(compiled, 0).backward()
    (plan,) = memcompile.report(compiled).plan.fragments
    assert plan.recomputed and not plan.swapped


def test_full_disk_raises_offload_error_and_leaves_parameters_untouched(
    monkeypatch, tmp_path
) -> None:
    budget = int(_peak_without_budget("gpt_manual") * 0.85)
    torch._dynamo.reset()
    wl = zoo.build("gpt_manual", size="tiny")
    compiled = memcompile.compile(
        wl.model, budget=budget, recompute=False, offload_to="disk", disk_path=str(tmp_path)
    )
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    wl.loss(compiled, 0).backward()  # compile and one good step
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    opt_before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state.items()}

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "write", full)
    with pytest.raises(
        OffloadError, match=r"disk tier: writing .* to '.*' failed: \[Errno 28\] No space left"
    ):
        wl.loss(compiled, 1).backward()
        opt.step()
    assert_same_state_dict = all(
        torch.equal(before[k], v) for k, v in wl.model.state_dict().items()
    )
    assert assert_same_state_dict
    assert all(torch.equal(opt_before[k][n], t) for k, s in opt.state.items() for n, t in s.items())


def test_joint_model_matches_built_graphs_with_swaps() -> None:
    found = capture_joint("gpt")
    model = found["model"]
    key = register_store(TieredStore())
    rng = random.Random(1)
    base = sorted(model.default_saved() - model.must_save())
    for keep_fraction in (1.0, 0.6):
        keep = frozenset(s for s in base if rng.random() < keep_fraction) | model.must_save()
        e0 = model.evaluate(keep)
        swaps = {s: "host" for s in sorted(e0.swappable) if rng.random() < 0.5}
        e = model.evaluate(keep, swaps)
        assert dict(e.swapped) == swaps and swaps
        plan = plan_for(model, keep)
        fw, bw = partition_pass(found["joint"], PassContext("F0"), model=model, plan=plan)
        holders = model.swap_holders(e.saved, swaps)
        fw, bw = swap_pass(
            fw, bw, PassContext("F0"), swaps={holders[s]: t for s, t in swaps.items()}, store=key
        )
        phases = built_phase_peaks(found, fw, bw)
        assert (e.forward_peak, e.backward_peak, e.accumulate_peak) == (
            phases["forward"],
            phases["backward"],
            phases["accumulate"],
        )
        assert e.backward_peak < e0.backward_peak  # the swapped tensors left the device


class _Gates(torch.nn.Module):
    """A recurrent cell's pattern: gates as pieces of one matmul (``chunk``), squashed by
    ``sigmoid``/``tanh``, whose backward reads their outputs through ``detach`` views."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 192)
        self.out = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, z, n = self.proj(x).chunk(3, dim=-1)
        h = torch.sigmoid(r) * torch.tanh(n) + torch.sigmoid(z)
        return self.out(h).pow(2).sum()


def test_views_of_saved_values_are_made_again_so_every_saved_storage_can_be_swapped() -> None:
    # The backward took a sigmoid's output both as itself and as its detach, and a gate as a
    # chunk of the matmul (a piece of its storage): no swap could copy those storages. Now it
    # takes the value that covers each storage, once, and makes the views again, free.
    found = capture_module(_Gates(), torch.randn(8, 64))
    model = found["model"]
    saved = model.default_saved() | model.must_save()
    e = model.evaluate(saved)
    assert e.swappable == e.saved != frozenset()
    _, recompute, inputs = model.backward_nodes(saved - model.persistent)
    assert all(sum(s in model.storages[i] for i in inputs) == 1 for s in e.saved)
    assert model.free_views and not set(recompute) & model.free_views
    assert e.recompute_time == 0  # views only: nothing is computed again


def test_a_gru_swaps_its_gates_and_trains_bit_identically() -> None:
    # The zoo GRU's per-step matmuls (its gates: the backward read them as split pieces) could
    # not be swapped, nor its sigmoid and tanh outputs (read through detach views). Now the
    # plan swaps them, and trains as eager does.
    budget = int(_peak_without_budget("gru") * 0.6)
    compiled, _, measured = train_under_budget("gru", "sgd", budget, recompute=False)
    rep = memcompile.report(compiled)
    swapped = {name for p in rep.plan.fragments for name in p.swapped}
    assert any(name.startswith("addmm_") for name in swapped), sorted(swapped)
    assert measured <= budget * 1.02
