"""memcompile beside PyTorch's memory features on a CUDA GPU: peak from the CUDA allocator, time.

    python benchmarks/cuda_anchors.py                          # gpt + gpt_manual, default configs
    python benchmarks/cuda_anchors.py --models gpt --configs eager,mc_r50,mc_h25,mc_h25s

The GPU counterpart of ``anchors.py`` (same models at size ``bench``, same configurations and
budget rule: ``resident + f * eager step peak``), all in one process per model. For each
configuration:

* the model is built twice from one seed (an eager reference and the configured copy), moved to
  the GPU, and each runs 2 warm-up steps (compiles happen here);
* one step (``zero_grad(set_to_none)``, forward, backward, no optimizer) is measured with
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (absolute, like the
  budget), and ``max_memory_reserved`` beside it (what the caching allocator held);
* losses and gradients are compared bitwise with the eager copy (same dropout seed);
* ``--reps`` steps are timed interleaved with the eager copy (each step synchronized), and the
  median of the paired wall-time ratios is reported.

A trailing ``s`` (``mc_h25s``) runs the same plan with synchronous host copies
(``TieredStore(asynchronous=False)``): the difference to ``mc_h25`` is what the side stream and
the prefetching buy. Results: ``benchmarks/results/cuda_anchors.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from anchors import _mib, budget_for, build, configure

import memcompile
from memcompile.report import find_compiler

RESULTS = Path(__file__).parent / "results" / "cuda_anchors"
DEFAULT_CONFIGS = (
    "eager,checkpoint,sac,inductor_amb50,inductor_amb10,mc_none,mc_r50,mc_r35,mc_r25,"
    "mc_s50,mc_s50s,mc_s35,mc_s35s,mc_h25,mc_h15,mc_h10"
)


def _step(fn: Any, net: torch.nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    net.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout draws the same mask in both copies
    loss = fn(*batch)
    loss.backward()
    return loss.detach()


def _timed(fn: Any, net: torch.nn.Module, batch: tuple[Any, ...]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _step(fn, net, batch)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(model: str, config: str, reps: int, eager: dict[str, Any] | None) -> dict[str, Any]:
    """One configuration: peak, bit-identity and paired time against an eager copy."""
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = 1.0
    gc.collect()  # the last configuration's models must not stay on the device
    torch.cuda.empty_cache()
    sync = config.startswith("mc_") and config.endswith("s")
    base = config[:-1] if sync else config
    budget = budget_for(base, eager) if eager is not None else None
    ref, wl = build(model).to("cuda"), build(model).to("cuda")
    ref.model.load_state_dict(wl.model.state_dict())
    out: dict[str, Any] = {"model": wl.name, "config": config, "budget": budget}
    batch = wl.batch(0)
    # The reference copy's parameters are on the device too; memcompile counts what is already
    # allocated against its budget, so it gets them on top (they are subtracted below as well).
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    with tempfile.TemporaryDirectory(prefix="memcompile-cuda-") as disk_dir:
        fn = configure(base, wl, None if budget is None else budget + ref_bytes, disk_dir)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _step(fn, wl.model, batch)
                if sync:
                    find_compiler(fn)[0].store.asynchronous = False
                _step(fn, wl.model, batch)
        except memcompile.MemoryBudgetError as e:
            out.update(fits=False, min_feasible=e.min_feasible, error=str(e).splitlines()[0])
            out["device_other"] = find_compiler(fn)[0].device_other_bytes
            return out
        out["first_steps_s"] = time.perf_counter() - t0
        out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
        loss = _step(fn, wl.model, batch)
        ref_loss = _step(ref.model, ref.model, batch)
        out["loss_equal"] = bool(torch.equal(loss, ref_loss))
        out["grads_equal"] = all(
            (a.grad is None and b.grad is None)
            or (
                a.grad is not None
                and b.grad is not None
                and torch.equal(a.grad.cpu(), b.grad.cpu())
            )
            for a, b in zip(wl.model.parameters(), ref.model.parameters(), strict=True)
        )
        wl.model.zero_grad(set_to_none=True)
        ref.model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        # The reference copy stays resident (the same for every config): subtract it as well.
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, wl.model, batch)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(
            peak=peak - ref_bytes,
            resident=resident - ref_bytes,
            step_peak=peak - resident,
            reserved=torch.cuda.max_memory_reserved(),
        )
        if budget is not None:
            out["within_budget"] = out["peak"] <= budget * 1.02
        if config.startswith("mc_"):
            rep = memcompile.report(fn)
            out["predicted_peak"] = rep.predicted_peak - ref_bytes
            plans = rep.plan.fragments
            out["recomputed"] = sum(len(p.recomputed) for p in plans)
            out["swapped"] = sum(len(p.swapped) for p in plans)
            out["prefetched"] = sum(len(p.prefetch) for p in plans)
            out["predicted_stall_s"] = sum(p.swap_stall or 0.0 for p in plans)
            out["predicted_overhead_s"] = sum(p.recompute_time + p.swap_time for p in plans)
            out["in_flight_after"] = find_compiler(fn)[0].store.in_flight()
            out["device_other"] = find_compiler(fn)[0].device_other_bytes
        ratios, times, eager_times = [], [], []
        for _ in range(reps):
            a = _timed(ref.model, ref.model, batch)
            b = _timed(fn, wl.model, batch)
            ratios.append(b / a)
            times.append(b)
            eager_times.append(a)
        out["time_ratio"] = statistics.median(ratios)
        out["step_ms"] = 1e3 * statistics.median(times)
        out["eager_step_ms"] = 1e3 * statistics.median(eager_times)
        out["fits"] = True
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        "# memcompile on CUDA: peak (CUDA allocator) and time vs PyTorch's features",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}  ",
        f"Date: {result['date']}",
        "",
        "step peak = max_memory_allocated − memory allocated at the step's start (parameters, "
        "batch); vs eager = step peak / eager's; time = median paired wall-time ratio vs an "
        "eager copy (each step synchronized). bit-id = loss and every gradient equal to eager.",
        "",
        "| model | config | budget MiB | peak MiB | predicted MiB | step peak MiB | vs eager "
        "| reserved MiB | time × eager | step ms | bit-id | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager: dict[str, float] = {}
    for r in result["rows"]:
        if r["config"] == "eager" and "step_peak" in r:
            eager[r["model"]] = r["step_peak"]
        if not r.get("fits", False):
            lines.append(
                f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | does not fit: "
                f"{r.get('error', '')[:90]} |||||||||"
            )
            continue
        vs = r["step_peak"] / eager[r["model"]] if r["model"] in eager else None
        plan = (
            f"R{r['recomputed']} S{r['swapped']} P{r['prefetched']} "
            f"stall {1e3 * r['predicted_stall_s']:.2f} ms"
            if "recomputed" in r
            else ""
        )
        lines.append(
            f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | {_mib(r['peak'])} "
            f"| {_mib(r.get('predicted_peak'))} | {_mib(r['step_peak'])} "
            f"| {'—' if vs is None else f'{vs:.2f}×'} | {_mib(r['reserved'])} "
            f"| {r['time_ratio']:.2f} | {r['step_ms']:.2f} "
            f"| {'yes' if r['loss_equal'] and r['grads_equal'] else 'no'} | {plan} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gpt,gpt_manual")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_anchors.py needs a CUDA device")
    rows = []
    for model in args.models.split(","):
        eager = run(model, "eager", args.reps, None)
        rows.append(eager)
        print(json.dumps(eager), flush=True)
        for config in args.configs.split(","):
            if config == "eager":
                continue
            try:
                row = run(model, config, args.reps, eager)
            except Exception as e:  # one broken configuration must not lose the others
                row = {"model": model, "config": config, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{platform.platform()}",
        "date": dt.date.today().isoformat(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
