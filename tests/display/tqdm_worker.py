"""Run by test_progress.py as a child process: a stand-in for a rank that uses tqdm.

Usage: python tqdm_worker.py EVENT_FD SCENARIO. Frames go to EVENT_FD through the real channel,
as in a launched worker; anything tqdm draws would land on this process's stderr.
"""

from __future__ import annotations

import sys

from nblaunch.worker import channel
from nblaunch.worker.progress import install_progress_hooks


def lazy() -> None:
    """The hook is installed before tqdm is imported, as in a spawned worker."""
    install_progress_hooks()
    assert "tqdm" not in sys.modules, "installing the hook must not import tqdm"
    from tqdm import tqdm, trange
    from tqdm.auto import tqdm as auto_tqdm
    from tqdm.notebook import tqdm as notebook_tqdm

    for _ in tqdm(range(500), desc="std", mininterval=0):
        pass
    for _ in auto_tqdm(range(300), desc="auto", disable=None):  # disable=None: off on non-ttys
        pass
    bar = notebook_tqdm(total=40, desc="notebook", leave=False)
    for _ in range(40):
        bar.update(1)
    bar.set_postfix(loss=0.25)
    bar.close()
    for _ in trange(5, desc="nested outer"):
        for _ in tqdm(range(3), desc="nested inner", leave=False):
            pass
    tqdm.write("a line written with tqdm.write")


def imported_before() -> None:
    """tqdm (and tqdm.notebook, as in a worker forked from a kernel) is imported before the hook."""
    import ipykernel.zmqshell  # noqa: F401  tqdm.autonotebook reads this as "in a notebook"
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.instance()
    from ipywidgets.widgets import widget

    live_widgets = getattr(widget, "_instances", None)  # ipywidgets 8
    if live_widgets is None:
        live_widgets = widget.Widget.widgets  # ipywidgets 7 (Colab)
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm_notebook

    assert issubclass(tqdm, tqdm_notebook), "tqdm.auto should have chosen the notebook bars"
    install_progress_hooks()
    for _ in tqdm(range(100), desc="auto from a kernel"):
        pass
    assert not live_widgets, "a worker must not build widgets"


def rich_bars() -> None:
    """rich's Progress in a rank forked from a kernel: the kernel's shell is there (rich would
    take it for Jupyter's) and FORCE_COLOR=1 (rich would take the pipe for a terminal)."""
    import os

    import builtins

    import ipykernel.zmqshell

    shell = ipykernel.zmqshell.ZMQInteractiveShell.__new__(ipykernel.zmqshell.ZMQInteractiveShell)
    builtins.get_ipython = lambda: shell  # what rich asks to tell Jupyter; a kernel's cell has it
    os.environ["FORCE_COLOR"] = "1"
    import rich

    assert rich.get_console().is_jupyter, "rich should take this process for Jupyter before the hook"
    install_progress_hooks()
    from rich.progress import Progress, track

    assert not rich.get_console().is_jupyter and not rich.get_console().is_terminal
    for _ in track(range(50), description="[green]tracked"):
        pass
    with Progress() as progress:
        kept = progress.add_task("kept", total=10)
        dropped = progress.add_task("dropped", total=5)
        progress.update(dropped, advance=2, refresh=True)
        progress.remove_task(dropped)
        for _ in range(10):
            progress.advance(kept)
        progress.reset(kept, total=4, description="again")
        progress.update(kept, completed=4, refresh=True)
        rich.print("a line printed with rich")


if __name__ == "__main__":
    channel.open_channel(int(sys.argv[1]))
    {"lazy": lazy, "imported_before": imported_before, "rich": rich_bars}[sys.argv[2]]()
    channel.close_channel()
