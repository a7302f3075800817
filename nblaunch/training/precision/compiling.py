"""Compiling prepared models (``dynamo_backend``, ``TorchDynamoPlugin``): the model's ``forward``,
already converted, placed and autocast, is compiled in place, before DDP or FSDP2 wrap it.

- In place, so ``prepare`` returns what it returns without compiling (DDP, the FSDP2 module,
  the model), with the same ``state_dict`` keys: checkpoints, ``no_sync`` and ``unwrap_model``
  see what they see eagerly, and the unwrapped model calls compiled (as Accelerate's
  ``keep_torch_compile=True``).
- The model's own ``forward``, not DDP's: Accelerate compiles DDP's wrapper, and dynamo skips
  torch's own files there (DDP's forward breaks the graph, and the Sequential or torch layer under
  it is never traced: nothing compiles); the compiled forward under DDP is torch's
  ``DDP(torch.compile(model))``, under FSDP2 torchtitan's per-block compile (regional).
- Regional compilation compiles each block of the model's ``ModuleList`` s instead: the blocks
  share one compiled graph, so a deep model compiles in about the time of one block.
- fp8 on a GPU with fp8 units compiles unless told ``dynamo_backend="no"`` (``Precision.wants_compile``),
  said in one line on the main process.
- A compile that fails names the line of the model it stopped at and what to try (graph breaks
  allowed, or eager), on the forward that tried it: before any collective of the step.
- Compiled code is cached on disk where every launch finds it (``nblaunch.launch.planning.compile_cache``).

Example::

    step = CompileStep(TorchDynamoPlugin(backend="inductor"), precision, main_process=True)
    step.compile(model)              # model.forward is now torch.compile(model.forward, backend="inductor")
"""

from __future__ import annotations

import copy
import functools
import sys
import traceback
from typing import Any, Callable

import torch

from nblaunch.training.options.dynamo_plugin import TorchDynamoPlugin
from nblaunch.training.precision.precision_interface import Precision
from nblaunch.worker.compile_watch import watch_compiles

__all__ = ["CompileStep", "CompileFailed", "is_compiled", "check_backend"]

FP8_COMPILES = ("nblaunch: mixed_precision='fp8' trains compiled (torch.compile, inductor), where torchao's fp8 "
                "casts fuse and beat bf16; Accelerator(dynamo_backend='no') trains eagerly")


class CompileFailed(RuntimeError):
    """``torch.compile`` could not compile a prepared model; the message says where and what to try."""


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a block of it is compiled already (``torch.compile``, ``Module.compile``
    or a compiled ``forward``)."""
    return any(type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
               or isinstance(m.__dict__.get("forward"), _CompiledForward) for m in model.modules())


class CompileStep:
    """Whether and how ``prepare`` compiles: ``plugin`` None when nothing asked (no argument, no
    ``ACCELERATE_DYNAMO_BACKEND``): then only where the precision wants it (fp8 on a GPU)."""

    def __init__(self, plugin: TorchDynamoPlugin | None, precision: Precision, main_process: bool) -> None:
        if plugin is None:
            plugin = TorchDynamoPlugin(backend="inductor" if precision.wants_compile else "no")
            if precision.wants_compile and main_process:
                print(FP8_COMPILES, flush=True)
        self.plugin = plugin
        if plugin.enabled:
            check_backend(plugin.backend)

    @property
    def enabled(self) -> bool:
        return self.plugin.enabled

    def compile(self, model: torch.nn.Module) -> None:
        """Compile the model's ``forward`` in place, or each repeated block's (regional), as the
        plugin says; nothing when compiling is off or the model is compiled already."""
        if not self.enabled or is_compiled(model):
            return
        watch_compiles()  # the rank's row says "compiling" while it does
        blocks = [block for module in model.modules() if isinstance(module, torch.nn.ModuleList) for block in module]
        if not self.plugin.use_regional_compilation or not blocks:
            blocks = [model]
        for block in blocks:
            what = "the model" if block is model else f"a block of the model ({type(block).__name__})"
            block.forward = _CompiledForward(block.forward, self.plugin, what)


def check_backend(backend: str) -> None:
    """Refuse, listing the ones there are, a backend this torch does not have."""
    import torch._dynamo  # deferred: ~1 s where nothing compiles

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"dynamo_backend={backend!r} is not a torch.compile backend here; these are: "
                         f"{', '.join(sorted(known))} (or 'no')")


class _CompiledForward:
    """A module's ``forward`` compiled, whose compile failure is told as one (where in the user's
    code, what to try). It keeps the ``forward`` it compiles, so a copy of the model
    (``copy.deepcopy``: an EMA, a teacher) or a pickled one compiles its own, not this one's."""

    def __init__(self, forward: Callable, plugin: TorchDynamoPlugin, what: str) -> None:
        self.original, self.plugin, self.what = forward, plugin, what
        self.compiled = torch.compile(forward, **plugin.to_kwargs())  # compiles at its first call
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:
            if not _is_compile_error(error):
                raise
            raise CompileFailed(_explain(error, self.plugin, self.what)) from error

    def __deepcopy__(self, memo: dict) -> "_CompiledForward":
        return _CompiledForward(copy.deepcopy(self.original, memo), self.plugin, self.what)

    def __reduce__(self) -> tuple:
        return _CompiledForward, (self.original, self.plugin, self.what)


def _is_compile_error(error: BaseException) -> bool:
    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(error, exc.TorchDynamoException) and not isinstance(
        error, getattr(exc, "TorchRuntimeError", ()))  # the user's own error, met while tracing: it stays


def _explain(error: BaseException, plugin: TorchDynamoPlugin, what: str) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"torch.compile could not compile {what} (backend {plugin.backend!r}): {first}"]
    where = _user_line(error)
    if where:
        lines.append(f"  at {where}")
    if plugin.fullgraph:
        lines.append("-> TorchDynamoPlugin(fullgraph=False) lets the forward break into several graphs there, "
                     "or Accelerator(dynamo_backend='no') trains eagerly")
    else:
        lines.append("-> Accelerator(dynamo_backend='no') trains eagerly; dynamo_backend='aot_eager' tells a "
                     "compiler (Inductor) failure from a tracing one")
    return "\n".join(lines)


def _user_line(error: BaseException) -> str:
    """``file:line (code)`` of the user's code where dynamo stopped, from the error's own stack."""
    stack = getattr(error, "real_stack", None)
    if stack:
        frame = stack[-1]
        return f"{frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")
    summary = traceback.extract_tb(error.__traceback__)
    return f"{summary[-1].filename}:{summary[-1].lineno}" if summary else ""
