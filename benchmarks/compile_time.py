"""Compile time of a budgeted zoo workload: the first training step, and the planner's share.

    OMP_NUM_THREADS=1 python benchmarks/compile_time.py [--model gru] [--size small]
        [--budget 14.2MiB] [--steps 1] [--out DIR] [-O KEY=VALUE ...] [--warm]

Runs ``--steps`` training steps of zoo ``--model`` under ``memcompile.compile(budget=...,
on_infeasible="best_effort")`` in this process and times them: the first step compiles (Dynamo,
AOTAutograd, planning, building the rewritten graphs, compiling them). Every call of the planner
(``planner.plan_fragment``) is timed too, with its graph's size, target, techniques and a digest
of the plan it returned (the decisions, both orders, the predicted peak), so two versions of
memcompile can be compared plan for plan as well as in seconds. The default is the zoo GRU
(small) at 14.2 MiB, 0.7x its no-budget predicted peak (``benchmarks/results/peaks_small.md``),
under which its first step (T=96, a 5,000-node joint graph) runs its smallest plan. Results go
to ``benchmarks/results/compile_time.{md,json}``.

``--warm``: the plan cache across runs (``pipeline/plan_cache.py``). Three fresh processes, one
after the other: the first step without a budget, then under the budget with an empty cache
directory (cold), then again with the cache the cold run wrote (warm); the table gives each
one's first step and planner calls.

``--model`` (and ``--sweep``) also take ``hf:NAME``: a tiny Hugging Face client of ``clients.py``
(``hf:llama``, ``hf:mixtral_eager``, ...) or ``hf:gpt2_12`` (GPT-2 small's shape, 1 x 128 tokens);
and ``lstm:T``: a hand-written LSTM cell unrolled over T time steps (issue 41's recurrent net: d
96, batch 32, a linear head and cross-entropy).

``--sweep [MODEL,...]``: issue 41's table, each run a fresh process with the plan cache off.
For each model (zoo ones at ``--size``; default every zoo model): the first steps without a
budget; then under resident + 0.5x and 0.25x the no-budget run's predicted activations (its
predicted peak less the resident bytes); then, with ``on_infeasible="error"``, under
``--infeasible`` x that predicted peak (default 0.05) until ``MemoryBudgetError`` (or the step,
where that budget fits after all: parameters moved to the host make room). The time of a run
is that of its first three steps (a model written the natural way compiles its regions at the
second call), held against the targets: a feasible budget's <= 2x the no-budget one + 10 s,
the error <= 10 s. Results go to ``compile_time_sweep.{md,json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _digest(plan: Any) -> str:
    """A short hash of what a plan decides and predicts."""
    text = json.dumps(
        [
            [[d.tensor, d.action] for d in plan.decisions],
            list(plan.backward_order),
            list(plan.forward_order),
            plan.predicted_peak,
            plan.feasible,
        ]
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


#: ``hf:NAME``: a tiny Hugging Face client of ``clients.py`` (NAME one of its models), or
#: ``hf:gpt2_12``: GPT-2 small's shape (12 layers, d 768, 12 heads, vocabulary 50,257), batch
#: 1 x 128 tokens, random weights, dropout 0.
HF = "hf:"


def _clients() -> Any:
    """``benchmarks/clients.py`` (the Hugging Face client models), imported from beside us."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import clients

    return clients


#: ``lstm:T``: issue 41's recurrent net, a hand-written LSTM cell unrolled over T time steps
#: (d 96, batch 32, a linear head and cross-entropy over 256 tokens), 1 <= T <= 512.
LSTM = "lstm:"


