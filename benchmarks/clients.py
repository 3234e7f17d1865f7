"""memcompile on third-party client models: tiny Hugging Face ``transformers`` language models.

    pip install -c constraints.txt transformers      # optional: not a memcompile dependency
    OMP_NUM_THREADS=1 python benchmarks/clients.py [--models llama,mixtral_eager] [--steps 2]
        [--loop step|adamw] [--out DIR]

Each model is built from a small random config (no download; research/03 §3): hidden 64, 2
layers, vocabulary 512, batch 2 x 32 tokens, dropout 0. One process per (model, configuration):

    eager        the model itself; its measured step peak sets the budgets of the rows below
    mc_none      torch.compile(model, backend="memcompile"), no budget
    mc_75, mc_50 the same with budget = 0.75 / 0.50 x eager's measured step peak
                 (on_infeasible="best_effort": a budget no plan meets runs the smallest plan,
                 with a warning, and the row says so)

Each memcompile row trains ``--steps`` (2) steps next to an eager copy and a
``torch.compile(backend="aot_eager")`` copy of the same weights, then compares the loss and every
gradient bit for bit with both, and measures the next step's peak with the CPU profiler
(``memcompile.measure``) beside ``report().predicted_peak``. ``--loop adamw`` runs the user's
iteration instead (an ``AdamW`` step and ``zero_grad`` after each backward): eager's iteration peak
sets the budgets, the parameters are compared after the iterations, and the prediction is
``report().iteration.peak``. Eager frames (Dynamo gave up on them;
memcompile manages only the ``torch.nn`` modules they call, and counts what a sampled step measured
beyond its plans) are counted from the report. Results: ``benchmarks/results/clients.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine import describe_machine

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("llama", "gpt2", "mixtral", "mixtral_eager", "qwen2moe_eager")
CONFIGS = ("eager", "mc_none", "mc_75", "mc_50")
SUMMARY = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel (model.loss_type set: no logging graph break)",
    "mixtral": "MixtralForCausalLM, 4 experts top-2, default grouped_mm experts (one graph)",
    "mixtral_eager": "MixtralForCausalLM, 4 experts top-2, experts_implementation='eager' "
    "(data-dependent routing: graph breaks, frames Dynamo runs eagerly)",
    "qwen2moe_eager": "Qwen2MoeForCausalLM, 4 experts top-2 + shared expert, "
    "experts_implementation='eager'",
}
BATCH, SEQ, VOCAB = 2, 32, 512


def build(name: str) -> Any:
    """The tiny random model ``name`` (seeded), in training mode."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    experts = {"experts_implementation": "eager"} if name.endswith("_eager") else {}
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
        model.loss_type = "ForCausalLM"  # else a logging call breaks the graph (research/03)
    elif name.startswith("mixtral"):
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, **experts)
        model = tf.MixtralForCausalLM(cfg)
    elif name.startswith("qwen2moe"):
        cfg = tf.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            **experts,
        )
        model = tf.Qwen2MoeForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return model.train()


def run_one(
    name: str, config: str, budget: int | None, steps: int = 2, loop: str = "step"
) -> dict[str, Any]:
    """One row, in this process: ``steps`` training steps (``loop``: "step", forward and
    backward from zeroed gradients; "adamw", the user's iteration), then the measured one."""
    import copy
    import warnings

    import torch

    import memcompile
    from memcompile.runtime.measure import measure

    model = build(name)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    optimizers: dict[int, torch.optim.Optimizer] = {}

    def opt_of(net: Any) -> torch.optim.Optimizer | None:
        if loop != "adamw":
            return None
        if id(net) not in optimizers:
            optimizers[id(net)] = torch.optim.AdamW(net.parameters(), lr=1e-3)
        return optimizers[id(net)]

    def step(fn: Any, net: Any) -> torch.Tensor:
        return _iteration(fn, net, opt_of(net), ids)

    def measured(fn: Any, net: Any) -> int:
        # The measured function reaches this model, its optimizer and the batch only (not the
        # other copies' optimizers: measure counts what its function can reach as resident).
        opt = opt_of(net)
        return measure(
            lambda: _iteration(fn, net, opt, ids), resident=[net, ids, *([opt] if opt else [])]
        ).peak

    row: dict[str, Any] = {"model": name, "config": config, "budget": budget, "loop": loop}
    if config == "eager":
        step(model, model)
        model.zero_grad(set_to_none=True)
        row["measured_peak"] = measured(model, model)
        return row
    ref, aot = copy.deepcopy(model), copy.deepcopy(model)
    opts: dict[str, Any] = {} if budget is None else {"budget": budget}
    opts["on_infeasible"] = "best_effort"
    compiled = torch.compile(model, backend="memcompile", options=opts)
    aot_compiled = torch.compile(aot, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = step(compiled, model)
            loss_ref, loss_aot = step(ref, ref), step(aot_compiled, aot)
        model.zero_grad(set_to_none=True)
        peak = measured(compiled, model)
        if loop == "adamw":  # the same iterations on the copies: their parameters compared
            step(ref, ref), step(aot_compiled, aot)
        else:
            step(compiled, model)  # the gradients of a step outside the measurement

    def same(other: Any) -> bool:
        if loop == "adamw":
            return all(
                torch.equal(a, b)
                for a, b in zip(model.parameters(), other.parameters(), strict=True)
            )
        return all(
            (a.grad is None and b.grad is None)
            or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))
            for a, b in zip(model.parameters(), other.parameters(), strict=True)
        )

    rep = memcompile.report(compiled)
    predicted = rep.predicted_peak
    if loop == "adamw" and rep.iteration is not None and rep.iteration.peak is not None:
        predicted = rep.iteration.peak
    row.update(
        measured_peak=peak,
        predicted_peak=predicted,
        glue_bytes=rep.glue.bytes if rep.glue.on else None,
        exact=rep.exact,
        fragments=len(rep.fragments),
        eager_frames=len(rep.fallbacks),
        loss_equal_eager=bool(torch.equal(loss, loss_ref)),
        grads_equal_eager=same(ref),
        grads_equal_aot_eager=same(aot),
        loss_equal_aot_eager=bool(torch.equal(loss, loss_aot)),
        over_budget_predicted=rep.over_budget,
        budget_warnings=sum(w.category is memcompile.MemoryBudgetWarning for w in caught),
    )
    return row


