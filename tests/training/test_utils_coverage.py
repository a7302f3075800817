"""docs/accelerate-utils.md is true: every public name of ``accelerate.utils`` is either in
``nblaunch.utils`` or listed there with its reason, and the count it gives is the count here."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest

import nblaunch.utils

accelerate_utils = pytest.importorskip("accelerate.utils")
DOC = (Path(__file__).resolve().parents[2] / "docs" / "accelerate-utils.md").read_text()


def test_every_accelerate_utils_name_is_provided_or_explained():
    import accelerate

    documented_version = re.search(r"Accelerate ([\d.]+)'s `accelerate.utils`", DOC)[1]
    if not accelerate.__version__.startswith(documented_version + ".") and accelerate.__version__ != documented_version:
        pytest.skip(f"docs/accelerate-utils.md counts Accelerate {documented_version}'s names, "
                    f"this is {accelerate.__version__}")
    names = sorted(name for name in dir(accelerate_utils) if not name.startswith("_")
                   and not isinstance(getattr(accelerate_utils, name), types.ModuleType))
    provided = [name for name in names if hasattr(nblaunch.utils, name)]
    reasons = DOC.split("## Not provided", 1)[1]
    unexplained = [name for name in names if name not in provided and f"`{name}`" not in reasons]
    stale = [name for name in provided if f"`{name}`" in reasons]
    assert not unexplained, f"neither in nblaunch.utils nor explained in docs/accelerate-utils.md: {unexplained}"
    assert not stale, f"listed as not provided, but nblaunch.utils has them: {stale}"
    if importlib.util.find_spec("deepspeed") is None:
        return  # accelerate.utils shows its DeepSpeed names only beside DeepSpeed; the count is with it
    claim = re.search(r"\*\*(\d+) of (\d+)\*\*", DOC)
    assert (int(claim[1]), int(claim[2])) == (len(provided), len(names)), "update the count in docs/accelerate-utils.md"


def test_everything_nblaunch_utils_exports_exists():
    missing = [name for name in nblaunch.utils.__all__ if not hasattr(nblaunch.utils, name)]
    assert not missing and len(set(nblaunch.utils.__all__)) == len(nblaunch.utils.__all__)
