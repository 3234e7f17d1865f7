"""Mixture-of-experts transformer with data-dependent top-k routing (``moe``).

Token + position embedding, ``layers`` blocks, a final LayerNorm, an untied head and next-token
cross-entropy. A block is ``x = x + attn(ln1(x))`` (causal SDPA) followed by an MoE layer on
``h = ln2(x)``: a router ``Linear -> softmax -> top-k`` picks ``top_k`` of ``experts`` GELU MLPs
per token, and ``x = x + sum_j gate_j * expert_j(h)`` with the top-k gates renormalised to sum
to one. The batches are a structured token stream (rows are segments of a few repeating
"topics"), so the routing has patterns instead of being uniform noise.

Which experts run, and on how many tokens, depends on the data, so the model is dynamic. The
code is arranged so that Dynamo never fails a frame and never traces a dynamic-shape operator:

* ``MoETransformer.forward`` is compiled; the loop over blocks lives in
  ``_blocks`` (``torch.compiler.disable(recursive=False)``), because a graph break inside a
  traced ``for`` loop would make Dynamo skip the whole frame. So ``forward`` yields two
  fragments: the embedding, and (resuming after ``_blocks``) final LayerNorm + head + loss.
* ``MoEBlock.route`` is a compiled frame per block: attention, LayerNorm, router, top-k, a
  stable ``argsort`` that groups the routed (token, slot) pairs by expert, and per-expert counts
  via ``one_hot(...).sum(0)`` (not ``bincount``, which would graph-break). One graph serves every
  block: parameters are graph inputs, so blocks differ only in their arguments.
* ``MoEBlock.forward`` (disabled, orchestration only) turns the counts into Python ints, splits
  the routed tokens per expert, skips empty experts and calls the expert modules.
* ``Expert.forward`` is a compiled frame per non-empty expert: gather ``h[tok]``, the MLP, the
  gate weighting and the ``index_add`` combine into the residual stream. One graph (dynamic in
  the number of routed tokens) serves every expert of every block.

Per step: ``2 + layers * (1 + active experts)`` fragment calls; over several steps about four
compiles in total (forward, its resume, ``route``, ``Expert.forward``), plus one if an expert
ever gets exactly one token (Dynamo specialises sizes 0 and 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, check_size, generator

_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(
        layers=2,
        d_model=32,
        heads=2,
        experts=4,
        top_k=2,
        hidden=64,
        seq_len=16,
        batch=4,
        vocab=64,
        topics=4,
    ),
    "small": dict(
        layers=4,
        d_model=128,
        heads=4,
        experts=8,
        top_k=2,
        hidden=256,
        seq_len=64,
        batch=8,
        vocab=512,
        topics=8,
    ),
    "bench": dict(
        layers=4,
        d_model=256,
        heads=4,
        experts=8,
        top_k=2,
        hidden=1024,
        seq_len=256,
        batch=8,
        vocab=2048,
        topics=16,
    ),
}
_TOPIC_PERIOD = 8  # tokens in one repetition of a topic's pattern
_SEGMENTS = 2  # topic segments per row


class Expert(nn.Module):
    """A GELU MLP that also gathers its tokens and scatters its weighted output back."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)

    def forward(
        self, h: torch.Tensor, out: torch.Tensor, tok: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """``out + index_add(tok, gate * mlp(h[tok]))``; ``h``, ``out``: (N, d); ``tok``: (n,)."""
        y = self.fc2(F.gelu(self.fc1(h[tok])))
        return out.index_add(0, tok, y * gate.unsqueeze(-1))


class MoEBlock(nn.Module):
    """Causal self-attention, then a top-k routed mixture of expert MLPs; both residual."""

    def __init__(self, d_model: int, heads: int, experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.top_k = top_k
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, hidden) for _ in range(experts))

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention, then routing. ``x``: (B, T, d).

        Returns the residual stream ``x`` (N, d) after attention, the expert input ``h`` (N, d),
        and the routed slots grouped by expert: token ids ``tok`` (N * top_k,), their gates
        ``gate`` (N * top_k,) and the per-expert slot counts ``counts`` (experts,).
        """
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = (x + self.proj(y.transpose(1, 2).reshape(b, t, d))).flatten(0, 1)
        h = self.ln2(x)
        gate, expert = self.router(h).softmax(dim=-1).topk(self.top_k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        expert = expert.flatten()
        # Stable sort: slots grouped by expert, tokens in order within each group.
        order = expert.argsort(stable=True)
        counts = F.one_hot(expert, len(self.experts)).sum(dim=0)
        return x, h, order // self.top_k, gate.flatten()[order], counts

    @torch.compiler.disable(recursive=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d). Orchestration only: the math is in ``route`` and experts."""
        out, h, tok, gate, counts = self.route(x)
        sizes = counts.tolist()
        for expert, n, tok_e, gate_e in zip(
            self.experts, sizes, tok.split(sizes), gate.split(sizes), strict=True
        ):
            if n == 0:
                continue
            # Fresh tensors rather than views: a view's storage offset (0 for the first expert
            # only) would be guarded on and cost a recompile. Marking the token count dynamic
            # up front skips the compile for the first count seen.
            tok_e, gate_e = tok_e.clone(), gate_e.clone()
            torch._dynamo.maybe_mark_dynamic(tok_e, 0)
            torch._dynamo.maybe_mark_dynamic(gate_e, 0)
            out = expert(h, out, tok_e, gate_e)
        return out.view_as(x)


