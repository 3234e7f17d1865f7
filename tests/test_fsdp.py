"""memcompile under FSDP2's ``fully_shard`` (two CPU ranks over gloo).

FSDP2 all-gathers each unit's parameters before its forward and backward and reduce-scatters
the gradients, in hooks Dynamo does not trace: each unit's compute reaches memcompile as
fragments whose parameters are the unsharded ones. memcompile trains them bit-identically to
eager FSDP2, leaves the parameters to FSDP (never to its host tier) and says that FSDP's buffers
are outside its plans (``backends/sharded.py``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import _MLP as _LoopMLP
from test_distributed import _batch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import memcompile
from memcompile import MemoryBudgetError, MemoryBudgetWarning, RankDivergenceError
from memcompile.backends.sharded import sharded_params
from memcompile.report import find_compiler
from memcompile.runtime.measure import storage_sizes
from memcompile.runtime.store import can_host_place

from helpers import join_ranks, spawn_ranks, train_side_by_side

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

WORLD = 2
STEPS = 3


class _MLP(_LoopMLP):
    # The same layers, called one by one rather than in a loop: each unit's FSDP hooks break
    # the graph, and Dynamo cannot resume after a break inside a loop (it would run the whole
    # frame eagerly).
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b, c, d = self.layers
        x = nn.functional.gelu(a(x))
        x = nn.functional.gelu(b(x))
        x = nn.functional.gelu(c(x))
        return nn.functional.cross_entropy(d(x), y)


class _Block(nn.Module):
    # A user-defined block: Dynamo compiles its forward as a frame of its own (it skips the
    # frames of torch.nn's classes, such as nn.Linear's).
    def __init__(self, a: int, b: int, act: bool = True) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(a, b), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return nn.functional.gelu(x) if self.act else x


class _Blocks(nn.Module):
    # The same MLP as blocks called in a loop, as most models are written; the loop runs
    # eagerly (a non-recursive disable), each block's forward is a fragment.
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [_Block(16, 512), _Block(512, 512), _Block(512, 512), _Block(512, 5, act=False)]
        )

    @torch.compiler.disable(recursive=False)
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return nn.functional.cross_entropy(x, y)


PARAM_BYTES = sum(p.numel() * 4 for p in _MLP().parameters())


def _shard(model: _MLP, per_layer: bool, world: int, bf16: bool = False) -> _MLP:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    # bf16: FSDP gathers bf16 copies to compute with and reduces the gradients in float32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw: dict[str, Any] = {"mp_policy": mp} if bf16 else {}
    if per_layer:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _rank(
    rank: int,
    world: int,
    per_layer: bool,
    options: dict[str, Any],
    out: str,
    bf16: bool = False,
    blocks: bool = False,
) -> None:
    # One rank: memcompile's FSDP2 copy and an eager FSDP2 copy of the same model, trained side
    # by side with Adam; the parameters (DTensor shards) are compared whole.
    join_ranks(rank, world, out)
    try:
        model = _Blocks() if blocks else _MLP()
        ref = _shard(copy.deepcopy(model), per_layer, world, bf16)
        model = _shard(model, per_layer, world, bf16)
        compiled = torch.compile(model, backend="memcompile", options=options)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pairs = ((compiled, opt), (ref, opt_ref))
                train_side_by_side(pairs, STEPS, lambda step: _batch(step, rank))
            except MemoryBudgetError as e:
                Path(out, f"rank{rank}.json").write_text(json.dumps({"error": str(e)}))
                return
            report = memcompile.report(compiled)
        result = {
            "same": all(
                torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(model.parameters(), ref.parameters(), strict=True)
            ),
            "fragments": len(report.fragments),
            "fallbacks": len(report.fallbacks),
            "dynamic": report.dynamic,
            "exact": report.exact,
            "host_param_bytes": report.host_param_bytes,
            "sharded_param_bytes": report.sharded_param_bytes,
            "text": str(report),
            "budget_warnings": [
                str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)
            ],
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as in test_distributed.py: no gloo teardown (pytorch/pytorch#56297)


@pytest.mark.parametrize(
    ("per_layer", "bf16"),
    [(True, False), (False, False), (True, True)],
    ids=["per_layer", "root", "per_layer_bf16"],
)
def test_fsdp2_units_train_bit_identical_to_eager_fsdp2(tmp_path, per_layer, bf16) -> None:
    args = (WORLD, per_layer, {}, str(tmp_path), bf16)
    results = spawn_ranks(_rank, args, tmp_path, WORLD)
    for r in results:
        assert r["same"], r  # all parameters, gathered, after 3 Adam steps
        # Per layer: one fragment per unit (FSDP's hooks break the graph), else one.
        assert r["fragments"] == (4 if per_layer else 1) and r["fallbacks"] == 0, r
        # FSDP all-gathers each unit's parameters into a new allocation every step: still
        # one parameter set per fragment, not a dynamic model (it was, by their addresses).
        assert r["dynamic"] == "", r
        # In float32, the sharded parameters' dtype, also where FSDP computes with bf16 copies.
        assert r["sharded_param_bytes"] == PARAM_BYTES and not r["exact"], r
        assert "FSDP2 manages 2.05 MiB of parameters (unsharded)" in r["text"], r
        assert not r["budget_warnings"], r


def test_fsdp2_blocks_called_in_a_loop_are_fragments_under_a_non_recursive_disable(
    tmp_path,
) -> None:
    # Per-block FSDP with the blocks called in a loop: with the loop's function compiled,
    # FSDP's hooks would break the graph inside the loop and Dynamo would run it all eagerly.
    # Disabled non-recursively, the loop runs eagerly and every block's forward is compiled by
    # the same compiler (one budget for the step).
    args = (WORLD, True, {}, str(tmp_path), False, True)
    results = spawn_ranks(_rank, args, tmp_path, WORLD)
    for r in results:
        assert r["same"], r
        # Block 0; one graph with dynamic sizes for the 512-wide GELU blocks (Dynamo's
        # automatic dynamic shapes after the second block's new sizes); the last block.
        assert r["fragments"] == 3 and r["fallbacks"] == 0, r
        assert r["sharded_param_bytes"] == PARAM_BYTES, r


@pytest.mark.parametrize(
    ("world", "per_layer"), [(2, True), (1, False)], ids=["2_ranks_per_layer", "1_rank_root"]
)
def test_fsdp2_parameters_stay_with_fsdp_under_offload_params(tmp_path, world, per_layer) -> None:
    # best_effort: with 1 rank the parameters and their gradients alone pass the budget.
    options = {"budget": 3_000_000, "offload_params": True, "on_infeasible": "best_effort"}
    results = spawn_ranks(_rank, (world, per_layer, options, str(tmp_path)), tmp_path, world)
    units = 5 if per_layer else 1
    for r in results:
        assert r["same"], r
        # No parameter moved to memcompile's host tier: FSDP writes their storages. (With 2
        # ranks FSDP's unsharded parameters are views of its all-gather buffer, which the host
        # tier would not take anyway; with 1 rank each has a storage of its own, and before
        # memcompile knew FSDP it moved all 2.05 MiB.)
        assert r["host_param_bytes"] == 0, r
        warned = " | ".join(r["budget_warnings"])
        assert "are managed by FSDP2 and stay with it (offload_params=True moves none" in warned
        assert "CPUOffloadPolicy" in warned
        # Under a budget the user is told what the plans do not see.
        assert f"sharded by FSDP2 ({units} fully_shard units, 2.05 MiB of parameters" in warned
        assert "neither the plans nor the predicted peak count them" in warned


def test_an_fsdp2_budget_no_plan_fits_names_fsdp_in_its_error(tmp_path) -> None:
    # One rank: FSDP2's parameters (2.05 MiB, unsharded) and their gradients alone pass 3 MB.
    [r] = spawn_ranks(_rank, (1, False, {"budget": 3_000_000}, str(tmp_path)), tmp_path, 1)
    assert "no memory plan fits budget=2.86 MiB" in r["error"], r
    # Not "offload_params=True keeps parameters on the host": memcompile leaves them to FSDP.
    assert "FSDP2 manages the parameters (more ranks shard them thinner" in r["error"], r
    assert "offload_params" not in r["error"], r


class _EarlyExit(nn.Module):
    # Runs layers 0, [1, [2]], 3: ``stop`` picks the path (Dynamo compiles one frame per path).
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64)])
        self.layers.append(nn.Linear(64, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor, stop: int) -> torch.Tensor:
        a, b, c, d = self.layers
        x = nn.functional.gelu(a(x))
        if stop > 1:
            x = nn.functional.gelu(b(x))
        if stop > 2:
            x = nn.functional.gelu(c(x))
        return nn.functional.cross_entropy(d(x), y)


def _rank_paths(rank: int, options: dict[str, Any], stops: list[list[int]], out: str) -> None:
    # One rank of the early-exit model, sharded per layer, under memcompile and eagerly, step s
    # taking path stops[s][rank]; a RankDivergenceError is recorded, not raised.
    join_ranks(rank, WORLD, out, seconds=60)
    result: dict[str, Any] = {}
    try:
        model = _EarlyExit()
        ref = _shard(copy.deepcopy(model), True, WORLD)
        model = _shard(model, True, WORLD)
        compiled = torch.compile(model, backend="memcompile", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for step, by_rank in enumerate(stops):
                    x, y = _batch(step, rank)
                    for fn, o in ((compiled, opt), (ref, opt_ref)):
                        o.zero_grad(set_to_none=True)
                        fn(x, y, by_rank[rank]).backward()
                        o.step()
            except RankDivergenceError as e:
                result["error"], result["units"] = str(e), list(e.units)
        compiler, _ = find_compiler(compiled)
        result.update(
            same=all(
                torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(model.parameters(), ref.parameters(), strict=True)
            )
            if "error" not in result
            else None,
            checked=compiler.rank_check.calls if compiler.rank_check is not None else None,
            warned=[str(w.message) for w in caught if w.category is UserWarning],
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if "error" not in result:
            dist.destroy_process_group()
    os._exit(0)


def test_check_ranks_raises_when_the_ranks_take_different_units(tmp_path) -> None:
    # Step 0: both ranks run layers 0..3; step 1: rank 0 runs 0, 1, 2, 3 and rank 1 exits after
    # 0 (then 3). Without the check FSDP's all-gathers would not match (gloo aborts or hangs).
    stops = [[3, 3], [3, 1]]
    results = spawn_ranks(_rank_paths, ({"check_ranks": True}, stops, str(tmp_path)), tmp_path)
    for r in results:
        assert r["units"] == ["layers.1", "layers.3"], r
        # Both ranks at the same unit call (the check starts at the first compile), different
        # units.
        assert re.search(
            r"rank 0: layers\.1 \(unit call (\d+)\), rank 1: layers\.3 \(unit call \1\)", r["error"]
        ), r
        assert "needs every rank to run the same units in the same order" in r["error"], r


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_ranks_on_one_path_train_bit_identically_and_are_told_about_paths(tmp_path, check):
    # Both ranks take the same path each step, a different one from step to step: the model is
    # dynamic (one frame per path). Unchecked, memcompile says that ranks must agree.
    stops = [[3, 3], [1, 1], [2, 2]]
    results = spawn_ranks(_rank_paths, ({"check_ranks": check}, stops, str(tmp_path)), tmp_path)
    for r in results:
        assert "error" not in r and r["same"], r
        warned = " | ".join(r["warned"])
        if check:
            # Root, 0, 1, 2, 3 / root, 0, 3 / root, 0, 1, 3: 12 unit forwards, less the root's
            # and layer 0's of the first step (the check starts at the first compile).
            assert r["checked"] == 10, r
            assert "takes different paths" not in warned, r
        else:
            assert r["checked"] is None, r
            assert "sharded by FSDP2 and takes different paths (F" in warned, r
            assert "check_ranks=True makes memcompile compare them" in warned, r


def test_check_ranks_without_fully_shard_says_there_is_nothing_to_check() -> None:
    torch._dynamo.reset()
    compiled = memcompile.compile(_MLP(), check_ranks=True)
    x, y = _batch(0, 0)
    with pytest.warns(UserWarning, match=r"check_ranks=True, but the model has no FSDP2"):
        compiled(x, y).backward()
    torch._dynamo.reset()


def test_a_wrapper_subclass_counts_the_storages_it_wraps() -> None:
    # FSDP2's parameters are DTensors, whose own storage is not valid; a traceable wrapper
    # subclass (TwoTensor: two plain tensors) stands in for one here, without a process group.
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    wrapped = TwoTensor(a, b)
    found = storage_sizes([wrapped])
    assert found == {a.untyped_storage().data_ptr(): 64, b.untyped_storage().data_ptr(): 64}
    assert not can_host_place(wrapped)


def test_a_model_without_fully_shard_has_no_sharded_parameters() -> None:
    assert sharded_params(_MLP()) is None
    assert sharded_params(None) is None
