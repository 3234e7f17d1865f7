"""GPT-style decoder-only transformer (``gpt`` and ``gpt_manual``).

Token + learned position embedding, ``layers`` pre-LayerNorm blocks (fused qkv projection, causal
self-attention, output projection, 4x GELU MLP), a final LayerNorm and an untied LM head; the loss
is next-token cross-entropy. Dropout (``p`` in ``extra``) on the attention output and on the MLP
output puts random ops in the step.

``gpt`` uses :func:`torch.nn.functional.scaled_dot_product_attention`; ``gpt_manual`` writes the
attention out (``q @ k^T``, causal mask, softmax, ``@ v``), so the ``(B, H, T, T)`` score and
probability matrices are materialised and saved for backward: the memory-hungry textbook variant.

Both are static: the whole step is a single Dynamo fragment.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator

# layers, d_model, heads, seq_len, batch, vocab. ``bench`` is the configuration of the PyTorch
# anchor measurements (~16.3 MiB of fp32 parameters); do not change it.
_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=2, d_model=64, heads=4, seq_len=32, batch=4, vocab=256),
    "small": dict(layers=4, d_model=128, heads=4, seq_len=128, batch=8, vocab=1024),
    "bench": dict(layers=4, d_model=256, heads=4, seq_len=256, batch=8, vocab=2048),
}
_DROPOUT = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    causal_mask: torch.Tensor  # (T, T) bool, True above the diagonal; only when ``manual``

    def __init__(self, d_model: int, heads: int, seq_len: int, manual: bool) -> None:
        super().__init__()
        self.heads = heads
        self.manual = manual
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        if manual:
            # Non-persistent: a constant of the model, not a checkpointed state.
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.manual:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            scores = scores.masked_fill(self.causal_mask[:t, :t], float("-inf"))
            y = scores.softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + drop(attn(ln(x)))``, then ``x + drop(mlp(ln(x)))``."""

    def __init__(self, d_model: int, heads: int, seq_len: int, p: float, manual: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq_len, manual)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only transformer whose ``forward(tokens, targets)`` returns the LM loss."""

    def __init__(
        self,
        *,
        layers: int,
        d_model: int,
        heads: int,
        seq_len: int,
        vocab: int,
        p: float,
        manual: bool,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, seq_len, p, manual) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def workload(
    cfg: dict[str, int], *, seed: int = 0, manual: bool = False, name: str | None = None
) -> Workload:
    """A GPT workload of any size: ``cfg`` holds ``layers``, ``d_model``, ``heads``,
    ``seq_len``, ``batch`` and ``vocab`` (the zoo's sizes are three such dicts; the GPU check's
    large GPT is another)."""
    name = name or ("gpt_manual" if manual else "gpt")
    torch.manual_seed(seed)
    model = GPT(
        layers=cfg["layers"],
        d_model=cfg["d_model"],
        heads=cfg["heads"],
        seq_len=cfg["seq_len"],
        vocab=cfg["vocab"],
        p=_DROPOUT,
        manual=manual,
    )
    b, t, vocab = cfg["batch"], cfg["seq_len"], cfg["vocab"]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One stream of T+1 tokens per row; the targets are the inputs shifted by one.
        stream = torch.randint(vocab, (b, t + 1), generator=generator(seed, step))
        return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    attention = "hand-written attention (T x T scores)" if manual else "SDPA attention"
    return Workload(
        name=name,
        summary=(
            f"GPT, {cfg['layers']} layers, d {cfg['d_model']}, {cfg['heads']} heads, "
            f"T {t}, B {b}, vocab {vocab}, {attention}, dropout {_DROPOUT}"
        ),
        model=model,
        batch_fn=batch,
        dynamic=False,
        single_fragment=True,
        extra={**cfg, "p": _DROPOUT, "attention": "manual" if manual else "sdpa"},
    )


@register("gpt")
def build_gpt(size: str, seed: int) -> Workload:
    """GPT with :func:`~torch.nn.functional.scaled_dot_product_attention`."""
    return workload(_CONFIGS[size], seed=seed)


@register("gpt_manual")
def build_gpt_manual(size: str, seed: int) -> Workload:
    """GPT with hand-written attention that materialises the ``T x T`` score matrices."""
    return workload(_CONFIGS[size], seed=seed, manual=True)
