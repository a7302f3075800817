"""The suite's lanes: what a plain ``pytest`` leaves out, and what it must keep (a pytest plugin,
loaded by conftest.py).

A plain ``pytest`` (README's test command: no path, no ``-m``) is the default run: quick, and
covering every part of the product once. The other tests carry a lane's marker and run in their
lane, which CI runs after the default (``.ci/run``; CONTRIBUTING.md lists each lane's command and
its time). Naming a path or a ``-m`` expression selects as pytest always does::

    pytest -n auto              # the default run, on as many workers as there are cores (4 at most)
    pytest -m slow -n auto      # one lane
    pytest tests/warm           # everything in the folder, lanes included
    pytest -m "slow or not slow"    # everything

A lane's tests are marked where they are written (``pytestmark`` or ``@pytest.mark.<lane>``).
With ``-n`` the tests of one file stay on one worker (``--dist loadfile`` unless ``--dist`` is
given): a module's kernels, clusters, pools and executed notebooks are made once and shared.
"""

from __future__ import annotations

import os

import pytest

# Each lane: why a test belongs there (registered as a marker by pytest_configure below).
LANES = {
    "slow": "takes long (over ~4 s here) and is not its part's one test in the default run",
    "notebooks": "executes a notebook or a doc in a real kernel (01_quickstart stays in the default run)",
    "browser": "drives a real Chromium against a real Jupyter server",
    "slurm": "a real Slurm of two nodes on this machine (tests/slurm)",
    "ray": "a real Ray cluster of two nodes on this machine (tests/cluster)",
}

DEFAULT_EXPRESSION = "not (" + " or ".join(LANES) + ")"

# The default run's promise: every part of the product at least once. Each part names the test
# that covers it there (tests/test_lanes.py checks that the default run selects it).
DEFAULT_COVERS = {
    "a launch returns every rank's result": "tests/launch/test_results.py::test_every_rank_returns_its_result_in_rank_order[fork]",
    "a launch streams every rank's output": "tests/launch/test_output.py::test_python_and_c_output_of_both_ranks_arrives_whole_and_tagged",
    "a failure blames the rank that failed first": "tests/launch/test_failures.py::test_when_ranks_fail_alike_the_rank_shown_failing_first_is_the_one_blamed",
    "an interrupt stops every rank": "tests/launch/test_lifecycle.py::test_an_interrupt_of_the_whole_process_group_shows_stacks_then_stops_every_rank",
    "a timeout stops every rank": "tests/launch/test_failures.py::test_timeout_shows_where_every_rank_was_and_stops_them",
    "no rank is orphaned": "tests/launch/test_process_tree.py::test_helpers_in_their_own_session_end_with_a_rank_that_fails[killed]",
    "a launch's ranks begin with what they import": "tests/launch/test_preload.py::test_what_the_function_imports_is_imported_once_where_its_ranks_come_from_before_its_first_launch[None]",
    "the launch server spawns CUDA-clean ranks": "tests/launch/test_cuda_initialised_detection.py::test_cuda_initialised_in_the_launcher_spawns_says_so_in_one_line_and_refuses_fork",
    "a stall names its rank": "tests/launch/test_stacks_while_running.py::test_a_stalled_launch_shows_every_ranks_stack_by_itself_and_clears_it",
    "%debug opens a failed rank": "tests/warm/test_debugging.py::test_debug_after_a_launch_opens_the_failing_rank_with_its_locals_and_q_returns",
    "a SIGKILL is blamed only as the machine says": "tests/launch/test_failures.py::test_a_rank_killed_by_sigkill_is_not_blamed_on_the_out_of_memory_killer_the_machine_did_not_count",
    "the Accelerator trains with DDP": "tests/training/test_training.py::test_two_processes_equal_one_process_with_double_batch",
    "the Accelerator shards the data": "tests/training/test_data_distributed.py::test_shuffled_epochs_disjoint_complete_and_changing",
    "mixed precision": "tests/training/test_training.py::test_mixed_precision_trains_on_cpu[bf16]",
    "gradient accumulation": "tests/training/test_training.py::test_accumulation_equals_two_processes",
    "checkpoints": "tests/training/test_checkpoint.py::test_kill_and_resume_matches_uninterrupted_run[2-False]",
    "FSDP": "tests/training/test_fsdp.py::test_fsdp_training_equals_ddp_training",
    "DeepSpeed": "tests/training/test_deepspeed.py::test_every_zero_stage_trains_exactly_as_deepspeeds_own_api[1]",
    "tensor parallelism": "tests/training/test_tensor_parallel.py::test_fsdp2_between_two_tensor_parallel_groups_trains_as_ddp_over_the_groups",
    "fp8": "tests/training/test_fp8.py::test_the_layers_accelerate_converts_are_converted_and_it_trains[ddp]",
    "torch.compile (dynamo_backend)": "tests/training/test_compile.py::test_a_compile_that_fails_names_the_line_and_what_to_try_on_every_rank",
    "the step split names the straggler": "tests/training/test_step_split.py::test_a_rank_starved_of_data_is_named_and_the_others_wait_for_it_in_the_sync",
    "the live display": "tests/display/test_widget_display.py::test_a_real_launch_fills_every_part",
    "the display in a real kernel": "tests/display/test_notebook.py::test_the_dashboard_updated_while_the_launch_ran",
    "warm ranks keep their state": "tests/warm/test_warm_ranks.py::test_state_and_the_process_group_live_on_between_calls",
    "%%distributed in a real kernel": "tests/warm/test_magic.py::test_names_live_on_in_the_ranks_and_notebook_names_are_sent",
    "a detached launch is attached from another kernel": "tests/detached/test_detached_kernels.py::test_a_launch_outlives_its_kernel_and_another_kernel_attaches_and_collects_it",
    "the CLI": "tests/test_cli.py::test_one_epoch_trains_and_says_so",
    "nblaunch launch": "tests/test_cli_launch.py::test_every_rank_runs_the_script_as_main_with_its_own_arguments",
    "one notebook end to end": "tests/notebooks/test_notebooks.py::test_the_notebook_runs_top_to_bottom_with_no_error_but_its_tagged_ones[01_quickstart.ipynb]",
}

MOST_WORKERS = 4  # each test starts ranks, kernels or clusters of its own: more workers than this crowd the cores
DEFAULT_RUN = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    for lane, why in LANES.items():
        config.addinivalue_line("markers", f"{lane}: a lane: {why}")
    config.stash[DEFAULT_RUN] = not config.option.markexpr and config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if config.stash[DEFAULT_RUN]:
        config.option.markexpr = DEFAULT_EXPRESSION
    given = any(arg == "--dist" or arg.startswith("--dist=") for arg in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not given:
        config.option.dist = "loadfile"


def pytest_report_header(config: pytest.Config) -> list[str]:
    if config.stash[DEFAULT_RUN]:
        return [f"nblaunch: the default run; the lanes {', '.join(LANES)} are left out "
                "(pytest -m <lane> runs one; CONTRIBUTING.md lists them)"]
    return []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: a worker per core, MOST_WORKERS at most (PYTEST_XDIST_AUTO_NUM_WORKERS, where
    set, is xdist's to read)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    import psutil

    return max(1, min(MOST_WORKERS, psutil.cpu_count(logical=False) or 1))
