"""The training step: the prepared optimizer and scheduler (``optim``), the gradient
accumulation bookkeeping (``gradient_state``, ``accumulation``), ``LocalSGD`` (``local_sgd``)
and the profiler (``profiling``).

Imports ``runtime``, ``options`` and ``model`` only.
"""
