"""The whole training iteration's device peak: memcompile beside PyTorch's own features.

    OMP_NUM_THREADS=1 python benchmarks/train_loop.py                # everything (~30 min)
    OMP_NUM_THREADS=1 python benchmarks/train_loop.py --quick        # llama, 2 reps, no Inductor
    OMP_NUM_THREADS=1 python benchmarks/train_loop.py --quick --models llama \\
        --configs eager,checkpoint,mc_60,mc_40 --micro 1,4 --reps 2 --no-sweep
    OMP_NUM_THREADS=1 python benchmarks/train_loop.py --models gpt --configs eager,mc_25 --no-sweep

The loop is a user's (``step/iteration.py``'s subject): ``AdamW(lr=1e-3)`` with a linear-warmup
``LambdaLR``; per iteration, ``k`` micro-batches (``--micro``, default 1 and 4) each run
``(loss / k).backward()``, then ``opt.step(); sched.step(); opt.zero_grad(set_to_none=True)``.

Models (``--size bench``; ``tiny`` for tests):

* ``gpt``: the zoo GPT at size ``bench`` (4 layers, d 256, T 256, B 8, vocab 2048, SDPA,
  dropout; ``forward(tokens, targets)`` returns the loss);
* ``llama``: a Hugging Face ``LlamaForCausalLM`` from a random config (vocab 2048, hidden 256,
  intermediate 688, 8 layers, 4 heads, T 256, B 2, ``use_cache=False``; no hub download); the loss
  is ``model(input_ids=ids, labels=ids).loss`` and only the loss is kept;
* ``mixtral``: a Hugging Face ``MixtralForCausalLM`` as ``llama`` (intermediate 512, 4 layers) with
  8 experts, top-2, ``experts_implementation="eager"`` (the routing loop runs eagerly: memcompile
  compiles the modules around it as regions, manages the glue, and puts the experts' weights in
  the host tier when the budget needs it).

Part 1, one process per row (model, configuration, micro-batches). The process builds the model
twice from one seed (a plain eager copy and the configured one, each with its own optimizer and
scheduler), then:

* runs ``--warmup`` (3) iterations of both copies on the same batches (compiles happen here);
* measures ONE whole iteration of the configured copy (all micro-batches, the optimizer step,
  the scheduler and ``zero_grad``) with ``memcompile.measure`` (the CPU profiler, with
  ``resident=[model, optimizer, batches]``): the absolute device peak and the bytes resident at
  its start (parameters, buffers, optimizer state, batches; host-tier memory is not device
  memory); "iteration peak" is the peak above that resident;
* runs the same iteration on the eager copy and compares every loss of those warmup + 1
  iterations and then every parameter with ``torch.equal`` ("identical");
* times ``--reps`` iterations interleaved with the eager copy (ABAB) and reports the median of the
  paired ratios of process CPU time, so load from other jobs cancels out.

Configurations: ``eager``; ``checkpoint`` (HF: ``gradient_checkpointing_enable()``; GPT:
``torch.utils.checkpoint`` per block, as benchmarks/anchors.py); ``ac_budget`` (``torch.compile``,
Inductor, ``activation_memory_budget = 0.5``; a slow first compile); ``fsdp_cpu_offload`` (FSDP2
``fully_shard`` per block and the root with ``CPUOffloadPolicy(pin_memory=False)`` in a
one-process gloo group; on a CPU device the "offloaded" memory is the same allocator, so the row
shows what FSDP2 costs there, not what it would save on a GPU); ``mc_60``/``mc_40``/``mc_25``
(``memcompile.compile(model, budget=B, on_infeasible="best_effort")`` with
``B = eager's resident + f x eager's iteration peak``, f = 0.60/0.40/0.25, both from the eager row
of the same run and the same micro-batch count); ``mc_60_offopt`` (the same at 0.60 with
``offload_optimizer=True``). For memcompile rows the ``MemoryBudgetWarning``s (count, first
message), ``report(compiled).predicted_peak`` and ``report(compiled).iteration`` are kept too.

Part 2, "largest model in a fixed budget" (``--sweep``, AdamW, 1 micro-batch): the budget is
eager's measured iteration peak of the Llama at ``--sweep-base-layers`` (4) layers; layers grow
through ``--sweep-layers`` (4,6,8,12,16) until a system no longer fits: eager, ``checkpoint``, and
memcompile with the budget and its defaults (host tier, ``offload_params`` and
``offload_optimizer`` ``"auto"``, ``on_infeasible="error"``). A system fits when its measured
peak is within the budget + 2 % (the contract's tolerance) and, for memcompile, no
``MemoryBudgetError`` was raised.

Results: ``benchmarks/results/train_loop.md`` and ``train_loop.json`` (``train_loop_quick`` with
``--quick``), with the command, the machine and the date; every number in them was measured in
that run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import write_results

log = logging.getLogger("train_loop")

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("gpt", "llama", "mixtral")
SIZES = ("bench", "tiny")

#: name -> what it is.
CONFIGS: dict[str, str] = {
    "eager": "eager PyTorch",
    "checkpoint": "eager + activation checkpointing (HF: gradient_checkpointing_enable(); "
    "GPT: torch.utils.checkpoint per block)",
    "ac_budget": "torch.compile (Inductor) with activation_memory_budget = 0.5",
    "fsdp_cpu_offload": "FSDP2 fully_shard per block + root, CPUOffloadPolicy(pin_memory=False), "
    "1-process gloo group",
    "mc_60": "memcompile, budget resident + 0.60 x eager's iteration peak, best_effort",
    "mc_40": "memcompile, budget resident + 0.40 x eager's iteration peak, best_effort",
    "mc_25": "memcompile, budget resident + 0.25 x eager's iteration peak, best_effort",
    "mc_60_offopt": "memcompile as mc_60 with offload_optimizer=True",
}
#: memcompile configs and their fraction of eager's iteration peak.
FRACTIONS = {"mc_60": 0.60, "mc_40": 0.40, "mc_25": 0.25, "mc_60_offopt": 0.60}
QUICK_CONFIGS = ("eager", "checkpoint", "mc_60", "mc_40", "mc_25")
SWEEP_SYSTEMS = ("eager", "checkpoint", "mc_fit")
#: ``mc_fit``: the sweep's memcompile (defaults, budget given, ``on_infeasible="error"``).
SWEEP_CONFIG = {"mc_fit": "memcompile with the fixed budget, defaults (host tier allowed)"}
TOLERANCE = 1.02

#: Model sizes. ``llama``: vocab, hidden, intermediate, layers, heads, T, B.
LLAMA_SIZES: dict[str, dict[str, int]] = {
    "bench": dict(vocab=2048, hidden=256, intermediate=688, layers=8, heads=4, seq=256, batch=2),
    "tiny": dict(vocab=256, hidden=64, intermediate=172, layers=2, heads=4, seq=32, batch=2),
}
#: ``mixtral``: as ``llama``, with experts (each of ``intermediate``) and top-k routing.
MIXTRAL_SIZES: dict[str, dict[str, int]] = {
    "bench": dict(
        vocab=2048, hidden=256, intermediate=512, layers=4, heads=4, seq=256, batch=2,
        experts=8, top=2,
    ),
    "tiny": dict(
        vocab=256, hidden=64, intermediate=128, layers=2, heads=4, seq=32, batch=2,
        experts=4, top=2,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- building models


@dataclass
class Bench:
    """A model of the benchmark and how a user's loop calls it.

    Attributes:
        name: ``gpt_4l``, ``llama_8l``, ...
        net: the module (its parameters are what the optimizer steps).
        blocks: the repeated blocks (FSDP2 wraps each; GPT checkpoints each).
        batch: ``batch(i)`` is micro-batch ``i``'s inputs, deterministic in ``i``.
        loss: ``loss(fn, batch)`` calls ``fn`` (the model, or a compiled copy) as the user does
            and returns the 0-dim loss only.
        hf: a Hugging Face model (checkpointing through its own switch).
    """

    name: str
    net: Any
    blocks: list[Any]
    batch: Callable[[int], tuple[Any, ...]]
    loss: Callable[[Callable[..., Any], tuple[Any, ...]], Any]
    hf: bool


def build(model: str, size: str, layers: int | None = None) -> Bench:
    """``model`` at ``size`` (with ``layers`` blocks when given), seeded: two calls give the same
    weights."""
    import torch

    if model == "gpt":
        from anchors import build as build_gpt

        from memcompile import zoo

        if size == "bench":
            wl = build_gpt("gpt", layers)
        else:
            if layers is not None:
                raise ValueError("--layers applies to gpt at size bench only")
            wl = zoo.build("gpt", size=size, seed=0)
        n = wl.extra["layers"]
        return Bench(
            name=f"gpt_{n}l",
            net=wl.model,
            blocks=list(wl.model.blocks),
            batch=wl.batch,
            loss=lambda fn, b: fn(*b),
            hf=False,
        )
    if model in ("llama", "mixtral"):
        import transformers as tf

        s = (LLAMA_SIZES if model == "llama" else MIXTRAL_SIZES)[size]
        n = layers if layers is not None else s["layers"]
        common = dict(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            intermediate_size=s["intermediate"],
            num_hidden_layers=n,
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            max_position_embeddings=s["seq"],
            use_cache=False,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        if model == "llama":
            net = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
        else:
            # The experts as Hugging Face's eager implementation runs them: a Python loop over
            # the experts hit (graph breaks Dynamo cannot resume: frames run eagerly).
            net = tf.MixtralForCausalLM(
                tf.MixtralConfig(
                    **common,
                    num_local_experts=s["experts"],
                    num_experts_per_tok=s["top"],
                    experts_implementation="eager",
                )
            )
        net.train()
        vocab, shape = s["vocab"], (s["batch"], s["seq"])

        def batch(i: int) -> tuple[Any, ...]:
            g = torch.Generator().manual_seed(1_000_003 + i)
            return (torch.randint(0, vocab, shape, generator=g),)

        def loss(fn: Callable[..., Any], b: tuple[Any, ...]) -> Any:
            out = fn(input_ids=b[0], labels=b[0])
            return out.loss

        return Bench(
            name=f"{model}_{n}l",
            net=net,
            blocks=list(net.model.layers),
            batch=batch,
            loss=loss,
            hf=True,
        )
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def _fsdp(bench: Bench) -> None:
    """Shard ``bench`` with FSDP2 and CPU offload in a one-process gloo group (started here)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in bench.blocks:
        fully_shard(block, offload_policy=policy)
    fully_shard(bench.net, offload_policy=policy)


