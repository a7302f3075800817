"""Every notebook opens with a setup cell that works on Colab, Kaggle, Binder and a laptop: it
installs nblaunch where it is missing and sizes the launch to the machine.

The cell's own code runs here (IPython's transformation of ``%pip`` included); only the GPU
count and, for the install case, the "is nblaunch installed" probe are stood in for.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

import nblaunch

NOTEBOOKS = sorted(p for p in (Path(__file__).parents[2] / "notebooks").glob("*.ipynb") if p.stem != "04_tpu")
INSTALL = 'nblaunch[examples] @ git+https://github.com/nblaunch-dev/nblaunch'


def code_cells(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


class Shell:
    """What ``get_ipython()`` gives the cell: it records ``%pip`` instead of installing."""

    def __init__(self):
        self.magics = []

    def run_line_magic(self, name, line, _stack_depth=1):
        self.magics.append((name, line))


def run_setup(path: Path, monkeypatch, gpus: int, installed: bool = True) -> tuple[dict, Shell]:
    monkeypatch.setattr(nblaunch, "gpu_count", lambda: gpus)
    if not installed:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nblaunch" else real(name, *a))
    shell = Shell()
    namespace = {"get_ipython": lambda: shell}
    exec(TransformerManager().transform_cell(code_cells(path)[0]), namespace)
    return namespace, shell


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_setup_cell_chooses_two_cpu_ranks_without_a_gpu_and_every_gpu_with_several(path, monkeypatch):
    namespace, shell = run_setup(path, monkeypatch, gpus=0)
    # nblaunch is installed here: nothing installed but what a notebook needs and this machine lacks
    # (08_lightning installs Lightning where it is missing, as in the Colab lane).
    extra = [line.split()[-1] for name, line in shell.magics if name == "pip"]
    assert namespace["num_processes"] == 2 and [name for name, _ in shell.magics] == ["pip"] * len(extra)
    assert all("nblaunch" not in package and importlib.util.find_spec(package) is None for package in extra), extra
    namespace, _ = run_setup(path, monkeypatch, gpus=4)
    assert namespace["num_processes"] == 4 and not namespace.get("cpu", False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_on_one_gpu_the_setup_cell_uses_it_or_cpu_ranks_where_two_are_needed(path, monkeypatch):
    namespace, _ = run_setup(path, monkeypatch, gpus=1)
    needs_two = "cpu" in namespace
    assert (namespace["num_processes"], namespace.get("cpu", False)) == ((2, True) if needs_two else (1, False))
    for source in code_cells(path)[1:]:  # every launch uses what the setup chose
        calls = re.findall(r"notebook_launcher\((?!\.\.\.)[^\n]*", source)  # not a comment's "(...)"
        calls = [c for c in calls if "earlier" not in source or "train_with_a_server" not in c]  # a second kernel's own
        assert all("num_processes=num_processes" in c for c in calls), calls
        if needs_two:
            assert all("cpu=cpu" in c for c in calls), calls


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_where_nblaunch_is_missing_the_setup_cell_installs_it_with_the_examples(path, monkeypatch):
    _, shell = run_setup(path, monkeypatch, gpus=0, installed=False)
    assert shell.magics[0] == ("pip", f'install -q "{INSTALL}"')
    others = [line.split()[-1] for _, line in shell.magics[1:]]  # what else the notebook needs, if missing here
    assert all(importlib.util.find_spec(package) is None for package in others), others
