"""XLA checks that run in every lane: versions, and a clear refusal without torch_xla."""

from __future__ import annotations

import importlib.util

import pytest

from nblaunch import LaunchConfigError, notebook_launcher
from nblaunch.launch.planning.tpu import version_problem


def test_matching_versions_are_fine():
    assert version_problem("2.9.0+cu128", "2.9.0") is None


def test_a_mismatch_says_which_versions_to_install():
    problem = version_problem("2.13.0+cpu", "2.9.0")
    assert "torch_xla 2.9.0 needs torch 2.9.0, but torch 2.13.0 is installed" in problem
    assert "pip install torch==2.9.0 'torch_xla[tpu]==2.9.0'" in problem


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_asking_for_xla_without_torch_xla_says_what_to_install():
    with pytest.raises(LaunchConfigError, match=r"needs torch_xla, which is not installed.*start_method='fork'"):
        notebook_launcher(print, num_processes=2, start_method="xla")
