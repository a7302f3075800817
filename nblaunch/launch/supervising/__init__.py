"""Watching one attempt's ranks on this machine: the :class:`~.supervisor.Supervisor`'s select
loop over every rank's pipes (``watched_rank``: what it keeps of one rank, its output cut into
lines), a launch that stalled (``stall``), a second interrupt held off while a stop is under way
(``interrupts``)."""
