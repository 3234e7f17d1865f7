"""Early-exit classifier (``early_exit``): the step's depth depends on the data.

An input projection, then ``layers`` residual MLP blocks, each followed by an exit head. After
block ``i`` the head's confidence on the batch (mean over samples of the top softmax
probability, a 0-dim tensor) is compared with the exit's threshold; if it passes, the loss of
that exit is returned and the deeper blocks never run. The last exit always returns. The inputs
are class prototypes scaled by a per-step signal strength plus noise: strong-signal batches are
classified confidently and exit early, weak ones go deep, so steps exit at different depths.

Dynamo fragments. The ``if confident:`` jump is data-dependent, so Dynamo breaks the graph there
and resumes in one of two resume functions (continue the loop, or return the exit's loss). Two
details keep every frame compiling:

* the blocks are iterated by index (``for i in range(...)``): iterating the ``ModuleList``
  itself makes Dynamo fail the frame ("Reconstruction failure");
* the taken exit returns from inside the loop: a ``break`` there makes Dynamo skip the whole
  frame ("graph break in loop").

A step that takes exit ``i < layers - 1`` runs ``i + 2`` fragments (input + block 0, one per
further block, then the exit's loss); one that reaches the last exit runs ``layers``. Each
resume function is specialised on ``i``, so there are at most ``1 + 2 * (layers - 1)`` compiles,
and at most ``layers - 1`` per code object (Dynamo's default limit is 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator

_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=4, d_in=32, d_model=64, classes=8, batch=16),
    "small": dict(layers=6, d_in=256, d_model=512, classes=32, batch=128),
    "bench": dict(layers=6, d_in=512, d_model=768, classes=64, batch=512),
}
# Confidence thresholds of the first and the second-to-last exit (linear in between; the last
# exit always returns): shallow exits must be surer, as in early-exit inference.
_THRESHOLDS = (0.6, 0.3)
# Signal strength per step, cycled through in a per-seed random order: strong signals exit
# early, weak ones late.
_SIGNALS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


class ExitBlock(nn.Module):
    """Residual MLP block: ``x + W2 gelu(W1 ln(x))``."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 2 * d_model)
        self.fc2 = nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class EarlyExitNet(nn.Module):
    """``forward(x, labels)`` returns the loss at the first exit confident enough."""

    def __init__(
        self, *, layers: int, d_in: int, d_model: int, classes: int, thresholds: list[float]
    ) -> None:
        super().__init__()
        if len(thresholds) != layers - 1:
            raise ValueError(f"need one threshold per exit but the last; got {len(thresholds)}")
        self.thresholds = thresholds
        self.inp = nn.Linear(d_in, d_model)
        self.blocks = nn.ModuleList(ExitBlock(d_model) for _ in range(layers))
        self.exits = nn.ModuleList(nn.Linear(d_model, classes) for _ in range(layers))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        # Index loop, not `for block in self.blocks`, and `return` inside the data-dependent
        # `if` (a `break` there makes Dynamo skip the frame): see the module docstring.
        for i in range(len(self.blocks) - 1):
            x = self.blocks[i](x)
            if self._confident(i, x):  # data-dependent: Dynamo breaks the graph here
                return F.cross_entropy(self.exits[i](x), labels)
        return F.cross_entropy(self.exits[-1](self.blocks[-1](x)), labels)

    def _confident(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """0-dim bool: is exit ``i`` confident enough on the batch ``x``?

        The decision is not trained, so it runs without grad and the exit taken recomputes its
        logits. Computing the logits once with grad would pass them across the graph break, and
        a fragment's backward then gives the heads of exits *not* taken zero gradients where
        eager gives none (``None``), which Adam treats differently.
        """
        with torch.no_grad():
            confidence = self.exits[i](x).softmax(dim=-1).amax(dim=-1).mean()
        return confidence > self.thresholds[i]

    @torch.no_grad()
    def exit_depth(self, x: torch.Tensor) -> int:
        """The exit (0-based block index) ``forward`` takes on ``x``; eager, for tests."""
        x = self.inp(x)
        for i in range(len(self.blocks) - 1):
            x = self.blocks[i](x)
            if self._confident(i, x):
                return i
        return len(self.blocks) - 1


@register("early_exit")
def build_early_exit(size: str, seed: int) -> Workload:
    """A residual MLP classifier with an exit head after every block."""
    cfg = _CONFIGS[size]
    thresholds = torch.linspace(*_THRESHOLDS, cfg["layers"] - 1).tolist()
    torch.manual_seed(seed)
    model = EarlyExitNet(
        layers=cfg["layers"],
        d_in=cfg["d_in"],
        d_model=cfg["d_model"],
        classes=cfg["classes"],
        thresholds=thresholds,
    )
    b, d_in, classes = cfg["batch"], cfg["d_in"], cfg["classes"]
    # Step -1 is no training step: prototypes and signal order are fixed by the seed.
    g = generator(seed, -1)
    protos = torch.randn(classes, d_in, generator=g)
    signal_order = torch.randperm(len(_SIGNALS), generator=g).tolist()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        labels = torch.randint(classes, (b,), generator=g)
        signal = _SIGNALS[signal_order[step % len(_SIGNALS)]]
        x = signal * protos[labels] + torch.randn(b, d_in, generator=g)
        return x, labels

    return Workload(
        name="early_exit",
        summary=(
            f"early-exit classifier, {cfg['layers']} residual MLP blocks of d {cfg['d_model']} "
            f"with an exit head each, confidence thresholds {_THRESHOLDS[0]}..{_THRESHOLDS[1]}, "
            f"B {b}"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=False,
        extra=dict(cfg, thresholds=thresholds, signals=_SIGNALS),
    )
