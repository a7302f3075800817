"""Starting a launch's processes: one :class:`~nblaunch.launch.starting.base.Starter` per way
(``fork``, ``spawn``, ``xla_host``), the launcher's handle on each process and its pipes
(``processes``), and what every start relies on: the launcher's own descriptors (``fdtable``),
the one thread ranks are forked from (``forking_thread``) and shared memory for big arguments
(``payload``)."""
