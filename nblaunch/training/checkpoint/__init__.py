"""Checkpoints: ``save_state`` / ``load_state`` (``files``) of a :class:`~.record.Prepared`
record, the plain list of what an Accelerator prepared (``record``), in Accelerate's layout
(``layout``: its file names, whole weights and random states in its formats), and ``host_saver``
(``torch.save`` that also works on XLA).

Imports ``runtime``, ``model`` (state dicts of sharded and wrapped models) and, for types only,
``step`` and ``data``; never the Accelerator.
"""
