"""How a launch's ranks start, and how they begin with what they will import.

A launch's ranks are forked from one process: this one (``fork``), or the launch server, a fresh
interpreter that never touches CUDA (``server_starter``: where CUDA is started here, or
``start_method="spawn"``); elsewhere than Linux each is a fresh interpreter (``spawn``), on a TPU
host torch_xla's ``xmp.spawn`` starts them (``xla_host``). ``planning/plan.start_method_for``
decides which; ``choice.starter_for`` names the :class:`~nblaunch.launch.starting.base.Starter`.
Before the fork, the process the ranks come from imports what they will import (``preload``):
the installed libraries the function's code imports and names, ``torch._dynamo`` where it trains,
and what earlier ranks of the same function said they imported (``rank_imports``). Each library
is imported once there instead of once per rank, and every later launch finds it loaded; nothing
runs in the background, before or after a launch.
"""
