"""Watching one attempt's ranks on this machine: the :class:`~.supervisor.Supervisor`'s select
loop over every rank's pipes (``watched``: what it knows of one rank; ``lines``: bytes to lines),
a launch gone quiet (``quiet``), and failures that are symptoms of another (``diagnosis``)."""