def _lstm(steps: int) -> tuple[Any, Any]:
    """(module, ``loss(compiled, step)``) of ``lstm:steps``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Unrolled(nn.Module):
        def __init__(self, d: int = 96, vocab: int = 256) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.ih, self.hh = nn.Linear(d, 4 * d), nn.Linear(d, 4 * d)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            e = self.emb(x)
            h = e.new_zeros(x.shape[0], e.shape[-1])
            c, outs = torch.zeros_like(h), []
            for t in range(x.shape[1]):
                i, f, g, o = (self.ih(e[:, t]) + self.hh(h)).chunk(4, -1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            logits = self.head(torch.stack(outs, 1))
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (32, steps), generator=gen) for _ in range(2))
    return Unrolled(), lambda compiled, step: compiled(x, y)


def _workload(model: str, size: str) -> tuple[Any, Any]:
    """(module, ``loss(compiled, step)``) of zoo ``model`` (``size``), an ``hf:`` client or an
    ``lstm:T``."""
    import torch

    from memcompile import zoo

    if model.startswith(LSTM):
        return _lstm(int(model.removeprefix(LSTM)))
    if not model.startswith(HF):
        wl = zoo.build(model, size=size)
        return wl.model, wl.loss
    clients = _clients()
    name = model.removeprefix(HF)
    if name == "gpt2_12":
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.GPT2Config(
            n_layer=12, n_embd=768, n_head=12, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        net = tf.GPT2LMHeadModel(cfg).train()
        net.loss_type = "ForCausalLM"  # as clients.py: no logging graph break
        shape, vocab = (1, 128), cfg.vocab_size
    else:
        net, shape, vocab = clients.build(name), (clients.BATCH, clients.SEQ), clients.VOCAB
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))
    return net, lambda compiled, step: compiled(input_ids=ids, labels=ids).loss


def _known(model: str) -> bool:
    from memcompile import zoo

    if model.startswith(HF):
        return model.removeprefix(HF) in (*_clients().MODELS, "gpt2_12")
    if model.startswith(LSTM):
        steps = model.removeprefix(LSTM)
        return steps.isdigit() and 1 <= int(steps) <= 512
    return model in zoo.names()


def run(
    model: str,
    size: str,
    budget: int | str | None,
    steps: int,
    options: dict[str, Any],
    *,
    cache: bool = False,
    on_infeasible: str = "best_effort",
) -> dict:
    """Time ``steps`` budgeted steps of zoo ``model`` and every planner call in them; the plan
    cache across runs only with ``cache`` (else every plan is searched, whatever the user's
    cache directory holds). With ``on_infeasible="error"`` a step that raises
    ``MemoryBudgetError`` ends the run: its time is the first step's, ``error`` its message."""
    import memcompile
    import memcompile.pipeline.search as search
    from memcompile.pipeline import features, plan_cache

    calls: list[dict[str, Any]] = []
    plan_fragment = search.plan_fragment
    load = plan_cache.load
    replayed: list[str] = []  # the plan cache's entries found (each replayed, if valid)

    def counted(key: str) -> Any:
        entry = load(key)
        if entry is not None:
            replayed.append(key)
        return entry

    def timed(joint_model: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        plan = plan_fragment(joint_model, **kwargs)
        calls.append(
            dict(
                nodes=len(joint_model.nodes),
                target=kwargs.get("target"),
                recompute=kwargs.get("recompute", True),
                swap=kwargs.get("swap_tier"),
                seconds=round(time.perf_counter() - start, 3),
                peak=plan.predicted_peak,
                feasible=plan.feasible,
                digest=_digest(plan),
            )
        )
        print(f"  plan {len(calls)}: {calls[-1]}", file=sys.stderr, flush=True)
        return plan

    search.plan_fragment = timed
    plan_cache.load = counted
    try:
        with features.patch(plan_cache=cache):
            net, loss = _workload(model, size)
            compiled = memcompile.compile(
                net, budget=budget, on_infeasible=on_infeasible, **options
            )
            step_seconds = []
            error = None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", memcompile.MemoryBudgetWarning)
                for step in range(steps):
                    start = time.perf_counter()
                    try:
                        loss(compiled, step).backward()
                    except memcompile.MemoryBudgetError as e:
                        if on_infeasible != "error":
                            raise
                        error = str(e).splitlines()[0]
                    step_seconds.append(round(time.perf_counter() - start, 1))
                    print(f"step {step}: {step_seconds[-1]} s", file=sys.stderr, flush=True)
                    if error is not None:
                        break
            rep = memcompile.report(compiled) if error is None else None
    finally:
        search.plan_fragment = plan_fragment
        plan_cache.load = load
    return dict(
        model=model,
        size=size,
        budget=budget,
        options=options,
        step_seconds=step_seconds,
        planner_seconds=round(sum(c["seconds"] for c in calls), 1),
        calls=calls,
        cache_hits=len(replayed),
        error=error,
        predicted_peak=None if rep is None else rep.predicted_peak,
        resident_bytes=None if rep is None else rep.resident_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gru")
    p.add_argument("--size", default="small")
    p.add_argument("--budget", default="14.2MiB", help="bytes or a size such as 14.2MiB")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("-O", dest="option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--warm", action="store_true", help="no budget, cold and warm plan cache")
    p.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        default=None,
        metavar="MODEL,...",
        help="issue 41's table: no budget, 0.5x, 0.25x and an infeasible budget per model",
    )
    p.add_argument(
        "--infeasible",
        type=float,
        default=0.05,
        help="--sweep's infeasible budget: this share of the no-budget predicted peak",
    )
    p.add_argument(
        "--runs",
        default=",".join(SWEEP_RUNS),
        metavar="RUN,...",
        help=f"--sweep's budgeted runs, of {','.join(SWEEP_RUNS)} (the no-budget run always "
        "comes first: it sets their budgets)",
    )
    p.add_argument("--on-infeasible", default="best_effort", help=argparse.SUPPRESS)
    p.add_argument(
        "--render",
        type=Path,
        metavar="SWEEP.json",
        help="write the table of an earlier --sweep's JSON again (its rows, today's rules; its "
        "'note', if any, in the notes)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from memcompile.cli import CliError, _options

    try:  # as `memcompile plan -O`: values typed alike (true, none, integers)
        options = _options(args.option)
    except CliError as e:
        p.error(f"-O takes KEY=VALUE: {e}")
    budget: int | str | None = (
        None
        if args.budget == "none"
        else int(args.budget)
        if args.budget.isdigit()
        else args.budget
    )
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")

    import memcompile
    from memcompile import zoo

    if args.sweep is not None:
        models = list(zoo.names()) if args.sweep == "all" else args.sweep.split(",")
        unknown = [m for m in models if not _known(m)]
        if unknown:
            p.error(
                f"unknown workload(s) {unknown}; one of {list(zoo.names())}, hf:NAME "
                "(a clients.py model, or hf:gpt2_12) or lstm:T (1 <= T <= 512)"
            )
        if not 0 < args.infeasible < 0.25:
            p.error(f"--infeasible must be in (0, 0.25), got {args.infeasible}")
        unknown = [r for r in args.runs.split(",") if r not in SWEEP_RUNS]
        if unknown:
            p.error(f"unknown run(s) {unknown} in --runs; of {list(SWEEP_RUNS)}")
    if not _known(args.model):
        p.error(
            f"unknown workload {args.model!r}; one of {list(zoo.names())}, hf:NAME (a "
            "clients.py model, or hf:gpt2_12) or lstm:T (1 <= T <= 512)"
        )
    if args.size not in zoo.SIZES:
        p.error(f"unknown size {args.size!r}; one of {list(zoo.SIZES)}")
    try:
        memcompile.MemConfig.from_options({"budget": budget, **options})
    except (TypeError, ValueError) as e:
        p.error(str(e))

    if args.child:
        result = run(
            args.model,
            args.size,
            budget,
            args.steps,
            options,
            # As the parent set it (_child): a sweep's runs search every plan, whatever the
            # user's cache directory holds (patched on, they replayed earlier runs' plans).
            cache=os.environ.get("MEMCOMPILE_PLAN_CACHE", "1") != "0",
            on_infeasible=args.on_infeasible,
        )
        print("RESULT " + json.dumps(result))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    if args.warm:
        return _warm(args, argv)
    if args.sweep is not None:
        return _sweep(args, argv, models)
    if args.render is not None:
        source = json.loads(args.render.read_text())
        return _write_sweep(args, argv, source["rows"], source)
    result = run(args.model, args.size, budget, args.steps, options)

    table = [
        "| plan | joint nodes | target B | recompute | swap | seconds | predicted peak B "
        "| feasible | digest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, c in enumerate(result["calls"], 1):
        table.append(
            f"| {k} | {c['nodes']} | {c['target']} | {c['recompute']} | {c['swap'] or '-'} "
            f"| {c['seconds']:.2f} | {c['peak']} | {c['feasible']} | `{c['digest']}` |"
        )
    first = result["step_seconds"][0]
    notes = [
        _provenance(),
        f"workload: zoo `{args.model}` ({args.size}), budget {args.budget}, options {options}, "
        'on_infeasible="best_effort"; every plan searched (the plan cache across runs off: '
        "`--warm` measures it)",
        f"first step (compiles): **{first} s**, of it the planner **{result['planner_seconds']} "
        f"s** in {len(result['calls'])} calls"
        + (f"; later steps: {result['step_seconds'][1:]} s" if args.steps > 1 else ""),
    ]
    write_results(
        args.out,
        "compile_time",
        title="Compile time of a budgeted step",
        argv=sys.argv[1:] if argv is None else argv,
        notes=notes,
        table=table,
        rows=[result],
    )
    return 0


def _child(
    args: argparse.Namespace,
    budget: str,
    cache: Path | None,
    *,
    model: str | None = None,
    on_infeasible: str = "best_effort",
) -> dict[str, Any]:
    """:func:`run` in a fresh process with the plan cache in ``cache`` (``None``: off)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--model={model or args.model}",
        f"--size={args.size}",
        f"--budget={budget}",
        f"--steps={args.steps}",
        f"--on-infeasible={on_infeasible}",
        *(f"-O{o}" for o in args.option),
    ]
    env = (
        {**os.environ, "MEMCOMPILE_CACHE_DIR": str(cache), "MEMCOMPILE_PLAN_CACHE": "1"}
        if cache is not None
        else {**os.environ, "MEMCOMPILE_PLAN_CACHE": "0"}
    )
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _warm(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--warm``: no budget, cold cache, warm cache; each a fresh process."""
    from machine import write_results

    rows = []
    with tempfile.TemporaryDirectory(prefix="memcompile_plans_") as cache:
        for label, budget in (("no budget", "none"), ("cold", args.budget), ("warm", args.budget)):
            result = _child(args, budget, Path(cache))
            result["run"] = label
            rows.append(result)
            print(f"{label}: first step {result['step_seconds'][0]} s", file=sys.stderr)
    table = [
        "| run | budget | first step s | planner calls | planner s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['run']} | {r['budget'] or '-'} | {r['step_seconds'][0]} | "
            f"{len(r['calls'])} | {r['planner_seconds']} |"
        )
    notes = [
        f"workload: zoo `{args.model}` ({args.size}), budget {args.budget}, options "
        f'{args.option}, on_infeasible="best_effort"',
        "each run a fresh process; cold: an empty plan cache directory; warm: the directory "
        "the cold run wrote (MEMCOMPILE_CACHE_DIR)",
    ]
    write_results(
        args.out,
        "compile_time_warm",
        script="compile_time",
        title="Compile time of a budgeted step: the plan cache across runs",
        argv=sys.argv[1:] if argv is None else argv,
        notes=notes,
        table=table,
        rows=rows,
    )
    return 0


def _provenance() -> str:
    """Where the memcompile these runs import comes from, and its commit."""
    import memcompile

    where = Path(memcompile.__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(where), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"memcompile from `{where}`, commit {commit or 'unknown'}"


#: Issue 41's targets: a feasible budget's compiling steps at most this many times the
#: no-budget ones plus ``_SLACK_S``; the error within ``_ERROR_S`` on a graph of at most
#: ``_ERROR_NODES`` nodes.
_FACTOR, _SLACK_S, _ERROR_S, _ERROR_NODES = 2, 10, 10, 2000

#: ``--sweep``'s budgeted runs, after each model's run without a budget.
SWEEP_RUNS = ("0.5x", "0.25x", "infeasible")


def _sweep(args: argparse.Namespace, argv: list[str] | None, models: list[str]) -> int:
    """``--sweep``: per model, no budget, 0.5x, 0.25x and an infeasible budget (``error``)."""
    args.steps = max(args.steps, 3)
    rows: list[dict[str, Any]] = []
    for model in models:
        base = _child(args, "none", None, model=model)
        base["run"] = "none"
        rows.append(base)
        resident, peak = base["resident_bytes"] or 0, base["predicted_peak"] or 0
        acts = max(0, peak - resident)
        for label, budget, mode in (
            ("0.5x", str(int(resident + 0.5 * acts)), "best_effort"),
            ("0.25x", str(int(resident + 0.25 * acts)), "best_effort"),
            ("infeasible", str(int(args.infeasible * peak)), "error"),
        ):
            if label not in args.runs.split(","):
                continue
            r = _child(args, budget, None, model=model, on_infeasible=mode)
            r["run"] = label
            rows.append(r)
            print(f"{model} {label}: {round(sum(r['step_seconds']), 1)} s", file=sys.stderr)
    return _write_sweep(args, argv, rows)


def _write_sweep(
    args: argparse.Namespace,
    argv: list[str] | None,
    rows: list[dict],
    source: dict[str, Any] | None = None,
) -> int:
    """The sweep's table from its ``rows`` (each model's ``none`` row, then its budgets);
    ``source``: the JSON they were read from (``--render``), named in the notes."""
    from machine import write_results

    table = [
        "| model | joint nodes | no budget s | 0.5x s | 0.25x s | infeasible s | ends in "
        "| targets |",
        "|---|---|---|---|---|---|---|---|",
    ]
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        runs = {r["run"]: r for r in rows if r["model"] == model}
        took = {k: round(sum(r["step_seconds"]), 1) for k, r in runs.items()}
        nodes = max((c["nodes"] for r in runs.values() for c in r["calls"]), default=0)
        limit = _FACTOR * took["none"] + _SLACK_S
        misses = [
            f"{label} {took[label]} s > {limit:.1f} s"
            for label in ("0.5x", "0.25x")
            if label in took and took[label] > limit
        ]
        error = runs["infeasible"]["error"] if "infeasible" in runs else None
        if error and took["infeasible"] > _ERROR_S:
            misses.append(
                f"error {took['infeasible']} s > {_ERROR_S} s"
                if nodes <= _ERROR_NODES
                else f"(error {took['infeasible']} s: over {_ERROR_NODES:,} nodes, no target)"
            )
        ends = "-" if "infeasible" not in runs else "error" if error else "a plan that fits"
        cells = " | ".join(str(took.get(label, "-")) for label in SWEEP_RUNS)
        table.append(
            f"| {model} | {nodes or '-'} | {took['none']} | {cells} | {ends} | "
            f"{'; '.join(misses) or 'met'} |"
        )
    notes = [
        f"zoo models at size {args.size} (an hf: model at its clients.py configuration, lstm:T "
        "a hand-written LSTM cell unrolled over T steps, d 96, batch 32); each "
        "run a fresh process, the plan cache across runs off; budgets: resident + 0.5x and "
        "0.25x the no-budget run's predicted activations (its predicted peak less the resident "
        f"bytes), and {args.infeasible}x its predicted peak "
        'with on_infeasible="error", timed to MemoryBudgetError',
        f"seconds: the first {max(len(r['step_seconds']) for r in rows)} steps (or until the "
        "error), the first compiling; joint nodes: the largest graph the planner searched; "
        f"targets (issue 41): a feasible budget's <= {_FACTOR}x the no-budget one + {_SLACK_S} "
        f"s, the error <= {_ERROR_S} s on graphs of <= {_ERROR_NODES:,} nodes",
    ]
    if source is None:
        notes.insert(0, _provenance())
    else:
        notes.append(
            f"rows measured by `{source['command']}` on {source['date']} ({source['machine']}); "
            "this table rendered again from its JSON (`--render`)"
            + (f"; {source['note']}" if source.get("note") else "")
        )
    write_results(
        args.out,
        "compile_time_sweep",
        script="compile_time",
        title="Compile time: first step without a budget, under 0.5x and 0.25x, and the error",
        argv=sys.argv[1:] if argv is None else argv,
        notes=notes,
        table=table,
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
