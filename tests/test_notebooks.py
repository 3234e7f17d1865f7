"""The notebooks in notebooks/ run top to bottom, headless, and show what their text promises.

Each notebook is executed fresh with nbclient (the committed files carry no outputs) in a kernel
of this interpreter: a kernelspec written to a temporary ``JUPYTER_PATH`` runs
``sys.executable -m ipykernel_launcher`` with ``OMP_NUM_THREADS=1`` and this checkout on
``PYTHONPATH``, so it works from a fresh venv whatever kernels the machine has registered. A cell
that raises fails the test (nbclient's ``CellExecutionError`` names the cell). Each notebook
takes 10-25 s on a 2-core CPU. Without graphviz's ``dot`` the drawing cells print that they are
skipped; the assertions on drawings apply only when it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="the dev extra (nbclient, ipykernel) is missing")
nbclient = pytest.importorskip("nbclient", reason="the dev extra (nbclient, ipykernel) is missing")
pytest.importorskip("ipykernel", reason="the dev extra (nbclient, ipykernel) is missing")
pytest.importorskip("graphviz", reason="the viz extra (graphviz, matplotlib) is not installed")
pytest.importorskip("matplotlib", reason="the viz extra (graphviz, matplotlib) is not installed")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "memcompile-tests"
HAVE_DOT = shutil.which("dot") is not None


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JUPYTER_PATH folder holding a kernelspec for this interpreter."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "memcompile tests",
                "language": "python",
                "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "NO_COLOR": "1"},
            }
        )
    )
    return root


def execute(name: str, kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run notebooks/``name`` in a fresh kernel (cwd ``tmp_path``); the executed notebook."""
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{name} is committed with outputs: strip them (the test executes it fresh)"
    )
    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name=KERNEL, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if a cell raises
    print(f"{name}: executed in {time.perf_counter() - start:.1f} s")
    return nb


def text(nb: Any) -> str:
    """Every stream and plain-text output of ``nb``, joined."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", ()):
            if o.output_type == "stream":
                out.append(o.text)
            elif "data" in o and "text/plain" in o.data:
                out.append(o.data["text/plain"])
    return "\n".join(out)


def images(nb: Any, mime: str) -> list[str]:
    """Every ``mime`` output of ``nb`` (e.g. ``image/svg+xml``)."""
    return [
        o.data[mime] for c in nb.cells for o in c.get("outputs", ()) if mime in o.get("data", {})
    ]


def test_every_notebook_is_tested() -> None:
    tested = {"01_quickstart.ipynb", "02_partitioned_graphs.ipynb", "03_dynamic_pilot.ipynb"}
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} == tested


def test_quickstart_fits_the_budget_and_keeps_the_gradients(
    kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = text(execute("01_quickstart.ipynb", kernel_path, tmp_path, monkeypatch))
    assert "measured peak <= budget: True" in out
    assert "gradients bit-identical to eager: True" in out
    eager = re.search(r"eager peak: +(\S+ \S+)", out)
    saving = re.search(r"saving: (\d+)% of the eager peak", out)
    assert eager and saving and int(saving.group(1)) >= 25, out  # a 75 % budget
    assert "step 2: loss" in out


def test_partitioned_graphs_draws_and_reads_the_plan(
    kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nb = execute("02_partitioned_graphs.ipynb", kernel_path, tmp_path, monkeypatch)
    out = text(nb)
    assert re.search(r"peak at (forward|backward) node '\w+'", out), out
    assert "round trip equal: True" in out
    assert len(images(nb, "image/png")) == 2  # two timelines
    svgs = images(nb, "image/svg+xml")
    if not HAVE_DOT:
        assert not svgs and "graphviz's `dot` is not installed" in out
        return
    mlp, gpt = svgs
    assert "PEAK" in mlp and "compact" not in mlp  # every node
    assert "PEAK" in gpt and "(compact: runs of nodes)" in gpt


def test_dynamic_pilot_predicts_blocks_and_draws_transition_probabilities(
    kernel_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nb = execute("03_dynamic_pilot.ipynb", kernel_path, tmp_path, monkeypatch)
    out = text(nb)
    accuracy = re.findall(r"(\d)-ahead accuracy: pilot (0\.\d+|1\.0+), markov (0\.\d+|1\.0+)", out)
    assert [k for k, _, _ in accuracy] == ["1", "2"], out
    pilot_1, markov_1 = float(accuracy[0][1]), float(accuracy[0][2])
    assert pilot_1 > 0.5 and markov_1 > 0.5  # far above chance among ~16 blocks
    assert "active='lightgbm'" in out  # the pilot trained
    assert "79 of 80 steps written" in out
    svgs = images(nb, "image/svg+xml")
    if HAVE_DOT:
        (blocks,) = svgs
        assert "p=1.00" in blocks and "experts" in blocks
