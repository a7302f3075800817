"""State that other libraries keep per process, which a forked rank must not inherit.

A rank forked from a kernel where Hugging Face Accelerate already ran (an ``Accelerator()`` in a
cell, a one-process launch, ``TrainingArguments``) would reuse that process's state: a single,
non-distributed one, so its ``Accelerator`` would not join the launch's process group.
Accelerate's own launcher refuses to start then; a forked rank simply starts without it. A
one-process launch runs in the kernel itself: the kernel's own state is put back after it.
"""

from __future__ import annotations

import sys

_ACCELERATE_STATE_CLASSES = ("AcceleratorState", "PartialState", "GradientState")


def _shared_states() -> list[dict]:
    module = sys.modules.get("accelerate.state")
    found = []
    for name in _ACCELERATE_STATE_CLASSES:
        shared = getattr(getattr(module, name, None), "_shared_state", None)
        if isinstance(shared, dict):
            found.append(shared)
    return found


def forget_accelerate_state() -> None:
    """Empty Accelerate's shared ("Borg") state dicts, if Accelerate is loaded at all."""
    for shared in _shared_states():
        shared.clear()
