"""The ``Accelerator``: its constructor (``core``) and its groups of methods (``prepare``,
``training_step``, ``collectives``, ``persistence``), each typed against ``host``, which
declares everything they read from the Accelerator.

The top layer of ``nblaunch.training``: it may import every other folder.
"""
