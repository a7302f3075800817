"""The notebooks in notebooks/, run top to bottom in a real Jupyter kernel (nbclient), on the CPU.

Each notebook is executed once per module (a fixture); the tests read what a user would see in
the cells: printed lines, the exception a cell ends with, the dashboard's static summary (HTML
that stays in the cell), the stored widget state. Cells tagged ``raises-exception`` end in an
exception on purpose; nbclient goes on past them.
"""

from __future__ import annotations

import ast
import difflib
import html
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from processes import gone

ROOT = Path(__file__).parents[2]
NOTEBOOKS = ROOT / "notebooks"
PACKAGE_DIR = str(ROOT / "nblaunch") + os.sep
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
COLAB_URL = "https://colab.research.google.com/github/nblaunch-dev/nblaunch/blob/main/notebooks/04_tpu.ipynb"


# --------------------------------------------------------------------------- helpers
def execute(name: str, cwd: Path, env: dict[str, str] | None = None, km=None, timeout: int = 240):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", store_widget_state=True, km=km,
        resources={"metadata": {"path": str(cwd)}},
    )
    started = time.monotonic()
    client.execute(**({"env": env} if env else {}))
    nb.metadata["elapsed_s"] = time.monotonic() - started
    return nb


def cell(nb, starting: str):
    """The one code cell whose source contains ``starting``."""
    (found,) = [c for c in nb.cells if c.cell_type == "code" and starting in c.source]
    return found


def stream(code_cell, name: str = "stdout") -> str:
    return "".join(o.text for o in code_cell.outputs if o.output_type == "stream" and o.name == name)


def error(code_cell):
    (found,) = [o for o in code_cell.outputs if o.output_type == "error"]
    return found


def no_errors_except_tagged(nb) -> None:
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        errors = [o for o in c.outputs if o.output_type == "error"]
        if "raises-exception" in c.metadata.get("tags", []):
            assert errors, f"a cell tagged raises-exception did not raise:\n{c.source}"
        else:
            assert not errors, f"{errors[0].ename}: {errors[0].evalue}\nin:\n{c.source}"


def summary(code_cell) -> str:
    """The dashboard's static summary left in the launching cell (HTML)."""
    (found,) = [
        o.data["text/html"] for o in code_cell.outputs
        if "nbl-summary" in o.get("data", {}).get("text/html", "")
    ]
    return found


def text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def rank_states(markup: str) -> dict[int, str]:
    return {int(r): s for r, s in re.findall(r'<tr class="nbl-rank" data-rank="(\d+)" data-state="(\w+)"', markup)}


def chart_points(markup: str, metric: str) -> dict[str, int]:
    chart = re.search(rf'<svg class="nbl-chart" data-metric="{re.escape(metric)}".*?</svg>', markup, re.S)
    found = re.findall(r'data-series="([^"]*)" data-points="(\d+)"', chart.group(0)) if chart else []
    return {label: int(n) for label, n in found}


def stacks(markup: str) -> dict[int, str]:
    """{rank: its stack} from a summary's "rank N: where it was stopped" sections."""
    parts = re.split(r"rank (\d+): where it was stopped", text(markup))
    return {int(rank): body for rank, body in zip(parts[1::2], parts[2::2])}


def one_view(code_cell) -> bool:
    """The finished launch left one view: its summary, which took the live widget's place."""
    shown = [o for o in code_cell.outputs if o.output_type == "display_data"]
    return len(shown) == 1 and "nbl-summary" in shown[0].get("data", {}).get("text/html", "") and not any(
        WIDGET_VIEW in o.get("data", {}) for o in code_cell.outputs)


def cpu_computes_bf16() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


