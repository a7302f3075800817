"""The process underneath training: who this rank is (``state``, ``environment``), talking to
the other ranks (``collectives``, ``xla``), random states (``seed``), nested tensors (``tree``),
splitting inputs (``splitting``), and Accelerate's process-level helpers (``logger``, ``memory``,
``availability``).

The bottom layer of ``nblaunch.training``: it imports nothing from the other folders.
``tree`` is a leaf (torch only); ``xla`` imports only ``tree`` and loads torch_xla when called.
"""
