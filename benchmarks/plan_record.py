"""Every plan the test suite compiles, recorded per test: the check that a refactor changed no plan.

A pytest plugin and a comparison. The plugin catches each ``memcompile_plan_F*`` trace artifact
(the final plan JSON a fragment's forward compiler emits for tlparse) and appends it to one file
per test under ``$PLANREC_DIR``; nothing is written when the variable is unset::

    PLANREC_DIR=/tmp/plans_before PYTHONPATH=benchmarks OMP_NUM_THREADS=1 \\
        python -m pytest -q -n 2 -p plan_record          # on the commit before the change
    PLANREC_DIR=/tmp/plans_after ...                     # and after it
    python benchmarks/plan_record.py /tmp/plans_before /tmp/plans_after

The comparison lists the tests whose plans differ (byte for byte) and those recorded on one side
only: with ``-n 2`` a test may reuse a graph another test of its worker compiled (Dynamo's cache),
and then records nothing; run such a test alone on both sides to compare it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

_current = {"test": "collect"}


def _install() -> None:
    import torch._logging._internal as internal

    real = internal.trace_structured

    def recording(name: str, metadata_fn: Any = dict, *, payload_fn: Any = lambda: None, **kw: Any):
        out = os.environ.get("PLANREC_DIR")
        if out and name == "artifact":
            meta = metadata_fn()
            if isinstance(meta, dict) and str(meta.get("name", "")).startswith("memcompile_plan_"):
                test = re.sub(r"[^A-Za-z0-9_.-]", "_", _current["test"])[:200]
                with open(Path(out) / f"{test}.jsonl", "a") as f:
                    f.write(f"{meta['name']}\t{payload_fn()}\n")
                return None
        return real(name, metadata_fn, payload_fn=payload_fn, **kw)

    internal.trace_structured = recording


def pytest_configure(config: Any) -> None:
    """Install the recorder (``-p plan_record``) when ``$PLANREC_DIR`` is set."""
    out = os.environ.get("PLANREC_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        _install()


def pytest_runtest_setup(item: Any) -> None:
    _current["test"] = item.nodeid


def compare(before: Path, after: Path) -> int:
    """Print the tests whose recorded plans differ; return how many differ or are one-sided."""
    a = {p.name: p for p in before.glob("*.jsonl")}
    b = {p.name: p for p in after.glob("*.jsonl")}
    differ = sorted(n for n in a.keys() & b.keys() if a[n].read_bytes() != b[n].read_bytes())
    plans = sum(len(p.read_text().splitlines()) for p in a.values())
    print(f"{len(a)} tests and {plans} plans before, {len(b)} tests after")
    for name in differ:
        print(f"differ: {name}")
    for name in sorted(a.keys() - b.keys()):
        print(f"before only: {name}")
    for name in sorted(b.keys() - a.keys()):
        print(f"after only: {name}")
    bad = len(differ) + len(a.keys() ^ b.keys())
    print("identical" if not bad else f"{bad} test(s) to look at")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    for d in (args.before, args.after):
        if not d.is_dir():
            parser.error(f"{d} is not a folder of recorded plans")
    return 1 if compare(args.before, args.after) else 0


if __name__ == "__main__":
    sys.exit(main())