# --------------------------------------------------------------------------- every notebook
# Each notebook runs once per session, top to bottom in a real kernel; its tests read the result.
# The seconds each may take on 2 cores (None: no limit asserted).
BUDGETS = {"01_quickstart.ipynb": 120, "02_from_accelerate.ipynb": None, "03_when_things_go_wrong.ipynb": 150,
           "05_interactive.ipynb": None, "06_fsdp.ipynb": None, "08_lightning.ipynb": 60,
           "09_bigger_models.ipynb": None}


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    done: dict[str, nbformat.NotebookNode] = {}

    def run(name: str) -> nbformat.NotebookNode:
        if name == "08_lightning.ipynb" and importlib.util.find_spec("lightning") is None:
            # Not imported here: importing Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK in os.environ.
            pytest.skip("the Lightning notebook needs lightning (pip install -e '.[test]')")
        if name == "09_bigger_models.ipynb" and importlib.util.find_spec("deepspeed") is None:
            pytest.skip("the bigger-models notebook needs DeepSpeed (pip install -e '.[test]')")
        if name not in done:
            done[name] = execute(name, tmp_path_factory.mktemp(name.split(".")[0]))
        return done[name]

    return run


# The quickstart runs in the default run; the others in the notebooks lane (tests/lanes.py).
@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == "01_quickstart.ipynb" else pytest.mark.notebooks)
                                  for name in BUDGETS])
def test_the_notebook_runs_top_to_bottom_with_no_error_but_its_tagged_ones(executed, name):
    notebook = executed(name)
    no_errors_except_tagged(notebook)
    if BUDGETS[name] is not None:
        assert notebook.metadata["elapsed_s"] < BUDGETS[name]


# --------------------------------------------------------------------------- 01 quickstart
@pytest.fixture(scope="module")
def quickstart(executed):
    return executed("01_quickstart.ipynb")


def test_quickstart_trains_the_cnn_to_a_high_accuracy_on_two_cpu_ranks(quickstart):
    printed = stream(cell(quickstart, 'accuracy = results[0]["test_accuracy"]'))
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", printed).group(1))
    assert accuracy > 90, printed
    assert "on 2 ranks (cpu, cpu)" in printed


def test_quickstart_runs_two_cpu_ranks_in_bf16_where_the_cpu_computes_it(quickstart):
    expected = "bf16" if cpu_computes_bf16() else "no"  # what "auto" is on this CPU
    assert stream(cell(quickstart, 'mixed_precision = "auto"')) == "2 processes, mixed precision: auto\n"
    # the ranks really trained in it: each one's Accelerator reports it
    assert f"trained in {expected!r}" in stream(cell(quickstart, 'accuracy = results[0]["test_accuracy"]'))


def test_the_finished_launch_cell_keeps_one_view_with_every_ranks_loss(quickstart):
    launch = cell(quickstart, "results = notebook_launcher(train")
    assert one_view(launch)
    done = summary(launch)
    assert rank_states(done) == {0: "done", 1: "done"}
    points = chart_points(done, "loss")
    # 1437 images, batches of 32, 2 ranks: 23 batches a rank and epoch, 5 epochs
    assert points == {"rank 0": 115, "rank 1": 115}
    assert "epoch 5: test accuracy" in text(done)  # rank 0's own line, in its log tail


def test_quickstart_plots_the_loss_curve(quickstart):
    plot = cell(quickstart, "import matplotlib.pyplot as plt")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)


# --------------------------------------------------------------------------- 02 from Accelerate
@pytest.fixture(scope="module")
def from_accelerate(executed):
    return executed("02_from_accelerate.ipynb")


def test_the_accelerate_cell_moves_over_by_changing_its_import_only():
    nb = nbformat.read(NOTEBOOKS / "02_from_accelerate.ipynb", as_version=4)
    (original_md,) = [c for c in nb.cells if c.cell_type == "markdown" and "```python\nfrom accelerate import" in c.source]
    original = re.search(r"```python\n(.*?)\n```", original_md.source, re.S).group(1)
    moved = cell(nb, "from nblaunch import Accelerator, notebook_launcher").source
    changed = [line for line in difflib.ndiff(original.splitlines(), moved.splitlines()) if line[:1] in "+-"]
    assert changed == [
        "- from accelerate import Accelerator, notebook_launcher",
        "+ from nblaunch import Accelerator, notebook_launcher",
    ]
    assert "notebook_launcher(training_function, args, num_processes=num_processes)" in original  # the original call


