"""Dynamic networks written the natural way: Python control flow on tensor values, no
``torch.compiler`` calls (``moe_natural``, ``moe_natural_top2``, ``early_exit_natural``,
``tree_natural``).

The other zoo models are written so that Dynamo compiles every frame (``moe.py`` orchestrates in
``torch.compiler.disable(recursive=False)`` functions; ``early_exit.py`` returns from inside its
loop instead of breaking). These are written as a user would, so Dynamo gives up on their
``forward`` (a graph break inside a loop: ``int(...)``, ``.tolist()``, ``.item()``) and runs it
eagerly; memcompile compiles the ``torch.nn`` modules it calls as fragments of their own
(``backends/regions.py``)::

    moe_natural             for each layer: e = int(router(ln(x)).mean((0, 1)).argmax())
                                            x = x + experts[e](ln(x))      # nn.Sequential experts
    moe_natural_top2        the two experts of highest mean router probability, weighted by it
    early_exit_natural      for each block: x = x + block(x); logits = exit(x)
                                            if confidence(logits).item() > t: break
    tree_natural            encode(node) = emb(leaf) or cell(cat(encode(left), encode(right))):
                            Python recursion over a binary tree (nested tuples), a new tree
                            every step (Dynamo recompiles per tree until its recompile limit)
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator
from memcompile.zoo.early_exit import build_early_exit

_MOE: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, experts=4, d_model=32, vocab=64, seq=16, batch=4),
    "small": dict(layers=4, experts=8, d_model=128, vocab=256, seq=64, batch=8),
    "bench": dict(layers=8, experts=8, d_model=512, vocab=1024, seq=256, batch=8),
}
_TREE: dict[str, dict[str, int]] = {
    "tiny": dict(vocab=64, d_model=32, classes=4, leaves=8),
    "small": dict(vocab=512, d_model=256, classes=8, leaves=24),
    "bench": dict(vocab=2048, d_model=512, classes=16, leaves=64),
}


class NaturalMoE(nn.Module):
    """A token-level language model whose layers each route the batch to ``top_k`` of their
    experts by the router's mean probability, in a plain Python loop."""

    def __init__(self, *, layers: int, experts: int, d_model: int, vocab: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.emb = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.routers = nn.ModuleList(nn.Linear(d_model, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(
                nn.Sequential(
                    nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
                )
                for _ in range(experts)
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in range(len(self.experts)):
            h = self.norms[layer](x)
            probs = self.routers[layer](h).softmax(-1).mean((0, 1))
            experts: nn.ModuleList = self.experts[layer]  # type: ignore[assignment]
            if self.top_k == 1:
                e = int(probs.argmax())
                x = x + experts[e](h)
            else:
                top = probs.topk(self.top_k)
                for w, e in zip(top.values, top.indices.tolist(), strict=True):
                    x = x + w * experts[e](h)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class NaturalEarlyExit(nn.Module):
    """A residual MLP classifier that stops at the first exit confident enough (``break``)."""

    def __init__(
        self, *, layers: int, d_in: int, d_model: int, classes: int, thresholds: list[float]
    ) -> None:
        super().__init__()
        self.thresholds = [*thresholds, 0.0]  # the last exit always takes
        self.inp = nn.Linear(d_in, d_model)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(d_model),
                nn.Linear(d_model, 2 * d_model),
                nn.GELU(),
                nn.Linear(2 * d_model, d_model),
            )
            for _ in range(layers)
        )
        self.exits = nn.ModuleList(nn.Linear(d_model, classes) for _ in range(layers))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block, head, threshold in zip(self.blocks, self.exits, self.thresholds, strict=True):
            x = x + block(x)
            logits = head(x)
            if logits.softmax(-1).amax(-1).mean().item() >= threshold:
                break
        return F.cross_entropy(logits, labels)


class NaturalTree(nn.Module):
    """A recursive network over a binary tree given as nested tuples of leaf positions."""

    def __init__(self, *, vocab: int, d_model: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.cell = nn.Sequential(nn.Linear(2 * d_model, d_model), nn.Tanh())
        self.head = nn.Linear(d_model, classes)

    def encode(self, node: Any, leaves: torch.Tensor) -> torch.Tensor:
        if isinstance(node, int):
            return self.emb(leaves[node])
        left, right = node
        return self.cell(torch.cat([self.encode(left, leaves), self.encode(right, leaves)], -1))

    def forward(self, tree: Any, leaves: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.encode(tree, leaves)).unsqueeze(0), label)


def _random_tree(rng: random.Random, n: int, start: int = 0) -> Any:
    if n == 1:
        return start
    k = rng.randint(1, n - 1)
    return (_random_tree(rng, k, start), _random_tree(rng, n - k, start + k))


def _moe(size: str, seed: int, top_k: int) -> Workload:
    cfg = _MOE[size]
    torch.manual_seed(seed)
    model = NaturalMoE(
        layers=cfg["layers"],
        experts=cfg["experts"],
        d_model=cfg["d_model"],
        vocab=cfg["vocab"],
        top_k=top_k,
    )
    b, t, v = cfg["batch"], cfg["seq"], cfg["vocab"]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        # Each step's tokens come from a different part of the vocabulary, so routing varies.
        lo = int(torch.randint(v // 2, (1,), generator=g))
        tokens = torch.randint(lo, lo + v // 2, (b, t + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    name = "moe_natural" if top_k == 1 else f"moe_natural_top{top_k}"
    return Workload(
        name=name,
        summary=(
            f"MoE written naturally: {cfg['layers']} layers of {cfg['experts']} nn.Sequential "
            f"experts (d {cfg['d_model']}), top-{top_k} routing in a Python loop, B {b} T {t}"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=False,
        extra=dict(cfg, top_k=top_k, natural=True),
    )


@register("moe_natural")
def build_moe_natural(size: str, seed: int) -> Workload:
    """MoE with top-1 routing of the whole batch in a Python loop (``int(argmax)``)."""
    return _moe(size, seed, top_k=1)


@register("moe_natural_top2")
def build_moe_natural_top2(size: str, seed: int) -> Workload:
    """MoE with top-2 routing of the whole batch in a Python loop (``.tolist()``)."""
    return _moe(size, seed, top_k=2)


@register("early_exit_natural")
def build_early_exit_natural(size: str, seed: int) -> Workload:
    """Early-exit classifier whose layer loop ends with ``if conf.item() > t: break``: the
    ``early_exit`` workload (sizes, thresholds, batches) with the natural model."""
    base = build_early_exit(size, seed)
    cfg = base.extra
    torch.manual_seed(seed)
    model = NaturalEarlyExit(
        layers=cfg["layers"],
        d_in=cfg["d_in"],
        d_model=cfg["d_model"],
        classes=cfg["classes"],
        thresholds=cfg["thresholds"],
    )
    return dataclasses.replace(
        base,
        name="early_exit_natural",
        summary=(
            f"early-exit classifier written naturally: {cfg['layers']} nn.Sequential blocks of "
            f"d {cfg['d_model']}, `if confidence.item() >= t: break` in the layer loop, "
            f"B {cfg['batch']}"
        ),
        model=model,
        extra=dict(cfg, natural=True),
    )


@register("tree_natural")
def build_tree_natural(size: str, seed: int) -> Workload:
    """Recursive tree network: Python recursion over a new random binary tree every step."""
    cfg = _TREE[size]
    torch.manual_seed(seed)
    model = NaturalTree(vocab=cfg["vocab"], d_model=cfg["d_model"], classes=cfg["classes"])

    def batch(step: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        rng = random.Random(seed * 1_000_003 + step)
        n = rng.randint(cfg["leaves"] // 2, cfg["leaves"])
        leaves = torch.randint(cfg["vocab"], (n,), generator=g)
        return _random_tree(rng, n), leaves, torch.randint(cfg["classes"], (1,), generator=g)

    return Workload(
        name="tree_natural",
        summary=(
            f"recursive tree network written naturally: Python recursion over a random binary "
            f"tree of {cfg['leaves'] // 2}-{cfg['leaves']} leaves, d {cfg['d_model']}"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=False,
        extra=dict(cfg, natural=True),
    )