def configure(config: str, bench: Bench, budget: int | None) -> Callable[..., Any]:
    """The callable a user's loop calls for ``config`` (compiling lazily, on its first call)."""
    import torch

    net = bench.net
    if config == "eager":
        return net
    if config == "checkpoint":
        if bench.hf:
            net.gradient_checkpointing_enable()
        else:
            from anchors import _checkpoint_blocks

            _checkpoint_blocks(net, None)
        return net
    if config == "ac_budget":
        torch._functorch.config.activation_memory_budget = 0.5
        return torch.compile(net)
    if config == "fsdp_cpu_offload":
        _fsdp(bench)
        return net
    if config in FRACTIONS or config == "mc_fit":
        import memcompile

        opts: dict[str, Any] = {"budget": budget}
        if config == "mc_fit":
            opts["on_infeasible"] = "error"
        else:
            opts["on_infeasible"] = "best_effort"
        if config.endswith("_offopt"):
            opts["offload_optimizer"] = True
        return memcompile.compile(net, **opts)
    raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")


# --------------------------------------------------------------------------- the loop


class Loop:
    """A user's training loop over one model copy: AdamW, a warmup LambdaLR, ``micro``
    accumulating micro-batches per iteration.

    Args:
        bench: the model and its batches.
        fn: what the loop calls (the model, or a compiled copy of it).
        micro: micro-batches per iteration.
    """

    WARMUP_STEPS = 10

    def __init__(self, bench: Bench, fn: Callable[..., Any], micro: int) -> None:
        import torch

        self.bench, self.fn, self.micro = bench, fn, micro
        self.opt = torch.optim.AdamW(bench.net.parameters(), lr=1e-3)
        warm = self.WARMUP_STEPS
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda step: min(1.0, (step + 1) / warm)
        )

    def batches(self, k: int) -> list[tuple[Any, ...]]:
        """Iteration ``k``'s micro-batches."""
        return [self.bench.batch(k * self.micro + j) for j in range(self.micro)]

    def iteration(self, k: int, batches: list[tuple[Any, ...]] | None = None) -> list[float]:
        """Run iteration ``k`` (on ``batches``, else made here); return its micro-batch losses."""
        import torch

        losses = []
        for j, b in enumerate(batches if batches is not None else self.batches(k)):
            torch.manual_seed(10_000 + k * self.micro + j)  # dropout: the same masks in both copies
            loss = self.bench.loss(self.fn, b)
            (loss / self.micro).backward()
            losses.append(float(loss.detach()))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return losses