@pytest.mark.notebooks
def test_the_moved_cell_trains_on_two_ranks_that_agree(from_accelerate):
    launch = cell(from_accelerate, "from nblaunch import Accelerator, notebook_launcher")
    assert one_view(launch)
    assert rank_states(summary(launch)) == {0: "done", 1: "done"}
    printed = stream(cell(from_accelerate, 'print("accuracy per rank:"'))
    accuracies = json.loads(re.search(r"accuracy per rank: (\[.*\])", printed).group(1))
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] > 0.85
    assert "saved model loads: SmallCNN" in printed


# --------------------------------------------------------------------------- 03 when things go wrong
@pytest.fixture(scope="module")
def went_wrong(executed):
    return executed("03_when_things_go_wrong.ipynb")


@pytest.mark.notebooks
def test_a_rank_that_raises_is_named_with_its_exception_and_traceback(went_wrong):
    failing = cell(went_wrong, "def train_with_a_bad_batch")
    shown = error(failing)
    assert shown.ename == "RankFailedError"
    assert re.match(r"rank 1 failed: ValueError: bad batch at step 3 on rank 1 \(Cell In\[\d+\], line \d+, "
                    r"in train_with_a_bad_batch\)", shown.evalue), shown.evalue
    # The worker's traceback, once, chained to the error; no frame of nblaunch's own code.
    shown_text = "\n".join(shown.traceback)
    assert shown_text.count('raise ValueError(f"bad batch at step {step} on rank {rank}")') == 1
    assert PACKAGE_DIR not in shown_text
    # Rank 0 is never blamed; if its "connection closed" arrived before it was stopped, it is listed
    # after rank 1 as a consequence.
    for line in shown.evalue.splitlines():
        if line.startswith("rank 0"):
            assert line.startswith("rank 0 also failed (likely a consequence of rank 1)"), line
    assert 'data-state="failed"' in summary(failing)
    caught = stream(cell(went_wrong, "except RankFailedError as error:"))
    assert re.fullmatch(
        r"rank 1 failed first: ValueError\('bad batch at step 3 on rank 1'\)\n"
        r"ranks that failed, in order: \[1(, 0)?\]\n", caught), caught


@pytest.mark.notebooks
def test_a_hang_in_a_collective_ends_at_the_timeout_with_every_ranks_stack(went_wrong):
    hanging = cell(went_wrong, "notebook_launcher(train_with_a_hang")
    shown = error(hanging)
    assert shown.ename == "LaunchTimeoutError"
    assert shown.evalue.startswith("the launch did not finish within timeout=8 s; every rank was stopped.")
    where = stacks(summary(hanging))
    assert "dist.all_reduce(torch.ones(1))" in where[0]  # rank 0 waits in the collective
    assert "threading.Event().wait()" in where[1]  # rank 1 is stuck elsewhere
    assert "rank 0:" in shown.evalue and "dist.all_reduce(torch.ones(1))" in shown.evalue  # also in the exception


@pytest.mark.notebooks
def test_an_interrupt_shows_every_ranks_stack_then_raises_keyboard_interrupt(went_wrong):
    interrupted = cell(went_wrong, "notebook_launcher(blocked, num_processes=num_processes, cpu=cpu)")
    assert error(interrupted).ename == "LaunchInterrupted"  # a KeyboardInterrupt
    assert PACKAGE_DIR not in "\n".join(error(interrupted).traceback)  # no frame of nblaunch's code
    done = summary(interrupted)
    assert 'data-state="stopped"' in done and "interrupted after" in text(done)
    where = stacks(done)
    assert "dist.recv(torch.zeros(1), src=1)" in where[0]
    assert "threading.Event().wait()" in where[1]
    assert rank_states(done) == {0: "stopped", 1: "stopped"}


@pytest.mark.notebooks
def test_the_next_launch_in_the_same_kernel_just_works(went_wrong):
    relaunch = cell(went_wrong, "def all_reduce_check")
    assert relaunch.outputs[-1]["data"]["text/plain"] == "[3.0, 3.0]"
    assert rank_states(summary(relaunch)) == {0: "done", 1: "done"}


