"""The worker side of a launch: what runs inside each rank's process.

Nothing here imports ipywidgets or the display; the training side talks to the launcher only
through :mod:`nblaunch.worker.channel`.
"""
