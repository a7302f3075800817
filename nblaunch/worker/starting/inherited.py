"""State that other libraries keep per process, which a forked rank must not inherit.

A rank forked from a kernel where Hugging Face Accelerate already ran (an ``Accelerator()`` in a
cell, ``TrainingArguments``) would reuse that process's state: a single, non-distributed one, so
its ``Accelerator`` would not join the launch's process group. Accelerate's own launcher refuses
to start then; a forked rank simply starts without it.

A rank forked from a kernel also inherits the kernel's interactive prompts, and Lightning, seeing
them, would refuse to join the launch's ranks with ``strategy="ddp"``; and the imports other
threads of the kernel had under way, which no thread of the rank will ever finish.
"""

from __future__ import annotations

import sys
import threading

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


# Lightning reads ``sys.ps1`` once, at import, into ``_IS_INTERACTIVE`` (in every module that
# uses it), and then refuses ``strategy="ddp"`` ("not compatible with an interactive environment").
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def leave_interactive_session() -> None:
    """A rank is a worker, not the interactive session it was forked from: drop the prompts
    (``sys.ps1``, ``sys.ps2``) IPython set in the kernel, which libraries read as "interactive",
    and correct what Lightning already read from them if the kernel imported it.

    Example (in a rank forked from a kernel that ran ``import lightning``)::

        leave_interactive_session()
        lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")  # joins the launch's ranks
    """
    for prompt in ("ps1", "ps2"):
        if hasattr(sys, prompt):
            delattr(sys, prompt)
    if not any(package in sys.modules for package in _LIGHTNING_PACKAGES):
        return
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)  # never a module's __getattr__: it may import
        if (name.partition(".")[0] in _LIGHTNING_PACKAGES and isinstance(namespace, dict)
                and namespace.get("_IS_INTERACTIVE") is True):
            namespace["_IS_INTERACTIVE"] = False


def forget_half_imported() -> None:
    """Imports another thread of the parent had under way at the fork (the kernel's own cells, or
    nblaunch importing ahead for the next launch): no thread here will finish them, and each one's
    module lock stays held for ever, so importing the module here would wait for ever. Each such
    module is forgotten, with its lock: this process imports it afresh if it needs it.
    """
    bootstrap = sys.modules.get("importlib._bootstrap")
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return
    me = threading.get_ident()  # the thread that forked: the only one that came along
    for name, ref in list(locks.items()):
        lock = ref() if callable(ref) else None
        owner = getattr(lock, "owner", None)
        if lock is None or owner is None or owner == me:
            continue
        locks.pop(name, None)
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if getattr(spec, "_initializing", False):
            del sys.modules[name]