@pytest.mark.notebooks
def test_what_an_earlier_kernels_ranks_left_is_stopped_by_the_next_launch(went_wrong):
    started = cell(went_wrong, "start_new_kernel")
    earlier = stream(started)
    assert stream(started, "stderr") == ""  # no log of the helper kernel's (jupyter_client's TCP warning)
    servers = sorted(int(pid) for pid in re.findall(r"started a server, pid (\d+)", earlier))
    assert len(servers) == 2 and earlier.endswith("the earlier kernel is gone\n")
    (cleanup,) = [c for c in went_wrong.cells if c.source == "notebook_launcher(all_reduce_check, num_processes=num_processes, cpu=cpu)"]
    message = stream(cleanup, "stderr")
    # The earlier kernel's ranks die with it, but asynchronously: on a busy machine the sweep may
    # find one still exiting and stop it too. The servers must be among what it stopped.
    stopped = re.search(r"nblaunch: stopped \d+ stale process\(es\) \(pids ([\d, ]+)\) left by an earlier launch", message)
    assert stopped, message
    assert set(servers) <= {int(pid) for pid in stopped.group(1).split(", ")}
    assert gone(servers, within=5)
    assert cleanup.outputs[-1]["data"]["text/plain"] == "[3.0, 3.0]"


@pytest.mark.notebooks
def test_a_starved_rank_is_named_and_dataloader_workers_fix_it(went_wrong):
    starved = cell(went_wrong, "starved = nblaunch.last_steps()")
    assert 'data-straggler="1" data-cause="data"' in summary(starved)
    assert "rank 1 holds the others up: it waits" in text(summary(starved))
    assert re.fullmatch(r"straggler: rank 1, cause: data; rank 1 waits \d+ ms a step for data\n", stream(starved))
    fed = cell(went_wrong, "fed = nblaunch.last_steps()")
    said = re.fullmatch(r"straggler: None; (\d+) -> (\d+) samples/s\n", stream(fed))
    assert said, stream(fed) + text(summary(fed))  # what the cell printed, and its summary's verdict
    before, after = map(int, said.groups())
    assert after > 2 * before, stream(fed)


@pytest.mark.notebooks
def test_a_communication_bound_run_is_flagged_and_accumulation_makes_it_faster(went_wrong):
    one_sample = cell(went_wrong, "one_sample = nblaunch.last_steps()")
    # Whether two ranks are slower than one alone depends on the machine's load (the saved notebook
    # says True); that communication is the cause, and that accumulation helps, does not.
    assert 'data-cause="communication"' in summary(one_sample)
    assert "gradient accumulation" in text(summary(one_sample))  # the advice
    assert re.fullmatch(r"cause: communication; communication is \d+% of a step; slower than one rank: (True|False)\n",
                        stream(one_sample)), stream(one_sample)
    accumulated = cell(went_wrong, "accumulated = nblaunch.last_steps()")
    found = re.fullmatch(r"(\d+) -> (\d+) samples/s; slower than one rank: (True|False)\n", stream(accumulated))
    assert found and int(found[2]) > 1.5 * int(found[1]), stream(accumulated)


def test_the_earlier_kernel_cell_prints_no_log_of_its_helper_kernel():
    # In JupyterLab a kernel's own stderr lands in the cell; nbclient does not show it, so the
    # cell runs here as a script and its stderr is read.
    import json
    import signal
    import subprocess
    import sys

    notebook = json.loads((NOTEBOOKS / "03_when_things_go_wrong.ipynb").read_text())
    (source,) = ["".join(c["source"]) for c in notebook["cells"] if "start_new_kernel(" in "".join(c["source"])]
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=180)
    servers = [int(pid) for pid in re.findall(r"started a server, pid (\d+)", done.stdout)]
    for pid in servers:  # what the notebook's next launch would sweep away
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert done.returncode == 0, done.stderr
    assert len(servers) == 2
    assert "without encryption" not in done.stderr and "WARNING" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- 04 TPU
