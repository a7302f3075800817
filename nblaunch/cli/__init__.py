"""The ``nblaunch`` command: one module per sub-command (``demo``, ``launch``, ``test``,
``env``), each with ``add_parser(commands)`` and ``run(options) -> exit status``; ``outcome``
turns a launch's end into what a terminal user reads and the exit status."""
