"""The kernel's interrupt during a launch that trains (a real Jupyter kernel, its real interrupt):
every rank stops at one common step and saves under project_dir, the cell names the folder, and a
``resume=True`` launch in a new kernel ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_session import KernelSession

pytestmark = pytest.mark.notebooks

SCRIPTS = Path(__file__).parents[1] / "launch" / "scripts"

CELL = """
import sys, torch
sys.path.insert(0, {scripts!r})
import nblaunch
from long_run import train
results = nblaunch.notebook_launcher(train, args=({project!r}, -1, False, {marker!r}), num_processes=2,
                                     display="text", resume={resume})
torch.save(results[0][1], {project!r} + "/weights.pt")
print("STEPS", [steps for steps, _ in results])
"""


def test_the_kernels_interrupt_saves_at_one_step_and_a_new_kernel_resumes_to_the_same_weights(tmp_path):
    project, marker = str(tmp_path / "stopped"), str(tmp_path / "step15")
    kernel = KernelSession(str(tmp_path))
    try:
        ran = kernel.run(CELL.format(scripts=str(SCRIPTS), project=project, marker=marker, resume=False),
                         interrupt_when=["step15"], timeout=120)
    finally:
        kernel.close()
    assert ran.error is not None and ran.error[0] == "LaunchInterrupted", ran.text
    found = re.search(r"every rank stopped after (\d+) training steps and saved its state in (\S+);", ran.error[1])
    assert found and found[2] == f"{project}/checkpoints/checkpoint_0", ran.error
    steps = int(found[1])
    assert 15 <= steps < 40
    for rank in (0, 1):
        assert f"[rank {rank}] stopped: stopped after {steps} training steps" in ran.text
    kernel = KernelSession(str(tmp_path))  # a new kernel: a new process
    try:
        resumed = kernel.run(CELL.format(scripts=str(SCRIPTS), project=project, marker=None, resume=True), timeout=120)
    finally:
        kernel.close()
    assert f"STEPS [{40 - steps}, {40 - steps}]" in resumed.text, resumed.text + str(resumed.error)
    (tmp_path / "whole").mkdir()
    whole = subprocess.run([sys.executable, str(SCRIPTS / "long_run.py"), str(tmp_path / "whole")],
                           capture_output=True, text=True, timeout=120)
    assert "STEPS [40, 40]" in whole.stdout, whole.stderr
    a, b = torch.load(f"{project}/weights.pt"), torch.load(tmp_path / "whole" / "weights.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