TPU = NOTEBOOKS / "04_tpu.ipynb"


def test_the_tpu_notebook_is_valid_and_its_code_compiles():
    from IPython.core.inputtransformer2 import TransformerManager

    nb = nbformat.read(TPU, as_version=4)
    nbformat.validate(nb)
    transform = TransformerManager().transform_cell  # %pip lines become Python, as in a kernel
    for c in nb.cells:
        if c.cell_type == "code":
            compile(transform(c.source), "<04_tpu cell>", "exec")
    assert COLAB_URL in nb.cells[0].source
    assert nb.metadata.get("accelerator") == "TPU"  # Colab offers the TPU runtime when opening it


def test_the_tpu_notebook_uses_only_what_the_quickstart_uses():
    tpu = nbformat.read(TPU, as_version=4)
    quick = nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4)
    quick_code = {c.source for c in quick.cells if c.cell_type == "code"}
    launch = cell(tpu, "results = notebook_launcher(")
    setup = cell(tpu, "importlib.util.find_spec")
    for c in tpu.cells:
        if c.cell_type == "code" and c not in (launch, setup):
            assert c.source in quick_code, f"not a quickstart cell:\n{c.source}"
    # The launch: every TPU device (no num_processes), bf16; the arguments the quickstart passes.
    (call,) = [n for n in ast.walk(ast.parse(launch.source)) if isinstance(n, ast.Call)
               and getattr(n.func, "id", "") == "notebook_launcher"]
    assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == {"args": (5, 2e-3), "mixed_precision": "bf16"}
    assert "notebook_launcher(train, args=(5, 2e-3), num_processes=num_processes," in cell(quick, "results = notebook_launcher(").source


def test_the_tpu_notebook_runs_through_xmp_spawn_on_xla_cpu_devices(tmp_path):
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("needs torch_xla, which the main environment lacks: the XLA lane (.venv-xla with torch_xla, "
                    "PJRT_DEVICE=CPU) executes 04_tpu.ipynb")
    # The notebook is run unchanged. torch_xla gets CPU devices (PJRT_DEVICE=CPU; one, since XLA's CPU
    # client aborts collectives across two), and TPU_ACCELERATOR_TYPE, a variable TPU VMs set, makes
    # this a "TPU host" for nblaunch, so notebook_launcher(train) picks xmp.spawn as it does on a TPU.
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TPU_ACCELERATOR_TYPE="cpu-simulated")
    nb = execute("04_tpu.ipynb", tmp_path, env=env, timeout=300)
    no_errors_except_tagged(nb)
    launch = cell(nb, "results = notebook_launcher(")
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    (header,) = [text(m["state"]["value"]) for m in state.values() if 'class="nbl-header"' in str(m["state"].get("value"))]
    assert "start: xla" in header and "xmp.spawn" in header and "1 XLA device (CPU)" in header
    assert rank_states(summary(launch)) == {0: "done"}
    printed = stream(cell(nb, 'accuracy = results[0]["test_accuracy"]'))
    assert float(re.search(r"test accuracy ([\d.]+)%", printed).group(1)) > 90, printed
    assert "trained in 'bf16' on 1 ranks (xla:0)" in printed  # on the XLA device, in bf16


