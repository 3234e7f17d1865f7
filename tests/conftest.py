"""Shared fixtures. Tests run with OMP_NUM_THREADS=1 (see README): compiled code on these shared
2-core machines is otherwise ~100x slower."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


#: The longest single tests (each over ~15 s alone on the 2-core VM; `pytest --durations`):
#: deselected by default so that the README's test command stays within CI's 20 minutes; run
#: them with `pytest -m long` (pyproject.toml). Each has faster siblings in the default run.
LONG = frozenset(
    {
        "test_iteration.py::test_a_thousand_iterations_hold_host_memory_and_the_device_peak_flat",
        "test_inplace.py::test_built_in_place_lowers_the_zoo_grus_smallest_plan",
        "test_planner.py::test_the_smallest_budget_found_on_the_disk_tier_fits_when_it_is_the_budget",
        "test_planner.py::test_min_feasible_is_the_same_below_the_resident_set_as_with_room",
        "test_zoo_memcompile.py::test_bit_identical_to_eager_under_a_budget[gru-0.4]",
        "test_rematerialize.py::test_a_budget_only_rematerialization_meets_fits_exactly_and_bit_identically[gpt]",
        "test_compile_time_bench.py::test_a_tiny_run_times_the_first_step_and_each_plan",
        "test_compile_time_bench.py::test_warm_runs_no_budget_cold_and_warm_and_the_warm_run_does_not_search",
        "test_compile_time_bench.py::test_a_sweep_times_each_budget_in_a_fresh_process_and_holds_them_to_the_targets",
        "test_replan.py::test_a_fragment_that_does_not_fit_runs_its_smallest_plan_without_the_pilots_reserve",
        "test_dropout.py::test_replayed_masks_lower_the_bench_gpts_smallest_budget",
        "test_linearce.py::test_zoo_gpt_trains_bit_identically_at_a_floor_only_the_blocks_reach",
        "test_tiling.py::test_a_swapping_plan_reloads_by_rows_below_the_recomputing_floor[disk]",
        "test_cli.py::test_bench_dynamic_runs_the_pilot_accuracy_harness_with_progress",
        "test_cli.py::test_bench_anchors_runs_a_tiny_anchor_table",
        "test_schedule.py::test_tiny_gpt_smallest_host_tier_plan",
        "test_tiling.py::test_a_swapping_plan_over_its_target_falls_back_to_recomputing",
        "test_rematerialize.py::test_a_budget_only_rematerialization_meets_fits_exactly_and_bit_identically[resnet]",
        "test_zoo_memcompile.py::test_bit_identical_to_eager_under_a_budget[gru-0.7]",
        "test_backend.py::test_fragment_ids_are_stable_across_processes_and_compile_order",
        "test_liveness.py::test_every_replay_of_a_search_on_a_zoo_model_answers_as_the_loop[gru]",
        "test_params.py::test_offload_params_false_never_moves_them_and_the_error_says_so",
        "test_rematerialize.py::test_the_compilers_trial_profiles_of_a_backward_are_the_whole_fragments",
        "test_zoo_memcompile.py::test_bit_identical_to_eager_under_a_budget[treelstm-0.4]",
        "test_tiling.py::test_a_swapping_plan_reloads_by_rows_below_the_recomputing_floor[host]",
        "test_tiling.py::test_hand_written_attention_trains_bit_identically_with_its_value_gradient_by_blocks",
        "test_tiling.py::test_gpts_mlp_backward_is_tiled_below_its_floor_and_trains_bit_identically",
        "test_planner_random.py::test_a_random_network_whose_split_reads_a_row_tiled_buffer_is_bit_identical",
        "test_params.py::test_offloading_parameters_never_raises_the_measured_peak[gru]",
        "test_planner.py::test_a_partition_builds_one_joint_model_per_graph_it_plans",
        "test_params.py::test_infeasible_even_on_the_host_leaves_parameters_untouched",
        "test_planner.py::test_best_effort_warns_and_runs_the_smallest_plan",
        "test_step_sizes.py::test_parameters_moved_to_the_host_are_not_resident_in_records_made_before",
        "test_zoo_memcompile.py::test_bit_identical_to_eager_under_a_budget[treelstm-0.7]",
        "test_inner_peak.py::test_inductor_plans_hold_the_budget_and_predict_the_measured_peak[0.6]",
        # Benchmark harnesses' runs, 20-42 s each on 2026-12-01's VM (the suite at 17.5 min
        # there, against 7.7 min the day before): CI's 20 minutes kept with a margin.
        "test_compile_time_bench.py::test_a_run_with_the_plan_cache_off_searches_whatever_the_cache_directory_holds",
        "test_compile_time_bench.py::test_an_unrolled_lstm_is_a_workload",
        "test_copy_thread_bench.py::test_the_moe_rows_train_alike_with_and_without_the_thread",
        "test_block_copy_bench.py::test_the_training_runs_give_the_same_losses",
        "test_dynamic_prefetch_bench.py::test_a_tiny_run_of_two_predictors_writes_its_table",
        # (Inductor's compiles, 26 s; the error's other wording stays in CI:
        # test_inductors_error_names_the_eager_kernels_plans_where_no_plan_of_its_graphs_fits)
        "test_inner_peak.py::test_where_eager_kernels_do_not_fit_either_the_error_says_inductor_was_tried",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("/")[-1] in LONG:
            item.add_marker(pytest.mark.long)


#: Test modules that keep the CPU's sampled iteration check (step/checks.py) on. Elsewhere it
#: is off: it profiles one iteration per compile, ~0.5-1.5 s a budgeted training test, which
#: over the suite would cost CI a minute; these modules test it (the benchmark's children, in
#: their own processes, keep it too).
SAMPLED_MODULES = frozenset({"test_iteration"})


@pytest.fixture(autouse=True)
def _sampled_iterations(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.module.__name__ not in SAMPLED_MODULES:
        from memcompile.step import checks

        monkeypatch.setattr(checks, "SAMPLED_ITERATIONS", 0)


#: Test modules that keep the fast "no" on (pipeline/fragment.py: a budget below every plan's
#: lower bound raises at once, with that bound). Elsewhere it is off: the suite finds the
#: searched floor by compiling at a 1-byte budget and reading the error's ``min_feasible``,
#: which the bound would replace (and assertions like "the floor is under 0.4 MiB" would then
#: hold vacuously).
FAST_NO_MODULES = frozenset({"test_fast_no", "test_cli", "test_fallbacks"})


@pytest.fixture(autouse=True)
def _fast_no(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.module.__name__ not in FAST_NO_MODULES:
        from memcompile.pipeline import features

        monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(fast_no=False))


#: Test modules that keep the plan cache on (pipeline/plan_cache.py). Elsewhere it is off,
#: here and in the processes tests start: each test plans as a first run does, whatever the
#: tests before it planned.
PLAN_CACHE_MODULES = frozenset({"test_plan_cache"})


@pytest.fixture(autouse=True)
def _plan_cache(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from memcompile.pipeline import features

    monkeypatch.setenv("MEMCOMPILE_CACHE_DIR", str(tmp_path / "memcompile_plans"))
    on = request.module.__name__ in PLAN_CACHE_MODULES
    monkeypatch.setenv("MEMCOMPILE_PLAN_CACHE", "1" if on else "0")
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(plan_cache=on))


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """A clean Dynamo cache and counters before and after the test."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
