"""The model zoo: registry, determinism, eager training, Dynamo fragment structure, bit-identity.

Compiled runs use a reference backend (AOTAutograd with the default partitioner, the FX graphs run
as-is), so these tests check the zoo and its Dynamo behaviour independently of memcompile.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters, get_compilation_metrics
from torch._functorch.partitioners import default_partition
from torch.fx.graph import _BoxedCodeGen

from memcompile import zoo
from memcompile.zoo import SIZES, Workload

from helpers import assert_same_state

NAMES = (
    "branchy",
    "early_exit",
    "early_exit_natural",
    "gpt",
    "gpt_manual",
    "gru",
    "moe",
    "moe_natural",
    "moe_natural_top2",
    "resnet",
    "tree_natural",
    "treelstm",
)
# Parameters that may legitimately get no gradient in a step: experts nobody was routed to,
# blocks and exits past the exit taken. At least one of them must get one.
OPTIONAL_GRADS = {
    "moe": r"\.experts\.",
    "early_exit": r"^(blocks|exits)\.\d+\.",
    "moe_natural": r"^(experts|routers)\.",  # top-1 by int(argmax): no gradient to routers
    "moe_natural_top2": r"^experts\.",
    "early_exit_natural": r"^(blocks|exits)\.\d+\.",
}
# Written the natural way: Dynamo falls back on their forward by design (tests/test_regions.py).
NATURAL = ("early_exit_natural", "moe_natural", "moe_natural_top2", "tree_natural")
DYNAMO = tuple(n for n in NAMES if n not in NATURAL)


# --- reference backend ---------------------------------------------------------------------


@dataclass
class Recorder:
    """A Dynamo backend that counts compiles and fragment calls, then runs AOTAutograd graphs."""

    reasons: list[str] = field(default_factory=list)  # one per compile
    calls: int = 0  # fragment (forward) calls

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        reason: Any = gm.compile_subgraph_reason  # set by Dynamo on the graphs it hands over
        self.reasons.append(reason.reason.splitlines()[0])
        compiled = aot_autograd(
            fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=default_partition
        )(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


def _boxed(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm.forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _dynamo_failures() -> list[str]:
    """Frames Dynamo fell back to eager on, with the reason, since the last reset."""
    failed = [
        f"{m.co_name}: {(m.fail_reason or '').splitlines()[0]}"
        for m in get_compilation_metrics()
        if m.fail_type
    ]
    frames = counters["frames"]
    if frames["total"] != frames["ok"] and not failed:
        failed.append(f"frames {dict(frames)}")
    return failed


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.utils.clear_compilation_metrics()  # they survive reset(); failures are read there
    with torch._dynamo.config.patch(allow_empty_graphs=True):
        yield
    torch._dynamo.reset()


# --- helpers -------------------------------------------------------------------------------


def _tensors(batch: tuple[Any, ...]) -> list[torch.Tensor]:
    return [x for x in batch if isinstance(x, torch.Tensor)]


def _same_batch(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
        for x, y in zip(ta, tb, strict=True)
    )


# --- registry ------------------------------------------------------------------------------


def test_every_workload_registered() -> None:
    assert zoo.names() == NAMES


def test_unknown_name_rejected() -> None:
    with pytest.raises(ValueError, match="unknown zoo workload") as err:
        zoo.build("no_such_model")
    assert all(name in str(err.value) for name in NAMES)


def test_bad_size_rejected() -> None:
    with pytest.raises(ValueError, match="size must be one of") as err:
        zoo.build("gpt", size="huge")
    assert all(size in str(err.value) for size in SIZES)


def test_train_rejects_an_unknown_optimizer_and_negative_steps() -> None:
    wl = zoo.build("gpt", size="tiny")
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam'; got 'lbfgs'"):
        wl.train(wl.model, 1, optimizer="lbfgs")
    with pytest.raises(ValueError, match="steps must be >= 0; got -1"):
        wl.train(wl.model, -1)


def test_train_returns_one_detached_loss_per_step_and_moves_the_weights() -> None:
    wl = zoo.build("gpt", size="tiny")
    before = [p.detach().clone() for p in wl.model.parameters()]
    losses = wl.train(wl.model, 2, optimizer="adam")
    assert len(losses) == 2 and all(not x.requires_grad and x.dim() == 0 for x in losses)
    after = list(wl.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_workload_metadata(name: str) -> None:
    wl = zoo.build(name, size="tiny")
    assert wl.name == name
    assert wl.summary and "\n" not in wl.summary
    assert wl.extra
    assert wl.single_fragment != (name in ("moe", "early_exit", "treelstm", *NATURAL))
    assert wl.dynamic == (name in ("moe", "early_exit", "treelstm", "gru", *NATURAL))
    assert bool(wl.extra.get("natural")) == (name in NATURAL)


def test_gpt_bench_matches_anchor_configuration() -> None:
    wl = zoo.build("gpt", size="bench")
    cfg = {k: wl.extra[k] for k in ("layers", "d_model", "heads", "seq_len", "batch", "vocab")}
    assert cfg == dict(layers=4, d_model=256, heads=4, seq_len=256, batch=8, vocab=2048)
    n_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert n_bytes / 2**20 == pytest.approx(16.3, abs=0.05)


# --- determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_determinism(name: str) -> None:
    a, b = zoo.build(name, size="tiny", seed=3), zoo.build(name, size="tiny", seed=3)
    assert_same_state(a.model, b.model)
    for step in range(3):
        assert _same_batch(a.batch(step), b.batch(step))
        assert _same_batch(a.batch(step), a.batch(step))
    assert any(not _same_batch(a.batch(0), a.batch(step)) for step in range(1, 4))
    # Batches must not touch the global RNG.
    state = torch.get_rng_state()
    a.batch(7)
    assert torch.equal(state, torch.get_rng_state())
    c = zoo.build(name, size="tiny", seed=4)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True)
    )


# --- eager training ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_eager_step(name: str) -> None:
    wl = zoo.build(name, size="tiny")
    loss = wl.loss(wl.model, 0)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert math.isfinite(loss.item())
    loss.backward()
    optional = re.compile(OPTIONAL_GRADS.get(name, r"(?!)"))
    got_optional = False
    for pname, p in wl.model.named_parameters():
        if p.grad is None:
            assert optional.search(pname), f"{pname} got no gradient"
            continue
        assert torch.isfinite(p.grad).all(), pname
        got_optional |= bool(optional.search(pname))
    if name in OPTIONAL_GRADS:
        assert got_optional, "no optional parameter got a gradient"


def test_early_exit_depth_varies() -> None:
    wl = zoo.build("early_exit", size="tiny")
    depths = {wl.model.exit_depth(wl.batch(step)[0]) for step in range(6)}  # type: ignore[operator]
    assert len(depths) >= 2


def test_gru_lengths_vary() -> None:
    wl = zoo.build("gru", size="tiny")
    assert len({wl.batch(step)[0].shape[1] for step in range(6)}) >= 2


# --- Dynamo fragment structure -------------------------------------------------------------


def _expected_calls(wl: Workload, step: int) -> tuple[int, int]:
    """(min, max) fragment calls of ``step`` as documented by the workload's module."""
    if wl.single_fragment:
        return 1, 1
    batch = wl.batch(step)
    if wl.name == "early_exit":
        layers = wl.extra["layers"]
        depth = wl.model.exit_depth(batch[0])  # type: ignore[operator]
        n = layers if depth == layers - 1 else depth + 2
        return n, n
    if wl.name == "treelstm":
        n = batch[0].numel() + 2
        return n, n
    if wl.name == "moe":
        layers, experts, k = wl.extra["layers"], wl.extra["experts"], wl.extra["top_k"]
        return 2 + layers * (1 + k), 2 + layers * (1 + experts)
    raise AssertionError(f"no documented fragment structure for {wl.name}")


