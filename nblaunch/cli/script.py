"""What each rank of ``nblaunch launch`` runs: the user's script (or module) as ``__main__``,
with its own ``sys.argv``, as ``python script.py args`` (or ``python -m module args``) would.

Kept import-light: it is the function the ranks receive.
"""

from __future__ import annotations

import os
import runpy
import sys
from datetime import timedelta

# How long rank 0 waits for the others to finish (it hosts the rendezvous): longer than any run.
_WAIT_FOR_OTHERS = timedelta(days=30)


class Script:
    """A script and its arguments as the function a launch runs; named after the script in the
    launch's lines (``nblaunch: train.py on 2 processes ...``). Picklable, for spawned ranks.
    Paths are taken from the launcher's directory, also for ranks that start elsewhere (Ray).
    ``environ`` is added to each rank's environment before the script starts (``--use_fsdp``'s
    ``FSDP_*`` variables): it travels with the script, so ranks on other machines get it too.

    Example::

        notebook_launcher(Script("train.py", ["--lr", "3e-4"]), num_processes=2)
    """

    def __init__(self, target: str, script_args: list[str], as_module: bool = False,
                 environ: dict[str, str] | None = None) -> None:
        self.target, self.script_args, self.as_module, self.cwd = target, list(script_args), as_module, os.getcwd()
        self.environ = dict(environ or {})
        self.__qualname__ = f"-m {target}" if as_module else os.path.basename(target)

    def __call__(self) -> None:
        os.environ.update(self.environ)
        target = self.target
        if not self.as_module and os.getcwd() != self.cwd:  # a rank started elsewhere (Ray)
            target = os.path.join(self.cwd, target)
        run_script(target, self.script_args, self.as_module, self.cwd)


def run_script(target: str, script_args: list[str], as_module: bool, cwd: str) -> None:
    """Run ``target`` as ``__main__``. ``sys.exit(0)`` is a clean end; another exit code, or an
    exception, fails the rank with the script's own line in the traceback."""
    sys.argv = [target, *script_args]
    try:
        if as_module:
            sys.path.insert(0, cwd)  # as python -m does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as python script.py does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_request:
        if exit_request.code not in (None, 0):
            raise
    _finish_together()


def _finish_together() -> None:
    """Rank 0 hosts the rendezvous store (torchrun's agent hosts it for its ranks): if its script
    ends at once, it waits until every rank has finished too, or the others could not finish
    joining the group (the classic hello-world script). Through the store, not a collective:
    nothing to mismatch with what the script left in flight."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return
    store = distributed.distributed_c10d._get_default_store()
    rank, world = distributed.get_rank(), distributed.get_world_size()
    store.set(f"nblaunch/finished/{rank}", "1")
    if rank == 0:
        store.wait([f"nblaunch/finished/{r}" for r in range(world)], _WAIT_FOR_OTHERS)
