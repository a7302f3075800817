"""State that other libraries keep per process, which a forked rank must not inherit.

A rank forked from a kernel where Hugging Face Accelerate already ran (an ``Accelerator()`` in a
cell, a one-process launch, ``TrainingArguments``) would reuse that process's state: a single,
non-distributed one, so its ``Accelerator`` would not join the launch's process group.
Accelerate's own launcher refuses to start then; a forked rank simply starts without it.
"""

from __future__ import annotations

import sys

_ACCELERATE_STATE_CLASSES = ("AcceleratorState", "PartialState", "GradientState")


def forget_accelerate_state() -> None:
    """Empty Accelerate's shared ("Borg") state dicts, if Accelerate is loaded at all."""
    module = sys.modules.get("accelerate.state")
    if module is None:
        return
    for name in _ACCELERATE_STATE_CLASSES:
        shared = getattr(getattr(module, name, None), "_shared_state", None)
        if isinstance(shared, dict):
            shared.clear()