# Most compiles 3 training steps may take (tiny): gru compiles once per padded length.
MAX_COMPILES = {"moe": 5, "early_exit": 7, "treelstm": 6, "gru": 3}


@pytest.mark.parametrize("name", DYNAMO)
def test_fragment_structure(name: str) -> None:
    wl = zoo.build(name, size="tiny")
    rec = Recorder()
    compiled = torch.compile(wl.model, backend=rec)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1)
    for step in range(3):
        lo, hi = _expected_calls(wl, step)  # before the step: early exits depend on the params
        before = rec.calls
        opt.zero_grad(set_to_none=True)
        wl.loss(compiled, step).backward()
        opt.step()
        n = rec.calls - before
        assert lo <= n <= hi, f"step {step}: {n} fragment calls, expected {lo}..{hi}"
    assert not _dynamo_failures(), _dynamo_failures()
    assert 1 <= len(rec.reasons) <= MAX_COMPILES.get(name, 1), rec.reasons


# --- bit-identity with eager ---------------------------------------------------------------


# Plain Dynamo (no memcompile): every zoo model compiles without fallbacks and trains like eager.
# Adam on two models only, for CI time: test_zoo_memcompile.py trains every model with both.
@pytest.mark.parametrize(
    ("name", "optimizer"),
    [(n, "sgd") for n in DYNAMO] + [("gpt", "adam"), ("moe", "adam")],
)
def test_bit_identical_to_eager(name: str, optimizer: str) -> None:
    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, 3, optimizer=optimizer)
    compiled_losses = comp.train(
        torch.compile(comp.model, backend=Recorder()), 3, optimizer=optimizer
    )
    assert not _dynamo_failures(), _dynamo_failures()
    for step, (a, b) in enumerate(zip(eager_losses, compiled_losses, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    assert_same_state(eager.model, comp.model)  # parameters and buffers (BatchNorm stats)


def test_workload_to_moves_the_model_and_every_batch() -> None:
    wl = zoo.build("gpt", size="tiny")
    moved = wl.to("meta")
    assert moved.model is wl.model  # in place, as nn.Module.to
    assert all(p.device.type == "meta" for p in wl.model.parameters())
    batch = moved.batch(3)
    assert batch and all(b.device.type == "meta" for b in batch if isinstance(b, torch.Tensor))
    assert all(b.device.type == "cpu" for b in wl.batch(3) if isinstance(b, torch.Tensor))