# --------------------------------------------------------------------------- Binder
@pytest.mark.slow
def test_binder_requirements_build_an_environment_that_runs_the_quickstart(tmp_path):
    """What mybinder.org does, with pip only: a fresh environment from binder/requirements.txt
    (run from the repository root, as repo2docker does), then the quickstart in its kernel.

    binder/requirements.txt pins torch==2.13.0 next to PyTorch's CPU index, so pip takes the
    "2.13.0+cpu" build over PyPI's CUDA one. Here that index cannot be reached (pip warns and goes
    on) and the pin is served by the local 2.13.0+cpu wheel (pip's find-links); on mybinder.org it
    comes from the CPU index. Either way, never PyPI's CUDA build: the test checks that.
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # --retries 0: where PyPI's mirror is reachable but PyTorch's CPU index is not (as in CI here),
    # pip would retry that index for every package, for minutes; one try each is enough.
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--retries", "0"]
    install = subprocess.run(pip + ["-r", "binder/requirements.txt"], cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert install.returncode == 0, install.stdout + install.stderr
    # repo2docker's base environment brings the Jupyter server and ipykernel; the binder files do not.
    subprocess.run(pip + ["ipykernel"], check=True, capture_output=True, timeout=180)

    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    versions = {p["name"].lower(): p["version"] for p in json.loads(installed.stdout)}
    assert versions["torch"] == "2.13.0+cpu"
    assert not [name for name in versions if name.startswith("nvidia-")], "a CUDA torch came in"
    assert {"nblaunch", "scikit-learn", "matplotlib", "ipywidgets"} <= set(versions)

    kernels = tmp_path / "kernels" / "binder"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "binder", "language": "python",
    }))
    km = KernelManager(kernel_name="binder", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels.parent)]))
    nb = execute("01_quickstart.ipynb", tmp_path, km=km)
    no_errors_except_tagged(nb)
    printed = stream(cell(nb, 'accuracy = results[0]["test_accuracy"]'))
    assert float(re.search(r"test accuracy ([\d.]+)%", printed).group(1)) > 90, printed
    assert rank_states(summary(cell(nb, "results = notebook_launcher(train"))) == {0: "done", 1: "done"}


# --------------------------------------------------------------------------- 05_interactive
@pytest.fixture(scope="module")
def interactive(executed):
    return executed("05_interactive.ipynb")


@pytest.mark.notebooks
def test_the_interactive_notebook_trains_step_by_step_on_warm_ranks(interactive):
    result = stream(cell(interactive, "accuracies = _"))
    accuracy = float(result.split("test accuracy ")[1].split("%")[0]) / 100
    assert accuracy > 0.9, result
    assert "<WarmRanks: 2 processes, up>" in str(cell(interactive, "%distributed status").outputs)
    # the second training cell went on from the first: epochs 3 and 4 on the same model
    later = str(cell(interactive, 'group["lr"] = 5e-4').outputs)
    assert "epoch 3: loss" in later and "epoch 4: loss" in later


@pytest.mark.notebooks
def test_the_interactive_notebook_keeps_the_state_through_an_error_and_a_released_collective(interactive):
    typo = error(cell(interactive, "a name no cell defined"))
    assert typo.ename == "RankFailedError" and "name 'learning_rate' is not defined" in typo.evalue
    before = result_value(cell(interactive, 'group["lr"] = 5e-4'))  # evaluate() after the last epoch
    after = result_value(cell(interactive, "the same model as before the error"))
    assert after == before, (after, before)
    gave_up = error(cell(interactive, "rank 1 gives up before the all-reduce"))
    assert gave_up.ename == "RankFailedError" and gave_up.evalue.startswith("rank 1 failed: ValueError: rank 1 gives up")
    mended = result_value(cell(interactive, "the group works again"))
    assert mended == [(2.0, after[0]), (2.0, after[1])], mended
    assert result_value(cell(interactive, "dist.barrier()")) == ["both ranks passed the barrier"] * 2
    (batches, index), = result_value(cell(interactive, "%%distributed --rank 1"))  # rank 1's alone
    assert index == 1 and batches > 0


def result_value(notebook_cell):
    import ast

    value = next(o.data["text/plain"] for o in notebook_cell.outputs if o.output_type == "execute_result")
    return ast.literal_eval(value)


# --------------------------------------------------------------------------- 06 FSDP


@pytest.fixture(scope="module")
def fsdp(executed):
    return executed("06_fsdp.ipynb")


@pytest.mark.notebooks
def test_the_fsdp_notebook_shards_trains_and_resumes(fsdp):
    held = re.findall(r"rank (\d) holds [\d.]+ MiB: (\d+)% of parameters", stream(cell(fsdp, "whole = 3 *")))
    assert [rank for rank, _ in held] == ["0", "1"]
    assert all(45 <= int(share) <= 55 for _, share in held), held
    predicted = stream(cell(fsdp, "model.load_state_dict"))
    assert int(predicted.split("predicts ")[1].split("%")[0]) >= 90, predicted
    before, after = map(float, re.findall(r"[\d.]+", stream(cell(fsdp, "more = notebook_launcher"))))
    assert after < before


# --------------------------------------------------------------------------- 09 bigger models


@pytest.mark.notebooks
def test_the_four_stacks_train_the_same_model_alike_and_three_hold_about_half(executed):
    notebook = executed("09_bigger_models.ipynb")
    shares = dict(re.findall(r"^(\S+) +DistributedType\.\w+ +rank 0 [\d.]+ MiB \((\d+)%\)",
                             stream(cell(notebook, 'whole = results["DDP"]')), re.M))
    assert shares.keys() == {"DDP", "FSDP", "ZeRO-3", "TP"} and shares["DDP"] == "100"
    assert all(40 <= int(shares[stack]) <= 60 for stack in ("FSDP", "ZeRO-3")), shares
    assert 40 <= int(shares["TP"]) <= 75, shares  # the norms and anything outside the plan stay whole
    agreed = re.findall(r"^(\S+) +loss ([\d.]+) -> ([\d.]+), largest difference from DDP ([\d.e+-]+)",
                        stream(cell(notebook, "reference = results")), re.M)
    assert [stack for stack, *_ in agreed] == ["DDP", "FSDP", "ZeRO-3", "TP"]
    for stack, first, last, difference in agreed:
        assert float(last) < 0.8 * float(first) and float(difference) < 1e-3, (stack, first, last, difference)


# --------------------------------------------------------------------------- 07 Lightning
@pytest.fixture(scope="module")
def with_lightning(executed):
    return executed("08_lightning.ipynb")


@pytest.mark.notebooks
def test_a_trainer_made_in_a_kernels_launch_trains_ddp_and_the_cell_shows_its_bar_and_self_log(with_lightning):
    launch = cell(with_lightning, "results = notebook_launcher(train_with_trainer")
    assert one_view(launch)
    done = summary(launch)
    assert rank_states(done) == {0: "done", 1: "done"}
    # 1437 images in batches of 32 on 2 ranks: 23 steps a rank and epoch, 5 epochs, a point every 5 steps
    assert chart_points(done, "train_loss") == {"rank 0": 23, "rank 1": 23}
    assert chart_points(done, "val_accuracy") == {"rank 0": 5, "rank 1": 5}
    # Lightning's bar (Rich's where rich is installed, else TQDM's), on rank 0 only, its last epoch full
    assert done.count('class="nbl-bar"') == 1
    assert re.search(r"Epoch 4\b[^·]*· 23/23 \(100%\)", text(done)), text(done)
    printed = stream(cell(with_lightning, "for result in results:"))
    accuracies = [float(a) for a in re.findall(r"rank \d of 2: validation accuracy ([\d.]+)%", printed)]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] > 90, printed
    assert "replicas equal: True" in printed


@pytest.mark.notebooks
def test_fabric_in_a_kernels_launch_shards_the_data_and_its_logs_and_tqdm_bars_reach_the_cell(with_lightning):
    launch = cell(with_lightning, "fabric_results = notebook_launcher(train_with_fabric")
    assert one_view(launch)
    done = summary(launch)
    assert rank_states(done) == {0: "done", 1: "done"}
    assert chart_points(done, "train_loss") == {"rank 0": 23, "rank 1": 23}
    assert chart_points(done, "val_accuracy") == {"rank 0": 5, "rank 1": 5}
    assert len(re.findall(r"epoch 4\s*· 23/23 \(100%\)", text(done))) == 2  # tqdm's bar, on each rank
    printed = stream(cell(with_lightning, 'shares = [result["seen"]'))
    assert "images per rank in the first epoch: [719, 719]" in printed
    assert "images both ranks trained on: 1 " in printed  # 1437 is odd: one image is repeated
    assert "images covered: 1437 of 1437" in printed
    assert "replicas equal: True" in printed
