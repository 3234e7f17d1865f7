"""Variable-length GRU language model (``gru``).

An embedding, a single-layer GRU written out as a cell loop over time, and a linear head
predicting the next token; the loss is cross-entropy averaged over the real (unpadded)
positions only. Each sequence is an arithmetic progression modulo the vocabulary (random start
and stride), so the next token is predictable from the recent ones.

Every step draws its padded length ``T`` from a small set of buckets (deterministically per
step), and each row its own real length up to ``T``. The shapes therefore change from step to
step, which makes the workload dynamic, although each step is a single Dynamo fragment: the time
loop is unrolled, so Dynamo specialises on ``T`` and compiles once per bucket (three compiles).

The GRU is hand-written (same equations as :class:`torch.nn.GRU`) because Dynamo does not trace
``nn.GRU``: it fails the whole frame ("Dynamo does not support RNN, GRU, or LSTM") and the step
runs eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator

_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(d_embed=32, hidden=64, vocab=64, batch=4, min_len=8),
    "small": dict(d_embed=128, hidden=256, vocab=256, batch=32, min_len=48),
    "bench": dict(d_embed=256, hidden=512, vocab=1024, batch=32, min_len=64),
}
# Padded lengths are min_len times one of these factors: a few buckets, as in bucketed batching.
_BUCKETS = (1.0, 1.5, 2.0)


class GRULM(nn.Module):
    """``forward(tokens, targets, mask)`` returns the masked next-token loss."""

    def __init__(self, d_embed: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab, d_embed)
        # Gates stacked as (r, z, n), as in nn.GRU.
        self.w_ih = nn.Linear(d_embed, 3 * hidden)
        self.w_hh = nn.Linear(hidden, 3 * hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b = tokens.shape[0]
        # Input projections of all steps in one matmul; only the recurrence is sequential.
        xs = self.w_ih(self.emb(tokens)).unbind(dim=1)
        h = tokens.new_zeros(b, self.hidden, dtype=torch.float32)
        hs = []
        for x in xs:
            x_r, x_z, x_n = x.chunk(3, dim=-1)
            h_r, h_z, h_n = self.w_hh(h).chunk(3, dim=-1)
            r = torch.sigmoid(x_r + h_r)
            z = torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - z) * n + z * h
            hs.append(h)
        logits = self.head(torch.stack(hs, dim=1))
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return (losses * mask.flatten()).sum() / mask.sum()


@register("gru")
def build_gru(size: str, seed: int) -> Workload:
    """A hand-written GRU language model on padded variable-length sequences."""
    cfg = _CONFIGS[size]
    torch.manual_seed(seed)
    model = GRULM(cfg["d_embed"], cfg["hidden"], cfg["vocab"])
    b, vocab, min_len = cfg["batch"], cfg["vocab"], cfg["min_len"]
    lengths = tuple(int(min_len * f) for f in _BUCKETS)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        t = lengths[int(torch.randint(len(lengths), (), generator=g))]
        start = torch.randint(vocab, (b, 1), generator=g)
        stride = torch.randint(1, 8, (b, 1), generator=g)
        stream = (start + stride * torch.arange(t + 1)) % vocab
        # Real lengths in [t/2, t]; positions past them are padding (token 0, masked out).
        real = torch.randint(t // 2, t + 1, (b, 1), generator=g)
        mask = (torch.arange(t) < real).float()
        tokens = stream[:, :-1] * mask.long()
        return tokens, stream[:, 1:], mask

    return Workload(
        name="gru",
        summary=(
            f"GRU language model, hidden {cfg['hidden']}, vocab {vocab}, B {b}, "
            f"padded variable-length sequences, T in {lengths}"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=True,
        extra=dict(cfg, lengths=lengths),
    )
