"""Does ``mul(mul(x, mask), scale)`` reproduce ``native_dropout(x, p)[0]`` bit for bit?

The dropout pass (memcompile/rewrites/dropout.py) rebuilds a dropout's output from its saved mask
so the backward can recompute it. This checks the arithmetic on every device available here
(CPU, and CUDA when present), for float32/float64/float16/bfloat16 and many ``p``, against
``native_dropout`` itself (same seed), comparing bit patterns (NaN and -0.0 included):

    OMP_NUM_THREADS=1 python benchmarks/dropout_identity.py [--ps 200] [--numel 1000003]

For each device and dtype it prints how many ``p`` matched for memcompile's scale
(``dropout_scale``) and for the alternative scales (the double ``1/(1-p)``, rounded to the dtype,
CUDA's float ``1/float(1-p)``), and exits 1 if memcompile's scale missed any. A second check
runs ``native_dropout`` and the rewrite end to end: eager F.dropout vs native_dropout (they can
differ on CPU, where eager uses ``_dropout_impl``'s float ``1/(1-p)`` noise; not memcompile's
concern, the compiled graph always calls native_dropout).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

import torch

try:
    from memcompile.rewrites.dropout import dropout_scale
except ImportError:  # run without the package (e.g. a bare GPU machine): candidates only
    dropout_scale = None  # type: ignore[assignment]

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _candidates(device: str) -> dict[str, Callable[[float, torch.dtype], float | None]]:
    def double(p: float, dtype: torch.dtype) -> float:
        return 0.0 if p == 1 else 1.0 / (1.0 - p)

    def rounded(p: float, dtype: torch.dtype) -> float:
        return float(torch.tensor(double(p, dtype), dtype=dtype).item())

    def cuda_float(p: float, dtype: torch.dtype) -> float:
        if dtype == torch.float64:
            return double(p, dtype)
        keep = float(torch.tensor(1.0 - p, dtype=torch.float32).item())
        return float(torch.tensor(1.0 / keep, dtype=torch.float32).item()) if keep else 0.0

    out: dict[str, Callable[[float, torch.dtype], float | None]] = {
        "double": double,
        "rounded_to_dtype": rounded,
        "cuda_float": cuda_float,
    }
    if dropout_scale is not None:
        out["memcompile"] = lambda p, dtype: dropout_scale(p, dtype, device)
    return out


def check(device: str, ps: list[float], numel: int) -> bool:
    """Print the match counts of every scale candidate; True if memcompile's never missed."""
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=gen)
    base[:4] = torch.tensor([float("inf"), float("nan"), -0.0, -1e-40])  # edge values
    ok = True
    for dtype in DTYPES:
        x = base.to(device=device, dtype=dtype)
        hits = dict.fromkeys(_candidates(device), 0)
        skipped = dict.fromkeys(hits, 0)
        eager_diff = 0
        for p in ps:
            torch.manual_seed(1234)
            out, mask = aten.native_dropout(x, p, True)
            torch.manual_seed(1234)
            eager = torch.nn.functional.dropout(x, p, True)
            if not torch.equal(_bits(eager), _bits(out)):
                eager_diff += 1
            for name, fn in _candidates(device).items():
                scale = fn(p, dtype)
                if scale is None:  # memcompile leaves this dropout alone
                    skipped[name] += 1
                    continue
                rebuilt = aten.mul.Tensor(aten.mul.Tensor(x, mask), scale)
                if torch.equal(_bits(rebuilt), _bits(out)):
                    hits[name] += 1
                elif name == "memcompile":
                    ok = False
                    print(f"  MISMATCH {device} {dtype} p={p!r} scale={scale!r}")
        tried = {k: len(ps) - skipped[k] for k in hits}
        line = ", ".join(f"{k} {hits[k]}/{tried[k]}" for k in hits)
        name = str(dtype).removeprefix("torch.")
        print(f"{device:5s} {name:9s} {line}; eager F.dropout != native {eager_diff}/{len(ps)}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", type=int, default=200, help="random p values besides 0, 0.5, 1")
    ap.add_argument("--numel", type=int, default=1_000_003)
    args = ap.parse_args()
    rng = random.Random(0)
    ps = [0.0, 0.1, 0.2, 0.5, 1.0] + [rng.random() for _ in range(args.ps)]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(
        f"torch {torch.__version__}; devices {devices}; {len(ps)} p values, {args.numel} elements"
    )
    if torch.cuda.is_available():
        print(f"cuda device: {torch.cuda.get_device_name()}")
    ok = all([check(d, ps, args.numel) for d in devices])
    print("memcompile's scale:", "bit-identical everywhere" if ok else "MISMATCHES (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
