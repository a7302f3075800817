"""Regenerate, from real runs, what README and the notebooks show: ``python docs/refresh.py``.

1. README's two pictures, taken by the real-browser tests (JupyterLab in headless Chromium, see
   tests/display): ``docs/images/dashboard.png`` (a launch running) and ``failure.png`` (a
   failed launch, as the saved notebook keeps it), ``step_split.png`` (each rank's step split live, the
   starved rank named) and ``step_split_summary.png`` (the same launch's end).
2. The notebooks of ``SAVED_WITH_OUTPUTS`` (the quickstart, the move from Accelerate, what goes
   wrong) run top to bottom in a real kernel and saved with their outputs, so a visitor on GitHub
   sees the summaries.

Needs the test environment (README's test command) and Chromium (``.ci/browser-setup.sh``).
``--notebooks`` or ``--images`` does one half. tests/notebooks/test_saved_outputs.py checks that
the saved notebooks still match their sources.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
IMAGES = {"widget_demo_dashboard.png": "dashboard.png", "scenario_failed_cell.png": "failure.png",
          "scenario_split_running_cell.png": "step_split.png", "scenario_split_finished_cell.png": "step_split_summary.png"}
SAVED_WITH_OUTPUTS = ["01_quickstart.ipynb", "02_from_accelerate.ipynb", "03_when_things_go_wrong.ipynb"]


def refresh_images() -> None:
    tests = ["tests/display/test_browser.py::test_the_dashboard_renders_and_follows_the_launch_in_jupyterlab",
             "tests/display/test_browser_scenarios.py::test_a_failed_launch_shows_the_error_once_without_launcher_paths",
             "tests/display/test_browser_scenarios.py::test_the_step_split_shows_live_in_each_rank_row_and_names_the_starved_rank"]
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, check=True,
                   env=dict(os.environ, CI="1"))
    for taken, name in IMAGES.items():
        shutil.copyfile(ARTIFACTS / taken, ROOT / "docs" / "images" / name)
        print(f"docs/images/{name} <- artifacts/{taken}")


def without_local_paths(text: str) -> str:
    """This machine's paths would mean nothing to a reader: the checkout and the interpreter's
    prefix become short placeholders."""
    paths = sysconfig.get_paths()
    places = ((paths["purelib"], "<site-packages>"), (paths["stdlib"], "<stdlib>"), (sys.prefix, "<python>"),
              (str(ROOT), "<nblaunch>"), (str(Path.home()), "~"))
    for path, placeholder in places:  # the innermost first: site-packages may lie inside the checkout
        text = text.replace(path, placeholder)
    return re.sub(r"/tmp/[\w.-]+/", "/tmp/…/", text)


def refresh_notebook(name: str) -> None:
    path = ROOT / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as work:
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": work}}).execute()
    nb.metadata.pop("widgets", None)  # live widget state: the saved summary is what a reader sees
    text = without_local_paths(nbformat.writes(nb))
    path.write_text(text if text.endswith("\n") else text + "\n")
    print(f"notebooks/{name}: saved with its outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", action="store_true", help="only the pictures")
    parser.add_argument("--notebooks", action="store_true", help="only the notebooks")
    options = parser.parse_args()
    if not options.notebooks:
        refresh_images()
    if not options.images:
        for name in SAVED_WITH_OUTPUTS:
            refresh_notebook(name)


if __name__ == "__main__":
    main()
