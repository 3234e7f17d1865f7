"""The ``memcompile`` command: inspect, plan, draw, timeline, bench, and its error paths.

Most tests call ``memcompile.cli.main`` in-process (a tiny MLP from tests/cli_targets.py, about a
second per compile); one runs ``python -m memcompile`` as a real process. Error paths check the
whole contract: exit status 1, exactly one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memcompile.cli import main
from memcompile.pipeline import features
from memcompile.planning.plan import MemoryPlan

import cli_targets

ROOT = Path(__file__).resolve().parent.parent
TARGET = "cli_targets:mlp"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's `dot` program is not installed"
)
pytest.importorskip("graphviz", reason="the viz extra (graphviz, matplotlib) is not installed")
pytest.importorskip("matplotlib", reason="the viz extra (graphviz, matplotlib) is not installed")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1
    assert len(lines) == 1, err
    assert lines[0].startswith("memcompile: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module", autouse=True)
def _out_of_place() -> Iterator[None]:
    # The expectations below (one recompute at 90 %, gelu in the decision table) were set with
    # the backward's elementwise ops out of place; in place, the MLP fits 85 % with no plan.

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features, "FEATURES", features.FEATURES.replace(elementwise_in_place=False))
        yield


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert main(["plan", TARGET, "--budget", "90%", "-o", str(path), "--no-measure"]) == 0
    return path


def test_inspect_prints_fragments_peaks_plan_costs_and_fallbacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "inspect", TARGET, "--budget", "90%")
    assert code == 0
    assert "memcompile inspect cli_targets:mlp: budget" in out
    assert "step peak: predicted" in out and "measured" in out and "without a plan" in out
    assert "fragments" in out and "F0" in out
    assert "plan of F0: fits; recompute 1" in out
    assert "cost: recompute" in out
    assert "gelu" in out and "recompute" in out  # the decision table
    assert "eager fallbacks: none" in out


def test_inspect_json_predicts_the_measured_peak_within_the_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "inspect", TARGET, "--budget", "90%", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["exact"] is True
    assert data["predicted_peak"] <= data["budget"] < data["before_peak"]
    # the single-fragment model is exact on CPU (to the scalar wrappers kernels make)
    assert abs(data["measured_peak"] - data["predicted_peak"]) <= 0.01 * data["predicted_peak"]
    assert [f["name"] for f in data["fragments"]] == ["F0"]
    assert data["plans"][0]["feasible"] is True
    assert data["step"] == ["F0.fw", "F0.bw"]
    assert data["fallbacks"] == []


def test_a_target_with_its_own_loss_trains_on_that_loss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = cli_targets.LOSS_CALLS[0]
    code, out, _ = run(capsys, "inspect", "cli_targets:mlp_with_loss", "--json", "--no-measure")
    assert code == 0
    assert cli_targets.LOSS_CALLS[0] > before  # traced by Dynamo inside the compiled step
    assert json.loads(out)["budget"] is None


def test_plan_writes_a_file_memoryplan_reads_with_the_graphs_beside_it(plan_file: Path) -> None:
    text = plan_file.read_text()
    plan = MemoryPlan.from_json(text)
    assert plan.budget is not None and len(plan.fragments) == 1
    assert [d.action for d in plan.fragments[0].decisions].count("recompute") == 1
    extra = json.loads(text)["memcompile_inspection"]
    fragment = extra["fragments"][0]
    assert fragment["forward"]["nodes"] and fragment["backward"]["nodes"]
    assert fragment["before_backward"]["nodes"]  # the unplanned compile, for the timeline
    assert all("inputs" in n for n in fragment["forward"]["nodes"])


@needs_dot
def test_draw_from_a_plan_file_colours_nodes_by_decision_and_marks_the_peak(
    capsys: pytest.CaptureFixture[str], plan_file: Path, tmp_path: Path
) -> None:
    from memcompile.viz.draw import ROLE_COLOURS

    out_svg = tmp_path / "plan.svg"
    code, out, _ = run(capsys, "draw", str(plan_file), "-o", str(out_svg))
    assert code == 0 and f"wrote {out_svg}" in out
    svg = out_svg.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "PEAK" in svg
    assert f'fill="{ROLE_COLOURS["recompute"]}"' in svg  # gelu, recomputed
    assert f'fill="{ROLE_COLOURS["keep"]}"' in svg
    assert "cluster_F0_forward" in svg and "cluster_F0_backward" in svg


def test_draw_dot_source_needs_no_graphviz_program(
    capsys: pytest.CaptureFixture[str], plan_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "plan.dot"
    code, _, _ = run(capsys, "draw", str(plan_file), "-o", str(out), "--json")
    assert code == 0
    source = out.read_text()
    assert source.startswith("digraph memcompile_plan")
    assert "subgraph cluster_F0" in source


def test_draw_compact_draws_runs_of_nodes_and_full_every_node(
    capsys: pytest.CaptureFixture[str], plan_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "plan.dot"
    code, printed, err = run(capsys, "draw", str(plan_file), "-o", str(out), "--json")
    assert code == 0, err
    assert json.loads(printed)["compact"] is False  # a small graph: every node by default
    full = out.read_text()
    code, printed, err = run(capsys, "draw", str(plan_file), "-o", str(out), "--compact")
    assert code == 0, err
    assert "(compact: runs of nodes; --full draws every node)" in printed
    compact = out.read_text()
    assert "(compact: runs of nodes)" in compact and "PEAK" in compact
    assert compact.count("fillcolor=") < full.count("fillcolor=")
    code, printed, _ = run(capsys, "draw", str(plan_file), "-o", str(out), "--full", "--json")
    assert code == 0 and json.loads(printed)["compact"] is False and out.read_text() == full


def test_timeline_from_a_plan_file_writes_a_png(
    capsys: pytest.CaptureFixture[str], plan_file: Path, tmp_path: Path
) -> None:
    out_png = tmp_path / "step.png"
    code, out, _ = run(capsys, "timeline", str(plan_file), "-o", str(out_png), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["output"] == str(out_png) and data["format"] == "png"
    assert data["predicted_peak"] <= data["budget"] < data["before_peak"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("nosuch", "unknown target 'nosuch'"),
        ("no_such_module:f", "cannot import 'no_such_module'"),
        ("cli_targets:missing", "has no function 'missing'"),
        ("cli_targets:raises", "raised RuntimeError: no data here"),
        ("cli_targets:wrong_shape", "must return (model, batch) or (model, batch, loss)"),
    ],
)
def test_a_bad_target_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str], target: str, needle: str
) -> None:
    code, _, err = run(capsys, "inspect", target)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize(
    ("budget", "needle"),
    [("12XB", "cannot read '12XB' as a size"), ("abc%", "a percentage must be a positive")],
)
def test_a_budget_typo_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str], budget: str, needle: str
) -> None:
    code, _, err = run(capsys, "plan", TARGET, "--budget", budget, "-o", "unused.json")
    assert_one_line_error(code, err, "--budget", needle)


def test_an_option_typo_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "inspect", TARGET, "-O", "swop=false", "--no-before")
    assert_one_line_error(code, err, "unknown memcompile option 'swop'")


def test_an_infeasible_budget_states_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    # Below every plan's lower bound: told at once, with the bound (the fast "no").
    code, _, err = run(capsys, "inspect", TARGET, "--budget", "1KiB", "--no-measure")
    assert_one_line_error(code, err, "no memory plan fits budget=1.00 KiB", "or more (a bound")


def test_an_unreadable_plan_file_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "missing.json"
    code, _, err = run(capsys, "draw", str(missing), "-o", str(tmp_path / "x.svg"))
    assert_one_line_error(code, err, "cannot read plan file", "No such file")

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    code, _, err = run(capsys, "timeline", str(garbage), "-o", str(tmp_path / "x.png"))
    assert_one_line_error(code, err, "garbage.json", "not JSON")

    bare = tmp_path / "bare.json"
    bare.write_text(MemoryPlan(budget=1, device_profile="cpu").to_json())
    code, _, err = run(capsys, "draw", str(bare), "-o", str(tmp_path / "x.svg"))
    assert_one_line_error(code, err, "a memory plan without graphs", "memcompile plan")


def test_an_unknown_output_format_is_refused_before_compiling(
    capsys: pytest.CaptureFixture[str], plan_file: Path, tmp_path: Path
) -> None:
    code, _, err = run(capsys, "draw", str(plan_file), "-o", str(tmp_path / "plan.txt"))
    assert_one_line_error(code, err, "must end in one of .svg, .png, .pdf, .dot")


def test_bench_refuses_an_unknown_suite_and_flags_of_a_suite_not_running(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "bench", "--suite", "nope")
    assert_one_line_error(code, err, "unknown suite 'nope'", "anchors, dynamic, all")
    code, _, err = run(capsys, "bench", "--suite", "dynamic", "--models", "gpt")
    assert_one_line_error(code, err, "--models applies to the 'anchors' suite")
    code, _, err = run(capsys, "bench", "--steps", "5")  # --suite anchors by default
    assert_one_line_error(code, err, "--steps applies to the 'dynamic' suite")
    code, _, err = run(capsys, "bench", "--suite", "dynamic", "--steps", "0")
    assert_one_line_error(code, err, "--steps must be >= 1")


def test_bench_dry_run_lists_every_script_of_all_with_its_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["bench", "--suite", "all", "--dry-run", "--json", "--out", str(tmp_path)]
    code, out, err = run(capsys, *argv, "--steps", "40", "--size", "tiny", "--reps", "2")
    assert code == 0, err
    data = json.loads(out)
    scripts = {
        s["suite"]: [(Path(c[1]).name, c[2:]) for c in s["commands"]] for s in data["suites"]
    }
    out_flag = ["--out", str(tmp_path)]
    assert scripts == {
        "anchors": [("anchors.py", ["--reps", "2", *out_flag])],
        "dynamic": [
            (
                "dynamic.py",
                [
                    *("--steps", "40", "--extra-steps", "40", "--natural-steps", "40"),
                    *("--size", "tiny", *out_flag),
                ],
            ),
            ("pilot_latency.py", ["--steps", "40", "--size", "tiny", "--calls", "1000", *out_flag]),
        ],
    }
    assert not list(tmp_path.iterdir())  # nothing ran


def test_bench_dynamic_runs_the_pilot_accuracy_harness_with_progress(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memcompile import cli_bench

    # dynamic.py alone (~10 s at this size): the dry run above shows pilot_latency.py follows it
    monkeypatch.setitem(cli_bench.SUITES, "dynamic", ("dynamic.py",))
    argv = ["bench", "--suite", "dynamic", "--steps", "12", "--size", "tiny"]
    code, out, err = run(capsys, *argv, "--out", str(tmp_path), "--json")
    assert code == 0, err
    (suite,) = json.loads(out)["suites"]
    assert suite["suite"] == "dynamic" and suite["out"] == str(tmp_path)
    assert suite["rows"][-1] == "dynamic: treelstm predictors replayed"
    assert "dynamic [1/11] trained 2/12 MoE steps" in err  # plain progress: one line per row
    assert "dynamic [11/11] treelstm predictors replayed" in err
    result = json.loads((tmp_path / "dynamic.json").read_text())
    assert result["facts"]["steps"] == 12
    assert set(result["accuracy"]) == {
        "pilot",
        "pilot, no threshold",
        "pilot without outputs",
        "markov",
        "replay",
    }
    assert "| markov |" in (tmp_path / "dynamic.md").read_text()


def test_bench_dynamic_harness_error_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 5 steps with the harness's 10 warm-up steps: nothing to score, refused before training
    code, _, err = run(
        capsys, "bench", "--suite", "dynamic", "--steps", "5", "--out", str(tmp_path)
    )
    lines = [ln for ln in err.splitlines() if ln.startswith("memcompile: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err
    assert "dynamic failed" in lines[0] and "must be more than --warmup" in lines[0]


def test_bench_harness_failure_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, "bench", "--configs", "nosuch", "--out", str(tmp_path))
    lines = [ln for ln in err.splitlines() if ln.startswith("memcompile: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err
    assert "anchors failed" in lines[0] and "nosuch" in lines[0]


def test_bench_anchors_runs_a_tiny_anchor_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["bench", "--suite", "anchors", "--models", "branchy", "--configs", "eager"]
    argv += ["--reps", "1", "--no-sweep", "--out", str(tmp_path), "--json"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    (suite,) = data["suites"]
    assert suite["suite"] == "anchors" and len(suite["rows"]) == 1
    assert "branchy" in suite["rows"][0] and "eager" in suite["rows"][0]
    assert "anchors [1/1]" in err  # plain progress: one line per row
    table = json.loads((tmp_path / "anchors.json").read_text())["table"]
    assert [(r["model"], r["config"]) for r in table] == [("branchy", "eager")]
    assert (tmp_path / "anchors.md").is_file()


def test_python_m_memcompile_bad_target_exits_1_without_traceback() -> None:
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "memcompile", "inspect", "cli_targets:nothing_here"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parent,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "memcompile: error: target 'cli_targets:nothing_here': 'cli_targets' has no function "
        "'nothing_here'"
    ]
    assert proc.stdout == ""


def test_tables_are_plain_when_piped_and_rich_honours_no_color(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memcompile.cli_output import render_table

    plain = render_table("t", ["name", "bytes"], [["a", "1"], ["bbb", "22"]], right=(1,))
    assert plain.splitlines() == ["t", "  name  bytes", "  a         1", "  bbb      22"]
    pytest.importorskip("rich")
    monkeypatch.setenv("NO_COLOR", "1")
    fancy = render_table("t", ["name", "bytes"], [["a", "1"]], rich=True)
    assert "name" in fancy and ("│" in fancy or "┃" in fancy)
    assert "\x1b[" not in fancy