def _full(t: Any) -> Any:
    """A plain tensor of ``t`` (a DTensor's full value)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _param_diff(a: Any, b: Any) -> tuple[bool, float]:
    """(every parameter bit-identical, the largest absolute difference)."""
    import torch

    same, worst = True, 0.0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if na != nb:
            raise RuntimeError(f"parameter order differs: {na} vs {nb}")
        x, y = _full(pa.detach()), _full(pb.detach())
        if not torch.equal(x, y):
            same = False
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return same, worst


# --------------------------------------------------------------------------- one process


def _warning_fields(caught: Sequence[warnings.WarningMessage]) -> dict[str, Any]:
    import memcompile

    budget = [w for w in caught if issubclass(w.category, memcompile.MemoryBudgetWarning)]
    other = sorted(
        {
            f"{w.category.__name__}: {str(w.message)[:200]}"
            for w in caught
            if not issubclass(w.category, memcompile.MemoryBudgetWarning)
            and not issubclass(w.category, (DeprecationWarning, FutureWarning))
        }
    )
    return {
        "budget_warnings": len(budget),
        "first_budget_warning": str(budget[0].message)[:600] if budget else None,
        "other_warnings": other[:8],
    }


def run_one(
    model: str,
    config: str,
    *,
    micro: int,
    reps: int,
    budget: int | None,
    size: str,
    layers: int | None,
    warmup: int,
    ref: bool,
) -> dict[str, Any]:
    """One row in this process: the configured loop's iteration peak, its bit-identity with an
    eager copy's and its CPU time paired with it (``ref=False``: the peak only). The warnings
    of the whole run (warm-up, measured iteration, timed iterations) are kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out: dict[str, Any] = {"model": model, "config": config, "micro": micro, "budget": budget}
        try:
            _run(out, model, config, micro, reps, budget, size, layers, warmup, ref)
        finally:
            out.update(_warning_fields(caught))
    return out