def _iteration(fn: Any, net: Any, opt: Any, ids: Any) -> Any:
    """One training step: with ``opt``, the user's iteration (backward, ``opt.step()``,
    ``zero_grad``); without, forward and backward from zeroed gradients."""
    if opt is None:
        net.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=ids).loss
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def _subprocess(
    name: str, config: str, budget: int | None, steps: int = 2, loop: str = "step"
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", name, "--config", config, "--steps", str(steps)]
    cmd += ["--loop", loop]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"model": name, "config": config, "budget": budget, "error": tail[0][:200]}
    return json.loads(lines[-1])


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _yes(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def to_markdown(rows: list[dict[str, Any]], command: str) -> str:
    import torch
    import transformers

    adamw = any(r.get("loop") == "adamw" for r in rows)
    what = (
        "the user's iteration (`AdamW(lr=1e-3)`: forward, backward, `opt.step()`, "
        "`opt.zero_grad(set_to_none=True)`); budgets and the measured peak are the iteration's, "
        "the prediction `report().iteration.peak`; `state = eager`: every parameter after the "
        "iterations"
        if adamw
        else "forward and backward from zeroed gradients; `state = eager`: every gradient"
    )

    out = [
        "# memcompile on Hugging Face client models",
        "",
        f"- command: `{command}`",
        f"- machine: {describe_machine()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}",
        f"- date: {datetime.date.today().isoformat()}",
        f"- models: tiny random configs (hidden 64, 2 layers, vocab {VOCAB}), batch {BATCH} x "
        f"{SEQ} tokens; peaks measured by the CPU profiler, absolute, in the step after "
        "`--steps` training steps",
        f"- loop: {what}",
        "- budgets: 0.75 / 0.50 x eager's measured peak (`on_infeasible='best_effort'`)",
        "- glue to host: bytes the eager glue's saved tensors sent to the host tier in the last "
        "call (`report().glue`: on once a measured iteration through the backward with eager "
        "frames passed the budget; on CUDA also once the parameters only eager code reads went "
        "to the host with the others), `-` while off",
        "- the step keeps only `out.loss`: the logits die before `backward`, while memcompile's "
        "prediction assumes the caller holds every output (128 KiB here)",
        "- eager frames: frames Dynamo runs eagerly; their activations and gradients are in the "
        "measured peak, and in the prediction (`(estimate)`) only as far as a sampled step "
        "measured them beyond the plans (`report().unseen_bytes`)",
        "",
        "| model | config | budget MiB | measured MiB | predicted MiB | within budget | "
        "budget warnings | fragments | eager frames | glue to host | loss = eager | "
        "state = eager | state = aot_eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['config']} | {_mib(r['budget'])} | {r['error']} |")
            continue
        budget, peak = r.get("budget"), r.get("measured_peak")
        within = "-" if budget is None else _yes(peak <= budget)
        pred = _mib(r.get("predicted_peak"))
        if r.get("exact") is False:
            pred += " (estimate)"
        out.append(
            f"| {r['model']} | {r['config']} | {_mib(budget)} | {_mib(peak)} | {pred} | "
            f"{within} | {r.get('budget_warnings', '-') if budget is not None else '-'} | "
            f"{r.get('fragments', '-')} | {r.get('eager_frames', '-')} | "
            f"{_mib(r.get('glue_bytes'))} | "
            f"{_yes(r.get('loss_equal_eager'))} | {_yes(r.get('grads_equal_eager'))} | "
            f"{_yes(r.get('grads_equal_aot_eager'))} |"
        )
    out += ["", "Models:", ""] + [f"- `{m}`: {SUMMARY[m]}" for m in dict.fromkeys(
        r["model"] for r in rows
    )]  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--steps", type=int, default=2, help="training steps before the measured one (default 2)"
    )
    ap.add_argument(
        "--loop",
        choices=("step", "adamw"),
        default="step",
        help="step: forward and backward from zeroed gradients (default); adamw: the user's "
        "iteration (AdamW step, zero_grad), its peak the budgets' base and the one measured",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("benchmarks/clients.py needs transformers: pip install -c constraints.txt "
              "transformers", file=sys.stderr)  # fmt: skip
        return 2
    if args.one:
        print(json.dumps(run_one(args.one, args.config, args.budget, args.steps, args.loop)))
        return 0
    models, configs = args.models.split(","), args.configs.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    for m in models:
        eager = _subprocess(m, "eager", None, loop=args.loop)
        if "eager" in configs:
            rows.append(eager)
        for c in configs:
            if c == "eager":
                continue
            base = eager.get("measured_peak")
            budget = None if c == "mc_none" or base is None else int(base * int(c[3:]) / 100)
            rows.append(_subprocess(m, c, budget, args.steps, args.loop))
            print(json.dumps(rows[-1]), flush=True)
    command = "OMP_NUM_THREADS=1 python benchmarks/clients.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "clients.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "clients.md").write_text(to_markdown(rows, command.strip()))
    print(to_markdown(rows, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
