"""The notebooks docs/refresh.py lists are committed with their outputs (it saves them), so a
visitor on GitHub sees each launch's summary. Here: every launch cell still holds its summary, the saved
file names no path of the machine that ran it, and its code is what tests/notebooks runs."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).parents[2]


def _saved_by_refresh() -> list[str]:
    """The one list of notebooks saved with their outputs: docs/refresh.py's."""
    spec = importlib.util.spec_from_file_location("refresh", ROOT / "docs" / "refresh.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    return refresh.SAVED_WITH_OUTPUTS


SAVED = _saved_by_refresh()
LAUNCH = re.compile(r"^(\w+ = )?notebook_launcher\(", re.M)  # a cell's own launch, not a mention or a string


@pytest.mark.parametrize("name", SAVED)
def test_every_launch_cell_was_saved_with_its_summary(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    launches = [c for c in nb.cells if c.cell_type == "code" and LAUNCH.search(c.source) and 'display="none"' not in c.source]
    assert launches
    for cell in launches:
        html = [o.data["text/html"] for o in cell.outputs if "text/html" in o.get("data", {})]
        assert any("nbl-summary" in h for h in html), f"{name}: no saved summary in:\n{cell.source}"


@pytest.mark.parametrize("name", SAVED)
def test_the_saved_notebook_names_no_local_path(name):
    text = (ROOT / "notebooks" / name).read_text()
    for local in {str(ROOT), sys.prefix, str(Path.home())} - {"/"}:
        assert local not in text, f"{name} holds {local}: run docs/refresh.py, which replaces such paths"