def _run(
    out: dict[str, Any],
    model: str,
    config: str,
    micro: int,
    reps: int,
    budget: int | None,
    size: str,
    layers: int | None,
    warmup: int,
    ref: bool,
) -> None:
    """:func:`run_one`'s work, filling ``out``."""
    import torch

    import memcompile

    torch.set_num_threads(1)
    sut = build(model, size, layers)
    out.update(model=sut.name, params=sum(p.numel() for p in sut.net.parameters()))
    eager: Loop | None = None
    if ref:
        twin = build(model, size, layers)
        twin.net.load_state_dict(sut.net.state_dict())
        eager = Loop(twin, twin.net, micro)
    fn = configure(config, sut, budget)
    loop = Loop(sut, fn, micro)
    losses: list[float] = []
    ref_losses: list[float] = []
    try:
        t0 = time.perf_counter()
        for k in range(warmup):
            losses += loop.iteration(k)
            if eager is not None:
                ref_losses += eager.iteration(k)
        out["warmup_s"] = round(time.perf_counter() - t0, 2)
        batches = loop.batches(warmup)
        m = memcompile.measure(
            lambda: loop.iteration(warmup, batches), resident=[sut.net, loop.opt, batches]
        )
    except memcompile.MemoryBudgetError as e:
        out.update(fits=False, error=f"MemoryBudgetError: {str(e)[:400]}")
        return
    losses += m.result
    out.update(
        peak=m.peak,
        resident=m.resident_bytes,
        iter_peak=m.peak - m.resident_bytes,
        measure_complete=m.complete,
        unseen_free_bytes=m.unseen_free_bytes,
        fits=True,
    )
    if budget is not None:
        out["within_budget"] = m.peak <= budget * TOLERANCE
    if config.startswith("mc_"):
        rep = memcompile.report(fn)
        out["predicted_peak"] = rep.predicted_peak
        out["iteration"] = rep.iteration.to_dict() if rep.iteration is not None else None
        out["fragments"] = len(rep.fragments)
        out["fallbacks"] = len(rep.fallbacks)
        out["host_param_bytes"] = rep.host_param_bytes
    if eager is None:
        return
    ref_losses += eager.iteration(warmup, batches)
    same_params, param_diff = _param_diff(sut.net, eager.bench.net)
    out["identical_losses"] = losses == ref_losses
    out["loss_max_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    out["identical_params"] = same_params
    out["param_max_diff"] = param_diff
    out["identical"] = out["identical_losses"] and same_params
    out["identity_iters"] = warmup + 1
    ratios, eager_s = [], []
    for r in range(reps):
        k = warmup + 1 + r
        a = time.process_time()
        eager.iteration(k)
        b = time.process_time()
        loop.iteration(k)
        c = time.process_time()
        ratios.append((c - b) / max(b - a, 1e-9))
        eager_s.append(b - a)
    out["time_ratios"] = [round(x, 4) for x in ratios]
    out["time_ratio"] = statistics.median(ratios) if ratios else None
    out["eager_iter_s"] = statistics.median(eager_s) if eager_s else None


def _subprocess(
    model: str,
    config: str,
    *,
    micro: int,
    reps: int,
    size: str,
    warmup: int,
    budget: int | None = None,
    layers: int | None = None,
    ref: bool = True,
    timeout: float = 1800,
) -> dict[str, Any]:
    """:func:`run_one` in a fresh process (``OMP_NUM_THREADS=1``); its JSON record, or one with
    ``error`` (the last lines of its stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--one", model, "--config", config]
    cmd += ["--micro", str(micro), "--reps", str(reps), "--size", size, "--warmup", str(warmup)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    if not ref:
        cmd.append("--no-ref")
    base = {"model": model, "config": config, "micro": micro, "budget": budget}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timeout after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if "USDT" not in ln][-3:]
        return {**base, "error": " / ".join(tail) or f"exit status {proc.returncode}"}
    row = dict(json.loads(lines[-1]))
    row["process_s"] = round(time.perf_counter() - t0, 1)
    return row


# --------------------------------------------------------------------------- the table


def budget_for(config: str, eager: dict[str, Any]) -> int | None:
    """Absolute budget of a memcompile row: eager's resident + f x eager's iteration peak."""
    f = FRACTIONS.get(config)
    if f is None:
        return None
    return int(eager["resident"] + f * eager["iter_peak"])


def table(
    models: Sequence[str],
    configs: Sequence[str],
    micros: Sequence[int],
    *,
    reps: int,
    size: str,
    warmup: int,
) -> list[dict[str, Any]]:
    """Part 1: every (model, micro-batches, config) row, eager first (it sets the budgets)."""
    rows = []
    kw: dict[str, Any] = {"reps": reps, "size": size, "warmup": warmup}
    for model in models:
        for micro in micros:
            eager = _subprocess(model, "eager", micro=micro, **kw)
            eager["part"] = "table"
            rows.append(eager)
            _progress(eager)
            for config in configs:
                if config == "eager":
                    continue
                if config in FRACTIONS and "iter_peak" not in eager:
                    row = {"model": model, "config": config, "micro": micro}
                    row["error"] = "not run: the eager row failed"
                else:
                    row = _subprocess(
                        model, config, micro=micro, budget=budget_for(config, eager), **kw
                    )
                if "iter_peak" in row and eager.get("iter_peak"):
                    row["iter_peak_vs_eager"] = row["iter_peak"] / eager["iter_peak"]
                    row["peak_vs_eager"] = row["peak"] / eager["peak"]
                row["part"] = "table"
                rows.append(row)
                _progress(row)
    return rows


def _progress(row: dict[str, Any]) -> None:
    if "error" in row:
        msg = f"error {row['error'][:300]}"
    else:
        msg = f"peak {_mib(row.get('peak'))} MiB"
        if row.get("time_ratio") is not None:
            msg += f", time x{row['time_ratio']:.2f}, identical {row.get('identical')}"
        if row.get("budget_warnings"):
            msg += f", {row['budget_warnings']} budget warnings"
    log.info("  %-10s %-16s micro %s: %s", row["model"], row["config"], row.get("micro"), msg)


# --------------------------------------------------------------------------- the sweep


def sweep(
    base_layers: int, layers: Sequence[int], systems: Sequence[str], *, size: str, warmup: int
) -> dict[str, Any]:
    """Part 2: the most Llama layers each system trains (AdamW, 1 micro-batch) within eager's
    iteration peak at ``base_layers`` layers."""
    kw: dict[str, Any] = {"micro": 1, "reps": 0, "size": size, "warmup": warmup, "ref": False}
    base = _subprocess("llama", "eager", layers=base_layers, **kw)
    if "peak" not in base:
        return {"error": f"the base row failed: {base.get('error')}", "base": base}
    budget = int(base["peak"])
    log.info("sweep: budget %s MiB (eager at %d layers)", _mib(budget), base_layers)
    largest: dict[str, int | None] = {}
    tried: list[dict[str, Any]] = []
    for system in systems:
        largest[system] = None
        for n in layers:
            row = _subprocess(
                "llama", system, layers=n, budget=budget if system == "mc_fit" else None, **kw
            )
            row.update(part="sweep", system=system, layers=n)
            row["fits"] = (
                bool(row.get("fits")) and row.get("peak", budget + 1) <= budget * TOLERANCE
            )
            tried.append(row)
            log.info(
                "  sweep %-10s %3d layers: peak %s MiB, %s",
                system,
                n,
                _mib(row.get("peak")),
                "fits" if row["fits"] else "over",
            )
            if not row["fits"]:
                break
            largest[system] = n
    return {
        "budget": budget,
        "base_layers": base_layers,
        "layers": list(layers),
        "largest": largest,
        "tried": tried,
        "base": base,
    }


# --------------------------------------------------------------------------- report


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _yes(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "no")


#: ``IterationReport.peaks``' phases in the order an iteration runs them.
_PHASES = {"first micro-batch": 0, "later micro-batches": 1, "optimizer step": 2}


def render_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Part 1's Markdown table and the memcompile details under it."""
    lines = [
        "| model | micro | config | budget MiB | peak MiB | resident MiB | iter peak MiB "
        "| peak vs eager | iter peak vs eager | within budget | CPU time vs eager | identical "
        "| predicted MiB | budget warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    details = []
    for r in rows:
        head = f"| {r['model']} | {r.get('micro')} | {r['config']} | {_mib(r.get('budget'))} "
        if "error" in r:
            lines.append(head + f"| {r['error'][:200]} |||||||||| ")
            continue
        one = 1.0 if r["config"] == "eager" else None
        vs, pvs = r.get("iter_peak_vs_eager", one), r.get("peak_vs_eager", one)
        ratio = r.get("time_ratio")
        mc = r["config"].startswith("mc_")
        lines.append(
            head
            + f"| {_mib(r['peak'])} | {_mib(r['resident'])} | {_mib(r['iter_peak'])} "
            + f"| {'-' if pvs is None else f'{pvs:.3f}x'} "
            + f"| {'-' if vs is None else f'{vs:.3f}x'} | {_yes(r.get('within_budget'))} "
            + f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {_yes(r.get('identical'))} "
            + f"| {_mib(r.get('predicted_peak')) if mc else '-'} "
            + f"| {r.get('budget_warnings', 0) if mc else '-'} |"
        )
        if mc:
            it = r.get("iteration") or {}
            phases = sorted((it.get("peaks") or {}).items(), key=lambda kv: _PHASES.get(kv[0], 9))
            peaks = ", ".join(f"{k} {_mib(v)}" for k, v in phases)
            text = (
                f"- {r['model']} micro {r.get('micro')} {r['config']}: predicted step peak "
                f"{_mib(r.get('predicted_peak'))} MiB, iteration predicted "
                f"{_mib(it.get('peak'))} MiB ({peaks or 'no phases'}); optimizer state on the "
                f"device {_mib(it.get('state_bytes'))} MiB; host-tier parameters "
                f"{_mib(r.get('host_param_bytes'))} MiB"
            )
            if r.get("first_budget_warning"):
                text += f"; first MemoryBudgetWarning: `{r['first_budget_warning'][:300]}`"
            details.append(text)
        if r.get("identical") is False:
            details.append(
                f"- {r['model']} micro {r.get('micro')} {r['config']}: not bit-identical "
                f"(losses identical {_yes(r.get('identical_losses'))}, largest loss difference "
                f"{r.get('loss_max_diff', 0):.2e}, largest parameter difference "
                f"{r.get('param_max_diff', 0):.2e})"
            )
    return lines + (["", *details] if details else [])


def render_sweep(s: dict[str, Any]) -> list[str]:
    """Part 2's Markdown."""
    if "error" in s:
        return ["## Largest Llama in a fixed budget", "", f"not run: {s['error']}"]
    lines = [
        f"## Largest Llama in a fixed budget ({_mib(s['budget'])} MiB = eager's iteration peak "
        f"at {s['base_layers']} layers; AdamW, 1 micro-batch; layers tried "
        f"{', '.join(map(str, s['layers']))})",
        "",
        "| system | most layers that fit | peaks MiB by layers |",
        "|---|---|---|",
    ]
    for system, n in s["largest"].items():
        tried = [r for r in s["tried"] if r["system"] == system]
        peaks = ", ".join(
            f"{r['layers']}: {_mib(r.get('peak'))}{'' if r['fits'] else ' (over)'}"
            + (f" [{r['error'][:80]}]" if "error" in r else "")
            for r in tried
        )
        capped = " (largest tried)" if n == s["layers"][-1] else ""
        lines.append(f"| {system} | {'none' if n is None else n}{capped} | {peaks} |")
    return lines


def main() -> None:
    """Parse the arguments; run one row (``--one``) or the benchmark."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="llama only, 2 reps, no Inductor")
    p.add_argument("--models", default=None, help=f"comma list of: {', '.join(MODELS)}")
    p.add_argument("--configs", default=None, help=f"comma list of: {', '.join(CONFIGS)}")
    p.add_argument("--micro", default="1,4", help="micro-batches per iteration, comma list")
    p.add_argument("--reps", type=int, default=None, help="paired timing reps (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="iterations before the measured one")
    p.add_argument("--size", default="bench", choices=SIZES)
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--sweep-base-layers", type=int, default=4)
    p.add_argument("--sweep-layers", default="4,6,8,12,16")
    p.add_argument("--sweep-systems", default=",".join(SWEEP_SYSTEMS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-ref", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    try:
        micros = [int(x) for x in args.micro.split(",") if x]
        sweep_layers = [int(x) for x in args.sweep_layers.split(",") if x]
    except ValueError:
        p.error("--micro and --sweep-layers: comma lists of integers")
    if not micros or min(micros) < 1 or reps < 0 or args.warmup < 1:
        p.error("--micro must be >= 1, --reps >= 0, --warmup >= 1")

    if args.one:
        kw: dict[str, Any] = dict(
            micro=micros[0],
            reps=reps,
            budget=args.budget,
            size=args.size,
            layers=args.layers,
            warmup=args.warmup,
            ref=not args.no_ref,
        )
        try:
            row = run_one(args.one, args.config, **kw)
        except Exception as e:  # one line the parent can show: the row could not run
            traceback.print_exc()
            row = {"model": args.one, "config": args.config, "micro": micros[0]}
            row["error"] = f"not run: {type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row))
        return

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    models = (args.models or ("llama" if args.quick else ",".join(MODELS))).split(",")
    configs = (args.configs or ",".join(QUICK_CONFIGS if args.quick else CONFIGS)).split(",")
    systems = [x for x in args.sweep_systems.split(",") if x]
    for name in models:
        if name not in MODELS:
            p.error(f"--models: choose from {', '.join(MODELS)}; got {name!r}")
    for name in configs:
        if name not in CONFIGS:
            p.error(f"--configs: choose from {', '.join(CONFIGS)}; got {name!r}")
    for name in systems:
        if name not in SWEEP_SYSTEMS:
            p.error(f"--sweep-systems: choose from {', '.join(SWEEP_SYSTEMS)}; got {name!r}")
    do_sweep = args.sweep if args.sweep is not None else not args.quick

    log.info("table: %d models x %d micro x %d configs", len(models), len(micros), len(configs))
    rows = table(models, configs, micros, reps=reps, size=args.size, warmup=args.warmup)
    swept = None
    if do_sweep:
        swept = sweep(
            args.sweep_base_layers, sweep_layers, systems, size=args.size, warmup=args.warmup
        )

    notes = [
        "loop: AdamW(lr=1e-3) + LambdaLR linear warmup; per iteration `micro` x "
        "`(loss / micro).backward()`, then `opt.step(); sched.step(); "
        "opt.zero_grad(set_to_none=True)`",
        f"peak: CPU profiler (`memcompile.measure`), one whole iteration after {args.warmup} "
        "warm-up iterations, one process per row; *resident* = parameters, buffers, optimizer "
        "state and batches at its start (device bytes: host-tier memory excluded); *iter peak* "
        "= peak - resident",
        f"time: median of paired process-CPU-time ratios vs an eager copy in the same process "
        f"({reps} reps, 1 thread); identical: every loss of {args.warmup + 1} iterations and "
        "every parameter after them `torch.equal` to the eager copy's",
        "memcompile budgets are absolute: eager's resident + f x eager's iteration peak (same "
        "model and micro-batches), f in the name; within budget: peak <= budget x 1.02",
        "fsdp_cpu_offload on a CPU device: the offloaded tensors live in the same allocator, so "
        "the row measures FSDP2's cost here, not a GPU's saving",
    ]
    lines = ["## Whole-iteration peak", "", *render_table(rows), "", "Configurations:", ""]
    lines += [f"- `{k}`: {v}" for k, v in CONFIGS.items() if k in configs]
    if swept is not None:
        lines += ["", *render_sweep(swept)]
        lines += ["", f"- `mc_fit`: {SWEEP_CONFIG['mc_fit']}"]
    all_rows = list(rows)
    if swept is not None:
        all_rows.append({"part": "sweep", **{k: v for k, v in swept.items()}})
    argv = sys.argv[1:]
    stem = "train_loop_quick" if args.quick else "train_loop"
    path = write_results(
        args.out,
        stem,
        title="The whole training iteration's peak: memcompile vs PyTorch (train_loop)",
        argv=argv,
        notes=notes,
        table=lines,
        rows=all_rows,
        script="train_loop",
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
