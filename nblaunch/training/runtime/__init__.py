"""The process underneath training: who this rank is (``state``, ``environment``), talking to
the other ranks (``collectives``, ``xla``), random states (``seed``), nested tensors (``tree``),
splitting inputs (``splitting``), and Accelerate's process-level helpers (``logger``, ``memory``,
``availability``).

The bottom layer of ``nblaunch.training``: it imports nothing from the other folders.
``tree``, ``xla`` (which loads torch_xla only when called) and ``environment`` are leaves.
"""