class MoETransformer(nn.Module):
    """``forward(tokens, targets)`` returns the next-token loss."""

    def __init__(
        self,
        *,
        layers: int,
        d_model: int,
        heads: int,
        experts: int,
        top_k: int,
        hidden: int,
        seq_len: int,
        vocab: int,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            MoEBlock(d_model, heads, experts, top_k, hidden) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    @torch.compiler.disable(recursive=False)
    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self._blocks(self.tok_emb(tokens) + self.pos_emb(pos))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _topic_stream(
    patterns: torch.Tensor, rows: int, length: int, g: torch.Generator
) -> torch.Tensor:
    """``rows`` token rows of ``length``, each ``_SEGMENTS`` segments of a repeating pattern.

    ``patterns`` is (topics, period): every topic cycles through its own tokens. Each segment
    picks a topic and a starting phase, so the stream is predictable within a segment.
    """
    topics, period = patterns.shape
    seg = -(-length // _SEGMENTS)  # ceil
    topic = torch.randint(topics, (rows, _SEGMENTS), generator=g)
    phase = torch.randint(period, (rows, _SEGMENTS), generator=g)
    pos = (phase.unsqueeze(-1) + torch.arange(seg)) % period  # (rows, segments, seg)
    stream = patterns[topic.unsqueeze(-1), pos]
    return stream.flatten(1)[:, :length]


@register("moe")
def build_moe(size: str, seed: int) -> Workload:
    """A top-k mixture-of-experts transformer on a structured token stream."""
    return moe_workload(size, seed)


def moe_settings(size: str = "tiny", **overrides: int) -> dict[str, int]:
    """The settings :func:`moe_workload` builds with: the size's, with ``overrides`` replacing
    some (checked without building anything).

    Raises:
        ValueError: an unknown size or setting, a value that is not a positive int, or
            ``top_k`` above ``experts``.
    """
    check_size(size)
    cfg = dict(_CONFIGS[size])
    for key, value in overrides.items():
        if key not in cfg:
            raise ValueError(f"moe_workload: unknown setting {key!r}; settings: {', '.join(cfg)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"moe_workload: {key} must be a positive int; got {value!r}")
        cfg[key] = value
    if cfg["top_k"] > cfg["experts"]:
        raise ValueError(f"moe_workload: top_k={cfg['top_k']} exceeds experts={cfg['experts']}")
    return cfg


def moe_workload(size: str = "tiny", seed: int = 0, **overrides: int) -> Workload:
    """:func:`build_moe` with some of the size's settings replaced, e.g. ``batch=1, seq_len=8``
    for sparse routing: few tokens per step leave some experts idle, so the step's block sequence
    varies (with the zoo sizes every expert gets tokens in almost every step).

    Raises:
        ValueError: an unknown setting, or a value that is not a positive int.
    """
    cfg = moe_settings(size, **overrides)
    torch.manual_seed(seed)
    model = MoETransformer(
        layers=cfg["layers"],
        d_model=cfg["d_model"],
        heads=cfg["heads"],
        experts=cfg["experts"],
        top_k=cfg["top_k"],
        hidden=cfg["hidden"],
        seq_len=cfg["seq_len"],
        vocab=cfg["vocab"],
    )
    b, t, vocab = cfg["batch"], cfg["seq_len"], cfg["vocab"]
    # Each topic's pattern draws from its own slice of the vocabulary. Step -1 is no training
    # step: the patterns are fixed by the seed and shared by every batch.
    per_topic = vocab // cfg["topics"]
    offsets = torch.arange(cfg["topics"]).unsqueeze(-1) * per_topic
    patterns = offsets + torch.randint(
        per_topic, (cfg["topics"], _TOPIC_PERIOD), generator=generator(seed, -1)
    )

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = _topic_stream(patterns, b, t + 1, generator(seed, step))
        return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()

    return Workload(
        name="moe",
        summary=(
            f"MoE transformer, {cfg['layers']} layers, d {cfg['d_model']}, top-{cfg['top_k']} "
            f"of {cfg['experts']} expert MLPs, T {t}, B {b}, on a {cfg['topics']}-topic stream"
        ),
        model=model,
        batch_fn=batch,
        dynamic=True,
        single_fragment=False,
        extra=dict(cfg),
    )
